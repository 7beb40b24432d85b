"""Type stub of kvd._native, built from native/module.c and native/proxy_module.c.

Callers use kvd.io.open_engine; only kvd.io.uring imports this module.
Arrays are anything with the buffer protocol, 1-D and C-contiguous, with
the item sizes given (numpy arrays of the named dtypes).
"""

from typing_extensions import Buffer

OP_READ: int
OP_WRITE: int
OP_FSYNC: int
MAX_QUEUE_DEPTH: int
MAX_BATCHES: int
MAX_BATCH_ENTRIES: int
MAX_FAULTS: int
MAX_FILES: int
MAX_BUFFERS: int

class Ring:
    """One io_uring with its batches in flight. Raises OSError on ring failures."""

    def __init__(self, queue_depth: int, max_batches: int) -> None: ...
    @property
    def closed(self) -> bool: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def batches_in_flight(self) -> int: ...
    def register_files(self, fds: Buffer, /) -> None:
        """int32 file descriptors; replaces the table; empty clears it."""
    def register_buffers(self, addresses: Buffer, lengths: Buffer, /) -> None:
        """uint64 addresses and lengths of disjoint regions; replaces the table."""
    def submit(
        self,
        op: int,
        file_index: Buffer,
        offset: Buffer,
        length: Buffer,
        address: Buffer,
        results: Buffer,
        /,
    ) -> int:
        """int32, int64, uint32, uint64 arrays of one length; results: writable int64,
        filled by the time wait() returns. Returns the batch id."""
    def wait(self, batch_id: int, /) -> None:
        """Blocks with the GIL released; KeyError for a batch not in flight."""
    def fsync(self, file_index: int, datasync: bool, /) -> int:
        """0 or -errno, after every entry submitted before it."""
    def add_fault(
        self,
        op: int,
        file_index: int,
        offset_begin: int,
        offset_end: int,
        error: int,
        short_bytes: int,
        count: int,
        /,
    ) -> None: ...
    def clear_faults(self) -> None: ...
    def stats(self) -> dict[str, int]: ...
    def close(self) -> None:
        """Drains the I/O the kernel holds, cancels the rest; idempotent."""

def copy_chunks(dst_addresses: Buffer, src_addresses: Buffer, nbytes: int, /) -> None:
    """memmove of nbytes from each uint64 source address to the destination beside it (GIL released)."""

def copy_file_chunks(fd: int, file_offsets: Buffer, addresses: Buffer, nbytes: int, write: bool, /) -> None:
    """pwrite (write) or pread of nbytes between each uint64 address and the file offset beside it, short
    transfers retried, the GIL released; OSError with the first failure's errno (EIO when none moved)."""

IO_RING_VERSION: int
IO_RING_MAX_LAYERS: int
IO_RING_WAITS: int
IO_RING_HEADER_BYTES: int
IO_RING_DONE_OFFSET: int
IO_RING_FAILED_OFFSET: int
IO_RING_ABANDONED_OFFSET: int
IO_RING_WAITS_OFFSET: int
IO_WAIT_BYTES: int
IO_WAIT_PENDING: int
IO_WAIT_OK: int
IO_WAIT_FAILED: int
IO_WAIT_TIMEOUT: int
IO_WAIT_INVALID: int
PROXY_ALIGN: int

def io_ring_init(buffer: Buffer, capacity: int, layers: int, /) -> int:
    """Zeroes and lays out an I/O ring (native/gpu/io_ring.h) in a 64-byte aligned writable buffer;
    returns the bytes it takes. ValueError when capacity is not a power of two or it does not fit."""

def io_ring_wait(buffer: Buffer, layer: int, until: int, failed_before: int, timeout_ns: int, slot: int, /) -> int:
    """The wait kernel's wait (kvd_io_ring_wait) on this thread, GIL released: until `until` reads of
    `layer` are done (OK), one fails past `failed_before` (FAILED), or `timeout_ns` passes (TIMEOUT);
    INVALID for a layer the ring has no counter for. Writes the ring's waits[slot]; returns its state.
    ValueError when the buffer holds no ring or slot >= IO_RING_WAITS."""

def io_ring_wait_record(buffer: Buffer, slot: int, /) -> tuple[int, int, int, int, int, int]:
    """(state, layer, until, done, failed, waited_ns) of the ring's waits[slot], state loaded first (acquire)."""

class RingProxy:
    """A thread draining an I/O ring's reads into io_uring (native/ring_proxy.h)."""

    def __init__(self, ring: Buffer, fds: Buffer, staging: Buffer, targets: Buffer, batch_entries: int = 64,
                 queue_depth: int = 64, device: int = -1) -> None:
        """ring: laid out by io_ring_init; fds: int32, registered as files 0..n-1; staging: writable,
        4096-aligned, a multiple of 8192 bytes; targets: uint64 (address, length) pairs, sorted and
        disjoint, the only places reads may land; device >= 0: targets are on that CUDA device
        (OSError without a driver)."""
    @property
    def running(self) -> bool: ...
    def stop(self) -> None:
        """Takes no new descriptors, finishes those it holds, joins the thread; idempotent."""
    def stats(self) -> dict[str, int]: ...

def plan_step_latency(compute_s: Buffer, kv_bytes: Buffer, bandwidth_bps: float, distances: Buffer, /) -> float:
    """kvd.planner.latency.step_latency in native/planner.c: float64 compute seconds per layer, float64
    KV bytes per request, int32 distances (-1 or 1..layers-1). ValueError on bad sizes or distances."""

def plan_search(compute_s: Buffer, kv_bytes: Buffer, bandwidth_bps: float, options: Buffer, budget_bytes: float,
                max_nodes: int, /) -> tuple[tuple[int, ...], float, float, float, int, bool] | None:
    """Branch and bound over one option (int32, -1 first) per request: (distances, latency_s, bound_s,
    gpu_bytes, explored, exact), or None when no placement fits budget_bytes. max_nodes 0: no limit."""

CUDA_BATCH_API_V2: int
CUDA_BATCH_API_V1: int
CUDA_BATCH_API_LOOP: int

def cuda_copy_batch(stream: int, dst_addresses: Buffer, src_addresses: Buffer, nbytes: int, /) -> tuple[int, int]:
    """Issue nbytes from each source address to the destination beside it on CUDA stream `stream`
    (native/cuda_batch.c: cuMemcpyBatchAsync_v2, 12.8's cuMemcpyBatchAsync, or a C loop of
    cuMemcpyAsync, by driver), GIL released; returns (CUresult, the entry point used).
    OSError where libcuda.so.1 does not load."""

def cuda_driver_version() -> int:
    """The CUDA driver's version (12080 for 12.8); -1 where libcuda.so.1 does not load."""
