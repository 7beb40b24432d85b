"""The device interface, against every implementation this machine can open (the CPU one always).

Tests touch device memory only through the interface (copies to and from a
registered host staging buffer), so they hold for CUDA as for the CPU device.
Real separate processes share memory through IPC handles and signal each
other through flag words, as an engine and kvd do. KVD_REQUIRE_GPU=1
(`make gpu-check`) fails them where CUDA cannot be opened.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvd.device import DeviceError, IpcHandle, Memory, NoDevice, open_device
from kvd.device.api import FLAG_BYTES
from kvd.device.layers import copy_layers
from tests.device.staging import Staging


def test_batched_copies_move_exactly_the_blocks_named(device):
    block, count = 4096 + 64, 64
    src, dst = device.alloc(block * count), device.alloc(block * count)
    staging, stream = Staging(device, block * count), device.stream()
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, block * count, dtype=np.uint8)
    staging.put(stream, src, 0, data)
    staging.put(stream, dst, 0, np.zeros(block * count, dtype=np.uint8))
    order = rng.permutation(count)[:40]
    stream.copy_blocks(dst, np.arange(40) * block, src, order * block, block)
    got = staging.get(stream, dst, 0, block * count).reshape(count, block)
    assert np.array_equal(got[:40], data.reshape(count, block)[order])
    assert not got[40:].any()
    stream.close()
    device.free(src)
    device.free(dst)


def test_out_of_range_copies_and_flags_are_refused_before_they_run(device):
    memory = device.alloc(1 << 16)
    stream = device.stream()
    with pytest.raises(DeviceError, match="outside"):
        stream.copy_blocks(memory, [(1 << 16) - 100], memory, [0], 200)
    with pytest.raises(DeviceError, match="destinations for"):
        stream.copy_blocks(memory, [0, 1], memory, [0], 8)
    with pytest.raises(DeviceError, match="flag word"):
        stream.write_flag(memory, (1 << 16) // FLAG_BYTES, 1)
    stream.synchronize(timeout_s=10)  # nothing of the above ran, and the stream is clean
    stream.close()
    with pytest.raises(DeviceError, match="no allocation"):
        device.free(Memory(memory.address + 8, 8, device.uuid))
    device.free(memory)


def test_handles_round_trip_and_foreign_or_malformed_ones_are_refused(device):
    memory = device.alloc(1 << 20)
    handle = device.export(memory, offset=4096, nbytes=8192)
    assert IpcHandle.from_bytes(handle.to_bytes()) == handle
    other = IpcHandle(handle.kind, "00000000-0000-0000-0000-000000000000", handle.handle, 0, 64)
    with pytest.raises(DeviceError, match="this device is"):
        device.open(other)
    with pytest.raises(DeviceError, match="version 1"):
        IpcHandle.from_bytes(handle.to_bytes() + b"x")
    with pytest.raises(DeviceError, match="outside"):
        device.export(memory, offset=1 << 20, nbytes=1)
    device.free(memory)


ENGINE = textwrap.dedent("""
    import sys
    import numpy as np
    from kvd.device import IpcHandle, open_device
    from tests.device.staging import Staging

    device = open_device(sys.argv[1])
    pool = device.open(IpcHandle.from_bytes(bytes.fromhex(sys.argv[2])))
    again = device.open(IpcHandle.from_bytes(bytes.fromhex(sys.argv[2])))
    flags = device.open(IpcHandle.from_bytes(bytes.fromhex(sys.argv[3])))
    layers, layer_bytes = int(sys.argv[4]), int(sys.argv[5])
    stream, staging = device.stream(), Staging(device, pool.nbytes)
    staging.put(stream, pool, 0, np.arange(pool.nbytes, dtype=np.uint64).astype(np.uint8) ^ 0x5A)
    stream.write_flag(flags, 0, 1)          # "the pool is written": kvd may save it
    # Then wait for kvd's load, layer by layer, and check each layer as its flag says it landed.
    for layer in range(layers):
        stream.wait_flag(flags, 1, 100 + layer + 1)
        landed = min(int(staging.get(stream, flags, 8, 8).view(np.uint64)[0]) - 100, layers)
        assert landed >= layer + 1, (layer, landed)
        view = staging.get(stream, pool, 0, landed * layer_bytes)
        for l in range(landed):
            assert (view[l * layer_bytes:(l + 1) * layer_bytes] == (l + 1) % 256).all(), (layer, l)
    device.close(again)
    device.close(pool)
    device.close(flags)
    print("engine done")
""")


def test_another_process_writes_through_a_handle_and_waits_on_per_layer_flags(device, tmp_path):
    layers, layer_bytes = 8, 1 << 16
    pool, flags, arena = device.alloc(layers * layer_bytes), device.alloc(4096), device.alloc(layers * layer_bytes)
    stream, staging = device.stream(), Staging(device, layers * layer_bytes)
    staging.put(stream, flags, 0, np.zeros(4096, dtype=np.uint8))
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    engine = subprocess.Popen([sys.executable, str(script), device.kind, device.export(pool).to_bytes().hex(),
                               device.export(flags).to_bytes().hex(), str(layers), str(layer_bytes)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        # Save: wait for the engine's "written" flag, then gather the pool into the arena.
        stream.wait_flag(flags, 0, 1)
        stream.copy_blocks(arena, [0], pool, [0], layers * layer_bytes)
        expected = np.arange(layers * layer_bytes, dtype=np.uint64).astype(np.uint8) ^ 0x5A
        assert np.array_equal(staging.get(stream, arena, 0, layers * layer_bytes), expected)
        # Load: layer l's bytes are l + 1, from the arena into the pool, one flag store per layer.
        staging.put(stream, arena, 0, np.repeat(np.arange(1, layers + 1, dtype=np.uint8), layer_bytes))
        offsets = [[layer * layer_bytes] for layer in range(layers)]
        assert copy_layers(stream, pool, offsets, arena, offsets, layer_bytes, flags, 1, base=100) == 100 + layers
        stream.synchronize(timeout_s=20)
        out, err = engine.communicate(timeout=60)
        assert engine.returncode == 0, err
        assert "engine done" in out
        stream.close()
    finally:
        if engine.poll() is None:
            engine.kill()
    for memory in (pool, flags, arena):
        device.free(memory)


def test_streams_order_through_events_and_flags(device):
    memory, flags = device.alloc(1 << 16), device.alloc(64)
    first, second = device.stream(), device.stream()
    staging = Staging(device, 1 << 16)
    staging.put(first, memory, 0, np.r_[np.full(4096, 7, np.uint8), np.zeros((1 << 16) - 4096, np.uint8)])
    staging.put(first, flags, 0, np.zeros(64, dtype=np.uint8))
    # second waits for first's flag before copying what first copies.
    second.wait_flag(flags, 0, 1)
    second.copy_blocks(memory, [8192], memory, [4096], 4096)
    # Held on the flag: it cannot finish whatever the time given (a broken wait would).
    with pytest.raises(DeviceError, match="within"):
        second.synchronize(timeout_s=0.2)
    assert not staging.get(first, memory, 8192, 4096).any()
    first.copy_blocks(memory, [4096], memory, [0], 4096)
    first.write_flag(flags, 0, 1)
    second.synchronize(timeout_s=10)
    assert (staging.get(first, memory, 8192, 4096) == 7).all()
    # An event of one stream holds another.
    event = first.record()
    second.wait_event(event)
    second.synchronize(timeout_s=10)
    assert event.query()
    first.close()
    second.close()
    device.free(memory)
    device.free(flags)


def test_host_memory_registered_with_the_device_takes_part_in_copies(device):
    host = np.zeros(1 << 16, dtype=np.uint8)
    registered = device.register_host(host.ctypes.data, host.nbytes)
    pool = device.alloc(1 << 16)
    stream = device.stream()
    host[:4096] = 9
    stream.copy_blocks(pool, [8192], registered, [0], 4096)
    stream.copy_blocks(registered, [4096], pool, [8192], 4096)
    stream.synchronize(timeout_s=10)
    assert (host[4096:8192] == 9).all()
    stream.close()
    device.unregister_host(registered)
    with pytest.raises(DeviceError, match="no host registration"):
        device.unregister_host(registered)
    device.free(pool)


def test_host_memory_registered_twice_is_refused_until_the_first_registration_is_released(device):
    """A registration that outlives its memory makes a later one at those addresses fail (CUDA error
    712, cudaErrorHostMemoryAlreadyRegistered); the CPU device refuses it the same way, so a leak shows
    here rather than first on a GPU (it did: tests' staging buffers were never unregistered)."""
    host = np.zeros(3 << 12, dtype=np.uint8)
    first = device.register_host(host.ctypes.data, 2 << 12)
    with pytest.raises(DeviceError) as refused:
        device.register_host(host.ctypes.data + (1 << 12), 2 << 12)
    assert refused.value.error_number == 712
    device.unregister_host(first)
    device.unregister_host(device.register_host(host.ctypes.data + (1 << 12), 2 << 12))


def test_cuda_opens_or_says_precisely_why_not():
    """Here (no GPU) opening CUDA is NoDevice: no driver is 35, a driver without GPUs 100."""
    try:
        device = open_device("cuda")
    except NoDevice as caught:
        assert caught.error_number in (35, 100), str(caught)
        assert caught.code == "FAILED_PRECONDITION"
    else:
        assert device.kind == "cuda" and len(device.uuid) == 36
    with pytest.raises(DeviceError, match="unknown device kind"):
        open_device("tpu")
