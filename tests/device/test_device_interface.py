"""The device interface, against every implementation this machine can open (the CPU one always).

Real separate processes share memory through IPC handles and signal each
other through flag words, as an engine and kvd do.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kvd.device import DeviceError, IpcHandle, Memory, NoDevice, open_device
from kvd.device.api import FLAG_BYTES
from kvd.device.layers import copy_layers


def _kinds() -> list[str]:
    kinds = ["cpu"]
    try:
        open_device("cuda")
        kinds.append("cuda")
    except NoDevice:
        pass
    return kinds


@pytest.fixture(params=_kinds())
def device(request):
    return open_device(request.param)


def host_view(memory) -> np.ndarray:
    """The memory as a numpy array (CPU device memory is host memory)."""
    import ctypes

    return np.ctypeslib.as_array((ctypes.c_uint8 * memory.nbytes).from_address(memory.address))


def test_batched_copies_move_exactly_the_blocks_named(device):
    block, count = 4096 + 64, 64
    src, dst = device.alloc(block * count), device.alloc(block * count)
    rng = np.random.default_rng(1)
    host_view(src)[:] = rng.integers(0, 256, block * count, dtype=np.uint8)
    order = rng.permutation(count)[:40]
    stream = device.stream()
    stream.copy_blocks(dst, np.arange(40) * block, src, order * block, block)
    stream.synchronize(timeout_s=10)
    got = host_view(dst).reshape(count, block)
    assert np.array_equal(got[:40], host_view(src).reshape(count, block)[order])
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
    import ctypes, sys
    import numpy as np
    from kvd.device import IpcHandle, open_device

    device = open_device(sys.argv[1])
    pool = device.open(IpcHandle.from_bytes(bytes.fromhex(sys.argv[2])))
    again = device.open(IpcHandle.from_bytes(bytes.fromhex(sys.argv[2])))
    flags = device.open(IpcHandle.from_bytes(bytes.fromhex(sys.argv[3])))
    layers, layer_bytes = int(sys.argv[4]), int(sys.argv[5])
    view = np.ctypeslib.as_array((ctypes.c_uint8 * pool.nbytes).from_address(pool.address))
    view[:] = np.arange(pool.nbytes, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    stream = device.stream()
    stream.write_flag(flags, 0, 1)          # "the pool is written": kvd may save it
    # Then wait for kvd's load, layer by layer, and check each layer as its flag says it landed.
    for layer in range(layers):
        stream.wait_flag(flags, 1, 100 + layer + 1)
        stream.synchronize(timeout_s=20)
        word = ctypes.c_uint64.from_address(flags.address + 8).value
        landed = min(word - 100, layers)
        for l in range(landed):
            block = view[l * layer_bytes:(l + 1) * layer_bytes]
            assert (block == (l + 1) % 256).all(), (layer, l)
    device.close(again)
    device.close(pool)
    device.close(flags)
    print("engine done")
""")


def test_another_process_writes_through_a_handle_and_waits_on_per_layer_flags(device, tmp_path):
    layers, layer_bytes = 8, 1 << 16
    pool = device.alloc(layers * layer_bytes)
    flags = device.alloc(4096)
    arena = device.alloc(layers * layer_bytes)
    script = tmp_path / "engine.py"
    script.write_text(ENGINE)
    engine = subprocess.Popen([sys.executable, str(script), device.kind, device.export(pool).to_bytes().hex(),
                               device.export(flags).to_bytes().hex(), str(layers), str(layer_bytes)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stream = device.stream()
        # Save: wait for the engine's "written" flag, then gather the pool into the arena.
        stream.wait_flag(flags, 0, 1)
        stream.copy_blocks(arena, [0], pool, [0], layers * layer_bytes)
        stream.synchronize(timeout_s=20)
        expected = (np.arange(layers * layer_bytes, dtype=np.uint64).astype(np.uint8) ^ 0x5A)
        assert np.array_equal(host_view(arena), expected)
        # Load: per-layer blocks of (l + 1) from the arena into the pool, one flag store per layer.
        for layer in range(layers):
            host_view(arena)[layer * layer_bytes:(layer + 1) * layer_bytes] = layer + 1
        offsets = [[layer * layer_bytes] for layer in range(layers)]
        done = copy_layers(stream, pool, offsets, arena, offsets, layer_bytes, flags, 1, base=100)
        assert done == 100 + layers
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
    memory = device.alloc(1 << 20)
    flags = device.alloc(64)
    first, second = device.stream(), device.stream()
    view = host_view(memory)
    view[:4096] = 7
    # second waits for first's flag before copying what first copied.
    second.wait_flag(flags, 0, 1)
    second.copy_blocks(memory, [8192], memory, [4096], 4096)
    # Held on the flag: it cannot finish whatever the time given (a broken wait would).
    with pytest.raises(DeviceError, match="within"):
        second.synchronize(timeout_s=0.2)
    assert not view[8192:12288].any()
    first.copy_blocks(memory, [4096], memory, [0], 4096)
    first.write_flag(flags, 0, 1)
    second.synchronize(timeout_s=10)
    assert (view[8192:12288] == 7).all()
    # An event of one stream holds another.
    event = first.record()
    second.wait_event(event)
    second.synchronize(timeout_s=10)
    assert event.query()
    first.close()
    second.close()
    device.free(memory)
    device.free(flags)
