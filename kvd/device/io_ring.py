"""The CPU end of the GPU-initiated I/O ring (native/gpu/io_ring.h, native/ring_proxy.h).

A producer (the GPU kernel kvd_io_ring_submit_layer, or a CPU thread in tests)
publishes read descriptors into a ring in host memory both sides see; a proxy
thread in kvd's native I/O engine drains them into io_uring, reads into
staging, checks each read's crc32c, copies it to its target on `device`,
and counts it done in its layer. Targets are addresses in this process:
device memory it allocated or opened through IPC, or host memory.

    ring = RingMemory(capacity=256, layers=32)        # mmap-backed, shareable by path
    proxy = start_proxy(device, ring, fds, targets=[pool_memory], staging_bytes=64 << 20)
    ...                                               # producers publish, waiters wait
    proxy.stop()
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvd._native import IO_RING_HEADER_BYTES, PROXY_ALIGN, RingProxy, io_ring_init
from kvd.device.api import Device, Memory
from kvd.pages import huge_page_memory

DESC_BYTES = 64


def ring_bytes(capacity: int) -> int:
    return IO_RING_HEADER_BYTES + capacity * DESC_BYTES


class RingMemory:
    """A ring laid out in a shared file mapping; another process maps `path` to produce."""

    def __init__(self, path: str, capacity: int, layers: int) -> None:
        self.path = path
        nbytes = ring_bytes(capacity)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            self.buffer = mmap.mmap(fd, nbytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        io_ring_init(self.buffer, capacity, layers)
        self._counters = np.frombuffer(self.buffer, dtype=np.uint64, count=IO_RING_HEADER_BYTES // 8)

    def done(self, layer: int) -> int:
        """Reads of `layer` completed so far (a plain load: for tests and reports, not for ordering)."""
        return int(self._counters[5 + layer])

    def failed(self, layer: int) -> int:
        return int(self._counters[5 + 256 + layer])

    def close(self) -> None:
        self._counters = None
        self.buffer.close()


@dataclass
class Proxy:
    """A running RingProxy and what it holds registered with the device."""

    native: RingProxy
    device: Device
    staging: memoryview
    registered: Memory | None = None
    stats: dict = field(default_factory=dict)

    def stop(self) -> dict:
        self.native.stop()
        self.stats = self.native.stats()
        if self.registered is not None:
            self.device.unregister_host(self.registered)
            self.registered = None
        return self.stats


def target_regions(targets: Sequence[Memory]) -> np.ndarray:
    """(address, length) pairs of the memories reads may land in, sorted, as RingProxy takes them."""
    pairs = sorted((memory.address, memory.nbytes) for memory in targets)
    return np.array(pairs, dtype=np.uint64).reshape(-1)


def start_proxy(device: Device, ring: RingMemory, fds, targets: Sequence[Memory], staging_bytes: int = 16 << 20,
                batch_entries: int = 64, queue_depth: int = 64) -> Proxy:
    """A proxy copying to `device`'s memory: memcpy on the CPU device, the CUDA driver on a GPU.
    Reads land only inside `targets` (an engine's registered pool: the ring is shared with its
    producers, so nothing it says is trusted). On CUDA the staging is page-locked (cudaHostRegister)
    so the copies to the GPU are DMA."""
    staging_bytes = -(-staging_bytes // (2 * PROXY_ALIGN)) * 2 * PROXY_ALIGN
    staging = huge_page_memory(staging_bytes)
    registered = None
    if device.kind != "cpu":
        registered = device.register_host(np.frombuffer(staging, dtype=np.uint8).ctypes.data, staging_bytes)
    try:
        native = RingProxy(ring.buffer, np.asarray(fds, dtype=np.int32), staging, target_regions(targets),
                           batch_entries=batch_entries, queue_depth=queue_depth,
                           device=-1 if device.kind == "cpu" else device.index)
    except BaseException:
        if registered is not None:
            device.unregister_host(registered)
        raise
    return Proxy(native, device, staging, registered)
