"""Devices behind one interface (kvd.device.api): the CPU one everywhere, CUDA on GPU hosts.

    device = open_device("cpu")          # or "cuda", or "auto"
    pool = device.alloc(64 << 20)
    stream = device.stream()
    stream.copy_blocks(pool, dst_offsets, arena_memory, src_offsets, block_bytes)
    stream.write_flag(flags, layer, layer + 1)
"""

from __future__ import annotations

from kvd.device.api import DeviceError, Event, IpcHandle, Memory, NoDevice, Stream
from kvd.device.api import Device as Device

__all__ = ["Device", "DeviceError", "Event", "IpcHandle", "Memory", "NoDevice", "Stream", "open_device"]


def open_device(kind: str = "cpu", index: int = 0) -> Device:
    """The device `index` of `kind`: "cpu", or "cuda" (NoDevice without a driver or GPU)."""
    if kind == "cpu":
        from kvd.device.cpu import CpuDevice

        return CpuDevice(index)
    if kind == "cuda":
        from kvd.device.cuda import CudaDevice

        return CudaDevice(index)
    raise DeviceError(f"unknown device kind {kind!r}: cpu or cuda")
