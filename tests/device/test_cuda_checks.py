"""kvd.device.cuda's own checks around CUDA, on a stand-in for cuda-bindings (tests/device/fake_cuda.py):
which driver it accepts, the range an IPC handle may name, the device made current on every thread,
host registrations addressed as the device sees them, the 64-bit stream memory operations its flag
words need, and batched copies handed to native code as arrays. What CUDA itself does is only seen on
a GPU (`make gpu-check`, tools/device_check.sh)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import kvd._native
from kvd.device import DeviceError, IpcHandle, Memory, NoDevice
from kvd.device.cuda import CudaDevice, DriverTooOld, check_driver
from tests.device.fake_cuda import FakeCuda


@pytest.mark.parametrize("driver, bindings", [(12040, "12.9.0"), (12080, "12.9.2"), (13000, "13.0.3"),
                                              (13010, "12.9.0")])
def test_a_driver_at_least_the_bindings_major_opens(driver, bindings):
    check_driver(driver, bindings)


def test_a_driver_older_than_the_bindings_says_both_versions_and_what_to_install():
    with pytest.raises(DriverTooOld, match=r"supports CUDA 12\.4, and cuda-bindings 13\.0\.3 needs a CUDA 13 "
                                           r"driver: install cuda-bindings 12\.9"):
        check_driver(12040, "13.0.3")
    with pytest.raises(NoDevice, match="no CUDA driver"):
        check_driver(-1, "12.9.0")


def test_opening_an_old_driver_is_driver_too_old_not_a_bare_no_device(monkeypatch):
    FakeCuda().install(monkeypatch, driver_version=12020, bindings_version="13.0.3")
    with pytest.raises(DriverTooOld, match="CUDA 12.2"):
        CudaDevice(0)


def _handle(device: CudaDevice, offset: int, nbytes: int) -> IpcHandle:
    return IpcHandle("cuda", device.uuid, b"\x01" * 64, offset, nbytes)


def test_an_ipc_handle_naming_bytes_past_its_allocation_is_refused_and_closed(monkeypatch):
    fake = FakeCuda(allocation_bytes=1 << 20)
    fake.install(monkeypatch)
    device = CudaDevice(0)
    inside = device.open(_handle(device, 4096, (1 << 20) - 4096))  # up to the last byte
    assert inside.nbytes == (1 << 20) - 4096
    device.close(inside)
    for offset, nbytes in ((0, (1 << 20) + 1), ((1 << 20) - 8, 16), (1 << 21, 8)):
        with pytest.raises(DeviceError, match="of an allocation of 1048576 bytes"):
            device.open(_handle(device, offset, nbytes))
    assert set(fake.opened.values()) == {0}, "a refused handle stayed open"
    assert not device._opened


def test_every_call_from_a_new_thread_makes_the_device_current_first(monkeypatch):
    """The runtime's current device is per thread: the daemon's stream work runs on worker threads."""
    fake = FakeCuda()
    fake.install(monkeypatch)
    monkeypatch.setattr(kvd._native, "cuda_copy_batch", lambda *args: (0, 2))
    device = CudaDevice(0)
    stream = device.stream()
    flags = Memory(0x1000, 64, device.uuid)
    pool = Memory(0x10_0000, 1 << 16, device.uuid)
    failures: list[BaseException] = []

    def use(step) -> None:
        fake.current.device = None  # a thread that has never touched CUDA
        try:
            step()
        except BaseException as error:  # noqa: BLE001 - reported to the test below
            failures.append(error)

    steps = [lambda: stream.write_flag(flags, 1, 5), lambda: stream.wait_flag(flags, 1, 5),
             lambda: stream.record().query(), lambda: stream.record().synchronize(),
             lambda: stream.wait_event(stream.record()), lambda: stream.copy_blocks(pool, [0], pool, [4096], 64),
             lambda: device.unregister_host(device.register_host(0x20_0000, 4096)), stream.close]
    for step in steps:
        thread = threading.Thread(target=use, args=(step,))
        thread.start()
        thread.join()
    assert not failures, failures


def test_host_memory_is_addressed_as_the_device_maps_it_and_unregistered_by_its_host_address(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    device = CudaDevice(0)
    registered = device.register_host(0x30_0000, 8192)
    assert registered.address == 0x30_0000 + (1 << 56)  # what cudaHostGetDevicePointer said
    assert fake.registered == {0x30_0000: 8192}
    device.unregister_host(registered)
    assert fake.registered == {}
    with pytest.raises(DeviceError, match="no host registration"):
        device.unregister_host(registered)


def test_flag_words_need_64_bit_stream_memory_operations(monkeypatch):
    FakeCuda(memory_ops_64=False).install(monkeypatch)
    device = CudaDevice(0)
    stream = device.stream()
    flags = Memory(0x1000, 64, device.uuid)
    for operation in (stream.write_flag, stream.wait_flag):
        with pytest.raises(DeviceError, match="CAN_USE_64_BIT_STREAM_MEM_OPS is 0"):
            operation(flags, 0, 1)


def test_a_batched_copy_hands_native_code_address_arrays_and_reports_a_failed_result(monkeypatch):
    FakeCuda().install(monkeypatch)
    calls = []

    def batch(stream, targets, sources, nbytes):
        calls.append((stream, targets, sources, nbytes))
        return (0, 2) if len(calls) == 1 else (1, 2)
    monkeypatch.setattr(kvd._native, "cuda_copy_batch", batch)
    device = CudaDevice(0)
    stream = device.stream()
    dst, src = Memory(1 << 40, 1 << 30, device.uuid), Memory(1 << 41, 1 << 30, device.uuid)
    pages = np.arange(32_768, dtype=np.uint64) * 4096
    stream.copy_blocks(dst, pages, src, pages[::-1].copy(), 4096)
    handle, targets, sources, nbytes = calls[0]
    assert handle == 0x5000 and nbytes == 4096
    assert isinstance(targets, np.ndarray) and targets.dtype == np.uint64 and len(targets) == 32_768
    np.testing.assert_array_equal(targets, pages + np.uint64(1 << 40))
    np.testing.assert_array_equal(sources, pages[::-1] + np.uint64(1 << 41))
    with pytest.raises(DeviceError, match="CUresult 1"):
        stream.copy_blocks(dst, [0], src, [0], 64)


def test_an_engine_stream_is_used_never_destroyed(monkeypatch):
    fake = FakeCuda()
    fake.install(monkeypatch)
    device = CudaDevice(0)
    with pytest.raises(DeviceError, match="pass its handle"):
        device.engine_stream()
    engine = device.engine_stream(0x7777)
    engine.write_flag(Memory(0x1000, 64, device.uuid), 0, 3)
    engine.close()
    assert ("cudaStreamDestroy", ()) not in fake.calls
    own = device.stream()
    own.close()
    assert ("cudaStreamDestroy", ()) in fake.calls
