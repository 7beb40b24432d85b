"""What only the CPU device can show: streams that fail or close while they wait."""

from __future__ import annotations

import pytest

from kvd.device import DeviceError, open_device
from tests.device.staging import Staging


def test_a_stream_closed_while_it_waits_on_a_flag_ends_and_reports_it():
    device = open_device("cpu")
    flags = device.alloc(64)
    stream = device.stream()
    stream.wait_flag(flags, 0, 1)  # nobody will ever write it
    event = stream.record()
    stream.close()  # returns: the wait gives up when the stream closes
    with pytest.raises(DeviceError, match="closed while it waited"):
        event.synchronize(timeout_s=5)
    with pytest.raises(DeviceError, match="closed"):
        stream.write_flag(flags, 0, 1)
    device.free(flags)


def test_an_error_is_sticky_and_later_work_on_the_stream_is_skipped():
    device = open_device("cpu")
    memory = device.alloc(1 << 16)
    staging = Staging(device, 1 << 16)
    stream, other = device.stream(), device.stream()
    # A stream that fails: closed while it waits on a flag nobody writes.
    broken = device.stream()
    broken.wait_flag(memory, 0, 1)
    failing = broken.record()
    broken.close()
    # Waiting on its event fails this stream too, and the copy issued after does not run.
    stream.wait_event(failing)
    staging.host[:4096] = 5
    stream.copy_blocks(memory, [4096], staging.memory, [0], 4096)
    with pytest.raises(DeviceError, match="failed"):
        stream.synchronize(timeout_s=5)
    assert not staging.get(other, memory, 4096, 4096).any()
    with pytest.raises(DeviceError, match="failed"):
        stream.synchronize(timeout_s=5)  # sticky
    device.free(memory)
