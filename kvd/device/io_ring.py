"""The CPU end of the GPU-initiated I/O ring (native/gpu/io_ring.h, native/ring_proxy.h).

A producer (the GPU kernel kvd_io_ring_submit_layer, or a CPU thread in tests)
publishes read descriptors into a ring in host memory both sides see; a proxy
thread in kvd's native I/O engine drains them into io_uring, reads into
staging, checks each read's crc32c, copies it to its target on `device`,
and counts it done in its layer. Targets are addresses in this process:
device memory it allocated or opened through IPC, or host memory.

The ring lives in a memfd: no file on any filesystem names it, so it is
never written back to a disk, and another process maps it only when handed
its descriptor (`send` / `receive` over a Unix socket, SCM_RIGHTS; or an
inherited descriptor and `RingMemory.from_fd`).

A wait for a layer (`wait` here, kvd_io_ring_wait_layer on the GPU: the same
C code) is bounded: it ends OK, FAILED as soon as a read of the layer failed,
or TIMEOUT, and writes how into one of the ring's wait records.

    ring = RingMemory(capacity=256, layers=32)        # a memfd mapping, shareable by descriptor
    ring.send(engine_socket)                          # the producer maps the same memory
    proxy = start_proxy(device, ring, fds, targets=[pool_memory], staging_bytes=64 << 20)
    result = ring.wait(layer, until=reads, timeout_s=1.0)   # WaitResult: OK, FAILED or TIMEOUT
    proxy.stop()
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from kvd._native import (IO_RING_ABANDONED_OFFSET, IO_RING_DONE_OFFSET, IO_RING_FAILED_OFFSET, IO_RING_HEADER_BYTES,
                         IO_RING_MAX_LAYERS, IO_RING_VERSION, IO_RING_WAITS, IO_RING_WAITS_OFFSET, IO_WAIT_BYTES,
                         IO_WAIT_FAILED, IO_WAIT_INVALID, IO_WAIT_OK, IO_WAIT_PENDING, IO_WAIT_TIMEOUT, PROXY_ALIGN,
                         RingProxy, io_ring_init, io_ring_publish, io_ring_wait, io_ring_wait_record)
from kvd.device.api import Device, Memory
from kvd.pages import huge_page_memory

DESC_BYTES = 64
FAILURES_IGNORED = 2**64 - 1  # failed_before that no failure count passes: wait for completions alone
# A read as a producer publishes it and a grant names it: 7 uint64 (READ_FIELDS), one row per read.
READ_FIELDS = ("file", "offset", "length", "target", "layer", "checksum", "tag")
# How a grant ended (Proxy.settle): still out, revoked unread, read and verified, read and failed.
GRANT_OUT, GRANT_REVOKED, GRANT_VERIFIED, GRANT_FAILED = 0, 1, 2, 3


def ring_bytes(capacity: int) -> int:
    return IO_RING_HEADER_BYTES + capacity * DESC_BYTES


class WaitState(IntEnum):
    """How a wait for a layer ended (KVD_IO_WAIT_* in io_ring.h)."""

    PENDING = IO_WAIT_PENDING  # armed, not ended yet
    OK = IO_WAIT_OK            # every read done, none failed past failed_before
    FAILED = IO_WAIT_FAILED    # a read failed or was abandoned: recompute the layer, or retry it
    TIMEOUT = IO_WAIT_TIMEOUT  # the deadline passed first
    INVALID = IO_WAIT_INVALID  # a layer the ring has no counter for


@dataclass(frozen=True, slots=True)
class WaitResult:
    """One wait record: counts are what the waiter saw last (abandoned reads count as done and failed)."""

    state: WaitState
    layer: int
    until: int
    done: int
    failed: int
    waited_ns: int

    @property
    def ok(self) -> bool:
        return self.state is WaitState.OK


class RingMemory:
    """A ring laid out in a memfd mapping; a producer in another process gets its descriptor
    (`send`/`receive`, or `from_fd` on an inherited one), never a path."""

    def __init__(self, capacity: int, layers: int) -> None:
        fd = os.memfd_create("kvd-io-ring", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, ring_bytes(capacity))
        except BaseException:
            os.close(fd)
            raise
        self._map(fd)
        try:
            io_ring_init(self.buffer, capacity, layers)
        except BaseException:
            self.close()
            raise
        self.capacity, self.layers = capacity, layers

    @classmethod
    def from_fd(cls, fd: int) -> RingMemory:
        """The ring another process laid out in the memory behind `fd` (duplicated: the caller still
        owns `fd`). ValueError when it holds no ring of this version."""
        ring = cls.__new__(cls)
        ring._map(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 0))
        version, capacity, layers = (int(word) for word in ring._words[:3]) if len(ring._words) else (0, 0, 0)
        fits = len(ring.buffer) >= IO_RING_HEADER_BYTES and capacity > 0 and capacity & (capacity - 1) == 0 and ring_bytes(capacity) <= len(ring.buffer)
        if version != IO_RING_VERSION or not fits or not 0 < layers <= IO_RING_MAX_LAYERS:
            ring.close()
            raise ValueError(f"not a kvd_io_ring of version {IO_RING_VERSION} (version {version}, capacity "
                             f"{capacity}, {layers} layers)")
        ring.capacity, ring.layers = capacity, layers
        return ring

    @classmethod
    def receive(cls, connection: socket.socket) -> RingMemory:
        """The ring whose descriptor arrives on `connection` (sent by `send`)."""
        _, fds, _, _ = socket.recv_fds(connection, 1, 1)
        if len(fds) != 1:
            raise ValueError("no ring descriptor arrived")
        try:
            return cls.from_fd(fds[0])
        finally:
            os.close(fds[0])

    def send(self, connection: socket.socket) -> None:
        """Hands the ring's descriptor to the process at the other end of a Unix socket (SCM_RIGHTS)."""
        socket.send_fds(connection, [b"r"], [self._fd])

    def _map(self, fd: int) -> None:
        self._fd = fd
        try:
            self.buffer = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            self._fd = -1
            raise
        self._words = np.frombuffer(self.buffer, dtype=np.uint64, count=min(len(self.buffer), IO_RING_HEADER_BYTES) // 8)

    @property
    def fd(self) -> int:
        """The memfd (owned by this object, closed with it; close-on-exec: pass it on explicitly)."""
        return self._fd

    def reset(self) -> None:
        """Every counter and wait record back to zero: no producer may be publishing, and a proxy serving
        the ring must have taken everything published (it then looks for ticket 0 again)."""
        io_ring_init(self.buffer, self.capacity, self.layers)

    def publish(self, reads: np.ndarray, *, timeout_s: float) -> int:
        """Publishes reads (rows of READ_FIELDS, uint64) in order, as the submit kernel does on a GPU;
        returns how many were published: the rest were abandoned when the ring had no room for them
        within `timeout_s` (their layers' waits then end FAILED)."""
        reads = np.ascontiguousarray(reads, dtype=np.uint64)
        if reads.ndim != 2 or reads.shape[1] != len(READ_FIELDS):
            raise ValueError(f"reads must be rows of {len(READ_FIELDS)} uint64 {READ_FIELDS}, not {reads.shape}")
        return io_ring_publish(self.buffer, reads.reshape(-1), int(timeout_s * 1e9))

    def done(self, layer: int) -> int:
        """Reads of `layer` the proxy completed so far (a plain load: for tests and reports, not for ordering)."""
        return self._counter(IO_RING_DONE_OFFSET, layer)

    def failed(self, layer: int) -> int:
        return self._counter(IO_RING_FAILED_OFFSET, layer)

    def abandoned(self, layer: int) -> int:
        """Reads of `layer` a producer gave up on before publishing them (its deadline passed)."""
        return self._counter(IO_RING_ABANDONED_OFFSET, layer)

    def _counter(self, offset: int, layer: int) -> int:
        if not 0 <= layer < IO_RING_MAX_LAYERS:
            raise ValueError(f"layer {layer} is outside the ring's {IO_RING_MAX_LAYERS} counters")
        return int(self._words[offset // 8 + layer])

    def wait(self, layer: int, until: int, *, timeout_s: float, failed_before: int = 0,
             slot: int = 0) -> WaitResult:
        """Waits on this thread (GIL released) exactly as the wait kernel does on a GPU: until `until`
        reads of `layer` are done, a read fails past `failed_before`, or `timeout_s` passes."""
        if timeout_s < 0:
            raise ValueError(f"a negative timeout ({timeout_s} s)")
        io_ring_wait(self.buffer, layer, until, failed_before, int(timeout_s * 1e9), slot)
        return self.record(slot)

    def settle(self, layer: int, until: int, *, timeout_s: float, slot: int = 0) -> WaitResult:
        """Waits for `until` completions of `layer`, failed or not: after a wait that ended early, the
        layer's targets may be reused once this is OK (no read of it is in flight any more)."""
        return self.wait(layer, until, timeout_s=timeout_s, failed_before=FAILURES_IGNORED, slot=slot)

    def arm(self, slot: int) -> None:
        """Sets wait record `slot` to PENDING, before a wait that writes it is started."""
        if not 0 <= slot < IO_RING_WAITS:
            raise ValueError(f"wait slot {slot} is outside the ring's {IO_RING_WAITS}")
        self.buffer[self.record_offset(slot):self.record_offset(slot) + IO_WAIT_BYTES] = bytes(IO_WAIT_BYTES)

    def record(self, slot: int) -> WaitResult:
        """Wait record `slot` as its waiter left it (state PENDING while it has not ended)."""
        state, layer, until, done, failed, waited_ns = io_ring_wait_record(self.buffer, slot)
        return WaitResult(WaitState(state), layer, until, done, failed, waited_ns)

    @staticmethod
    def record_offset(slot: int) -> int:
        """Byte offset of wait record `slot` in the ring's memory."""
        return IO_RING_WAITS_OFFSET + slot * IO_WAIT_BYTES

    def close(self) -> None:
        self._words = None
        if getattr(self, "buffer", None) is not None:
            self.buffer.close()
            self.buffer = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass
class Proxy:
    """A running RingProxy and what it holds registered with the device."""

    native: RingProxy
    device: Device
    staging: memoryview
    registered: Memory | None = None
    stats: dict = field(default_factory=dict)

    def grant(self, reads: np.ndarray, stamps: np.ndarray) -> None:
        """Arms one grant per read (rows of READ_FIELDS; the tag is the grant's number) under its stamp
        (nonzero, never used before): the proxy reads exactly these, once each, and nothing else."""
        reads = np.ascontiguousarray(reads, dtype=np.uint64)
        self.native.grant(np.ascontiguousarray(reads[:, 6]), np.ascontiguousarray(reads[:, :7]).reshape(-1),
                          np.ascontiguousarray(stamps, dtype=np.uint64))

    def settle(self, tags: np.ndarray, stamps: np.ndarray, *, revoke: bool) -> np.ndarray:
        """Each grant's state (GRANT_*): GRANT_OUT while armed or being read; with `revoke`, a grant
        no read has taken is disarmed (GRANT_REVOKED), so GRANT_OUT then means a read of it runs."""
        out = np.zeros(len(tags), dtype=np.int8)
        self.native.settle(np.ascontiguousarray(tags, dtype=np.uint64), np.ascontiguousarray(stamps, dtype=np.uint64),
                           out, revoke)
        return out

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
                batch_entries: int = 64, queue_depth: int = 64, grants: int = 4096,
                split: tuple[int, int] = (0, 0)) -> Proxy:
    """A proxy copying to `device`'s memory: memcpy on the CPU device, the CUDA driver on a GPU.
    It reads only what one of its `grants` names (Proxy.grant), and a read lands only inside
    `targets` (an engine's registered pool): the ring is shared with its producers, so nothing
    it says is trusted. `split`: (split_at, split_to) for pages kept as a K and a V half (see
    native/ring_proxy.h). On the CPU device, targets in an engine's own memory (opened by
    descriptor) are written through that process's memory file. On CUDA the staging is page-locked (cudaHostRegister) so the copies
    to the GPU are DMA."""
    staging_bytes = -(-staging_bytes // (2 * PROXY_ALIGN)) * 2 * PROXY_ALIGN
    # A CPU engine's own tensors are another process's memory here: written through its /proc/<pid>/mem.
    processes = ({device.process_fd(memory) for memory in targets} if device.kind == "cpu" else set()) or {-1}
    if len(processes) != 1:
        raise ValueError("a proxy's targets are memory of one process: this one's, or one engine's")
    staging = huge_page_memory(staging_bytes)
    registered = None
    if device.kind != "cpu":
        registered = device.register_host(np.frombuffer(staging, dtype=np.uint8).ctypes.data, staging_bytes)
    try:
        native = RingProxy(ring.buffer, np.asarray(fds, dtype=np.int32), staging, target_regions(targets),
                           batch_entries=batch_entries, queue_depth=queue_depth,
                           device=-1 if device.kind == "cpu" else device.index, grants=grants,
                           split_at=split[0], split_to=split[1], process_fd=processes.pop())
    except BaseException:
        if registered is not None:
            device.unregister_host(registered)
        raise
    return Proxy(native, device, staging, registered)
