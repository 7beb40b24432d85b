"""The batched file I/O engine: its interface, shared checks, and `open_engine`.

An engine moves whole batches of (file, offset, length, address) entries
between files and memory. The disk tier hands one batch over per layer or
per request, never one call per block:

    engine = open_engine("auto", queue_depth=64)
    engine.register_files([fd0, fd1])             # file index i is fds[i]
    first = engine.submit(Op.READ, file_index, offset, length, address)
    second = engine.submit(Op.READ, ...)          # several batches may be in flight
    results = engine.wait(first)                  # int64 per entry
    ...
    engine.close()                                # or use it as a context manager

Two implementations share this interface (`IoEngine`):

* `uring` (kvd.io.uring): io_uring through the C extension kvd._native.
  A batch is handed to the kernel in one io_uring_enter; completions are
  reaped with the GIL released.
* `fallback` (kvd.io.fallback): a bounded thread pool doing preadv/pwritev.
  It runs where io_uring is unavailable and is the oracle the native engine
  is tested against.

Contract of a batch:

* results[i] is the byte count the kernel reported for entry i, or -errno.
  One entry failing does not affect the others: an O_DIRECT entry that is
  misaligned gets -EINVAL, an entry past the end of a file a short count.
* Short transfers are reported, never retried: 0 <= results[i] < length[i]
  means the kernel moved fewer bytes (a read at end of file, a write that
  ran out of space). The caller decides whether to retry the rest, treat
  it as an error, or accept it.
* Entries in flight at the same time (in one batch or several) run in no
  particular order. Entries that overlap must not be in flight together
  if any of them writes.
* Addresses are raw memory addresses (`address_of`). The caller keeps the
  memory mapped and unmoved until the batch is waited or the engine closed.
  With O_DIRECT, offset, length and address must be multiples of the
  device's logical block size; 4 KiB (`DIRECT_IO_ALIGN_BYTES`) always is.
* A batch larger than the queue depth is split inside the engine; at most
  `queue_depth` entries are with the kernel at once.
* `fsync` covers every write submitted before it, waited or not.
* A read batch may ask for checksums (`checksums=`, `checksum_chunk=`):
  the crc32c of every `checksum_chunk` bytes of each entry read in full,
  written into the caller's uint32 array by the time `wait` returns (entry
  i's cells follow entry i-1's). The native engine computes them with the
  GIL released while the drive works on the rest of the queue, so a
  caller verifying what it read does no per-entry work in Python. Cells
  of entries not read in full are left as they were.

An engine is used by one thread at a time (the daemon's I/O thread, say);
the native binding raises RuntimeError when two threads call in at once.
Waiting releases the GIL, so other threads run meanwhile.

Caller mistakes (bad arrays, unknown batch ids, use after close) raise
`kvd.errors` exceptions before anything is submitted. Fault injection
(`inject_fault`) lets tests turn chosen entries into errors or short
transfers through the engine's normal completion path.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from kvd.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, Unavailable
from kvd.invariants import check

log = logging.getLogger(__name__)

DIRECT_IO_ALIGN_BYTES = 4096
# One entry moves at most this much: Linux caps one read/write near 2 GiB,
# and a registered io_uring buffer at 1 GiB.
MAX_ENTRY_BYTES = 1 << 30
# Limits shared by both engines (kvd._native enforces the same ones).
MAX_QUEUE_DEPTH = 4096
MAX_BATCHES = 4096
MAX_BATCH_ENTRIES = 1 << 24
MAX_FAULT_RULES = 16
MAX_FILES = 65536
MAX_BUFFERS = 1024
_OFFSET_MAX = (1 << 63) - 1

# Every engine's `stats` has exactly these counters.
STATS_KEYS = (
    "entries",               # read/write entries submitted
    "batches",               # read/write batches submitted
    "fsyncs",
    "enter_calls",           # system calls that moved data or waited for it
    "submit_calls",          # ... of which handed new entries to the kernel
    "bytes_read",
    "bytes_written",
    "errors",                # entries completed with -errno
    "short_transfers",       # entries completed with 0 <= result < length
    "faults_injected",       # entries (and fsyncs) that a fault rule hit
    "fixed_buffer_entries",  # entries that used a registered buffer (uring only)
    "checksum_chunks",       # crc32c values computed for reads that asked
    "enter_errors",          # io_uring_enter calls that failed and were retried (uring only)
)


class Op(enum.IntEnum):
    """The operation of a batch; values match kvd._native.OP_*."""

    READ = 0
    WRITE = 1
    FSYNC = 2  # only for inject_fault: fsync itself is `IoEngine.fsync`


@dataclass(frozen=True, slots=True)
class EngineOptions:
    queue_depth: int = 64          # entries with the kernel at once
    max_batches: int = 64          # batches submitted and not yet waited
    max_batch_entries: int = 1 << 20
    # io_uring only: IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN. Only the
    # thread that opened the engine may use it from then on.
    single_issuer: bool = False

    def validate(self) -> None:
        for name, value, limit in (
            ("queue_depth", self.queue_depth, MAX_QUEUE_DEPTH),
            ("max_batches", self.max_batches, MAX_BATCHES),
            ("max_batch_entries", self.max_batch_entries, MAX_BATCH_ENTRIES),
        ):
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
                raise InvalidArgument(f"{name} must be an integer in [1, {limit}], got {value!r}")


@dataclass(frozen=True, slots=True)
class Batch:
    """One batch's entries, checked and converted to the dtypes the engines use."""

    op: Op
    file_index: np.ndarray  # int32
    offset: np.ndarray      # int64
    length: np.ndarray      # uint32
    address: np.ndarray     # uint64
    checksums: np.ndarray | None = None  # uint32 cells, or None
    checksum_chunk: int = 0

    def __len__(self) -> int:
        return len(self.file_index)


@dataclass(slots=True)
class FaultRule:
    """Matching entries complete with -error, or move at most short_bytes.

    An entry matches when its op is `op`, its file is `file_index` (-1: any)
    and offset_begin <= offset < offset_end. Rules are tried in the order
    they were added, at submit time, entry by entry; the first live match
    applies and uses up one of its `remaining` hits.
    """

    op: Op
    file_index: int
    offset_begin: int
    offset_end: int
    error: int        # errno, or 0 for a short transfer
    short_bytes: int  # -1 unless a short transfer
    remaining: int

    def matches(self, op: Op, file_index: int, offset: int) -> bool:
        return (
            self.remaining > 0
            and self.op == op
            and (self.file_index < 0 or self.file_index == file_index)
            and self.offset_begin <= offset < self.offset_end
        )


class IoEngine(Protocol):
    """What the disk tier programs against; see the module docstring."""

    kind: str

    @property
    def queue_depth(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def batches_in_flight(self) -> int: ...

    @property
    def stats(self) -> dict[str, int]: ...

    def register_files(self, fds: Sequence[int]) -> None: ...

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> None: ...

    def submit(self, op: Op, file_index: Any, offset: Any, length: Any, address: Any, *,
               checksums: np.ndarray | None = None, checksum_chunk: int = 0) -> int: ...

    def wait(self, batch_id: int) -> np.ndarray: ...

    def fsync(self, file_index: int, *, datasync: bool = True) -> None: ...

    def inject_fault(
        self,
        op: Op,
        *,
        file_index: int | None = None,
        offset_range: tuple[int, int] | None = None,
        errno: int | None = None,
        short_bytes: int | None = None,
        count: int = 1,
    ) -> None: ...

    def clear_faults(self) -> None: ...

    def close(self) -> None: ...

    def __enter__(self) -> IoEngine: ...

    def __exit__(self, *exc_info: object) -> None: ...


# ---------------------------------------------------------------------------
# Memory helpers


def address_of(buffer: Any) -> int:
    """Address of the first byte of a C-contiguous buffer (numpy array, mmap, bytearray).

    The caller keeps `buffer` alive, and does not resize or close it,
    for as long as any batch may use the address.
    """
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise InvalidArgument("address_of needs a C-contiguous array")
        return int(buffer.__array_interface__["data"][0])
    try:
        view = np.frombuffer(buffer, dtype=np.uint8)
    except (TypeError, ValueError, BufferError) as error:
        raise InvalidArgument(f"address_of needs a contiguous buffer: {error}") from None
    # The temporary array's export of `buffer` ends with this function.
    return int(view.__array_interface__["data"][0])


def aligned_empty(nbytes: int, alignment: int = DIRECT_IO_ALIGN_BYTES) -> np.ndarray:
    """An uninitialised uint8 array whose first byte is `alignment`-aligned (for O_DIRECT)."""
    if nbytes < 0 or alignment <= 0 or alignment & (alignment - 1):
        raise InvalidArgument("aligned_empty needs nbytes >= 0 and a power-of-two alignment")
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -address_of(raw) % alignment
    array = raw[start : start + nbytes]
    check(address_of(array) % alignment == 0, "aligned_empty returned a misaligned array")
    return array


# ---------------------------------------------------------------------------
# Checks shared by the engines


def _integer_array(values: Any, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.ndim != 1:
        raise InvalidArgument(f"{name} must be one-dimensional, got shape {array.shape}")
    if array.size and array.dtype.kind not in "iu":
        raise InvalidArgument(f"{name} must hold integers, got dtype {array.dtype}")
    return array


def _in_range(array: np.ndarray, low: int, high: int) -> bool:
    return array.size == 0 or (int(array.min()) >= low and int(array.max()) <= high)


def _checksum_cells(op: Op, length: np.ndarray, checksums: Any, chunk: Any) -> np.ndarray | None:
    if checksums is None:
        if chunk:
            raise InvalidArgument("checksum_chunk given without a checksums array")
        return None
    if op != Op.READ:
        raise InvalidArgument("only read batches compute checksums")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 0 < chunk <= MAX_ENTRY_BYTES:
        raise InvalidArgument(f"checksum_chunk must be an integer in [1, {MAX_ENTRY_BYTES}], got {chunk!r}")
    if not (isinstance(checksums, np.ndarray) and checksums.dtype == np.uint32 and checksums.ndim == 1
            and checksums.flags.c_contiguous and checksums.flags.writeable):
        raise InvalidArgument("checksums must be a writable, contiguous 1-D numpy uint32 array")
    if length.size and bool(np.any(length % chunk)):
        raise InvalidArgument(f"every length must be a multiple of checksum_chunk={chunk}")
    needed = int((length // chunk).sum())
    if checksums.size < needed:
        raise InvalidArgument(f"checksums holds {checksums.size} cells, the batch needs {needed}")
    return checksums


def make_batch(op: Op, file_index: Any, offset: Any, length: Any, address: Any, *,
               file_count: int, max_entries: int, checksums: Any = None, checksum_chunk: Any = 0) -> Batch:
    """Check one batch's arrays and convert them; raises InvalidArgument."""
    if op not in (Op.READ, Op.WRITE):
        raise InvalidArgument(f"a batch reads or writes, got {op!r}")
    arrays = {
        name: _integer_array(values, name)
        for name, values in (("file_index", file_index), ("offset", offset), ("length", length), ("address", address))
    }
    count = len(arrays["file_index"])
    if any(len(array) != count for array in arrays.values()):
        raise InvalidArgument(f"batch arrays differ in length: { {k: len(v) for k, v in arrays.items()} }")
    if count > max_entries:
        raise InvalidArgument(f"batch of {count} entries exceeds max_batch_entries={max_entries}")
    if count and file_count == 0:
        raise FailedPrecondition("register_files before submitting")
    if not _in_range(arrays["file_index"], 0, file_count - 1):
        raise InvalidArgument(f"file_index outside the {file_count} registered files")
    if not _in_range(arrays["offset"], 0, _OFFSET_MAX - MAX_ENTRY_BYTES):
        raise InvalidArgument("offset must be non-negative")
    if not _in_range(arrays["length"], 0, MAX_ENTRY_BYTES):
        raise InvalidArgument(f"length must be in [0, {MAX_ENTRY_BYTES}]")
    if not _in_range(arrays["address"], 0, (1 << 64) - 1):
        raise InvalidArgument("address must be non-negative")
    length = arrays["length"].astype(np.uint32)
    address = arrays["address"].astype(np.uint64)
    if count and bool(np.any((address == 0) & (length > 0))):
        raise InvalidArgument("address 0 with a non-zero length")
    cells = _checksum_cells(Op(op), length, checksums, checksum_chunk)
    return Batch(
        op=Op(op),
        file_index=np.ascontiguousarray(arrays["file_index"], dtype=np.int32),
        offset=np.ascontiguousarray(arrays["offset"], dtype=np.int64),
        length=np.ascontiguousarray(length),
        address=np.ascontiguousarray(address),
        checksums=cells,
        checksum_chunk=int(checksum_chunk) if cells is not None else 0,
    )


def make_fault_rule(op: Op, *, file_index: int | None, offset_range: tuple[int, int] | None,
                    errno: int | None, short_bytes: int | None, count: int) -> FaultRule:
    """Check the arguments of inject_fault; raises InvalidArgument."""
    if op not in (Op.READ, Op.WRITE, Op.FSYNC):
        raise InvalidArgument(f"unknown op {op!r}")
    if (errno is None) == (short_bytes is None):
        raise InvalidArgument("inject_fault takes exactly one of errno and short_bytes")
    if errno is not None and not (isinstance(errno, int) and 0 < errno < 4096):
        raise InvalidArgument(f"errno must be a positive errno value, got {errno!r}")
    if short_bytes is not None:
        if op == Op.FSYNC:
            raise InvalidArgument("an fsync cannot be short")
        if not (isinstance(short_bytes, int) and 0 <= short_bytes <= MAX_ENTRY_BYTES):
            raise InvalidArgument(f"short_bytes must be in [0, {MAX_ENTRY_BYTES}], got {short_bytes!r}")
    if file_index is not None and not (isinstance(file_index, int) and 0 <= file_index < MAX_FILES):
        raise InvalidArgument(f"file_index must be None or a file index, got {file_index!r}")
    begin, end = (0, _OFFSET_MAX) if offset_range is None else offset_range
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end <= _OFFSET_MAX):
        raise InvalidArgument(f"offset_range must be (begin, end) with 0 <= begin <= end, got {offset_range!r}")
    if not (isinstance(count, int) and 1 <= count < 1 << 32):
        raise InvalidArgument(f"count must be a positive integer, got {count!r}")
    return FaultRule(
        op=Op(op),
        file_index=-1 if file_index is None else file_index,
        offset_begin=begin,
        offset_end=end,
        error=errno or 0,
        short_bytes=-1 if short_bytes is None else short_bytes,
        remaining=count,
    )


def sync_file(fd: int, datasync: bool, counters: dict[str, int]) -> int:
    """fdatasync (or fsync) of `fd` for the engines that have no kernel queue to do it: 0 or -errno,
    a failure counted in counters["errors"]."""
    try:
        (os.fdatasync if datasync else os.fsync)(fd)
    except OSError as error:
        counters["errors"] += 1
        return -error.errno
    return 0


class EngineBase:
    """What both engines share: argument checks, batch ids, the closed state.

    Subclasses implement the underscored hooks; every hook is called with
    arguments already checked, on an open engine.
    """

    kind: str = "?"

    def __init__(self, options: EngineOptions) -> None:
        options.validate()
        self.options = options
        self._closed = False
        self._file_count = 0
        # Batches submitted and not yet waited -> their results arrays.
        self._results: dict[int, np.ndarray] = {}

    # -- hooks ---------------------------------------------------------------

    def _register_files(self, fds: np.ndarray) -> None:
        raise NotImplementedError

    def _register_buffers(self, addresses: np.ndarray, lengths: np.ndarray) -> None:
        raise NotImplementedError

    def _submit(self, batch: Batch, results: np.ndarray) -> int:
        raise NotImplementedError

    def _wait(self, batch_id: int) -> None:
        raise NotImplementedError

    def _fsync(self, file_index: int, datasync: bool) -> int:
        raise NotImplementedError

    def _add_fault(self, rule: FaultRule) -> None:
        raise NotImplementedError

    def _clear_faults(self) -> None:
        raise NotImplementedError

    def _stats(self) -> dict[str, int]:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError

    # -- the interface ---------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return self.options.queue_depth

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def batches_in_flight(self) -> int:
        return len(self._results)

    @property
    def stats(self) -> dict[str, int]:
        """Counters since the engine opened (also readable after close)."""
        stats = self._stats()
        check(tuple(stats) == STATS_KEYS, f"{self.kind} engine stats keys drifted: {tuple(stats)}")
        return stats

    def _check_open(self) -> None:
        if self._closed:
            raise FailedPrecondition(f"the {self.kind} I/O engine is closed")

    def _check_idle(self, what: str) -> None:
        if self._results:
            raise FailedPrecondition(f"{what} with {len(self._results)} batches in flight")

    def register_files(self, fds: Sequence[int]) -> None:
        """Replace the file table: file index i is fds[i]. An empty list clears it."""
        self._check_open()
        array = _integer_array(list(fds), "fds")
        if len(array) > MAX_FILES or not _in_range(array, 0, (1 << 31) - 1):
            raise InvalidArgument(f"fds must be at most {MAX_FILES} open file descriptors")
        self._check_idle("register_files")
        self._file_count = 0
        self._register_files(np.ascontiguousarray(array, dtype=np.int32))
        self._file_count = len(array)

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> None:
        """Replace the registered memory regions, (address, nbytes) each; [] clears them.

        Purely a speed-up: entries whose bytes lie inside one region let the
        kernel skip pinning pages per I/O; other addresses keep working.
        Registered memory is pinned. An OSError means the kernel refused
        (e.g. RLIMIT_MEMLOCK); the engine then has no registered buffers.
        """
        self._check_open()
        pairs = [(int(address), int(nbytes)) for address, nbytes in regions]
        if len(pairs) > MAX_BUFFERS:
            raise InvalidArgument(f"at most {MAX_BUFFERS} registered buffers")
        ordered = sorted(pairs)
        for index, (address, nbytes) in enumerate(ordered):
            if address <= 0 or not 0 < nbytes <= MAX_ENTRY_BYTES:
                raise InvalidArgument(f"buffer ({address:#x}, {nbytes}) must be non-empty and at most 1 GiB")
            if index and ordered[index - 1][0] + ordered[index - 1][1] > address:
                raise InvalidArgument("registered buffers overlap")
        self._check_idle("register_buffers")
        addresses = np.array([address for address, _ in ordered], dtype=np.uint64)
        lengths = np.array([nbytes for _, nbytes in ordered], dtype=np.uint64)
        self._register_buffers(addresses, lengths)

    def submit(self, op: Op, file_index: Any, offset: Any, length: Any, address: Any, *,
               checksums: np.ndarray | None = None, checksum_chunk: int = 0) -> int:
        """Hand a whole batch over; returns its id for `wait`. Arrays may be reused at once,
        except `checksums`, which is written until the batch is waited."""
        self._check_open()
        batch = make_batch(op, file_index, offset, length, address,
                           file_count=self._file_count, max_entries=self.options.max_batch_entries,
                           checksums=checksums, checksum_chunk=checksum_chunk)
        if len(self._results) >= self.options.max_batches:
            raise ResourceExhausted(f"{len(self._results)} batches in flight: wait for one first "
                                    f"(max_batches={self.options.max_batches})")
        results = np.empty(len(batch), dtype=np.int64)
        batch_id = self._submit(batch, results)
        check(batch_id not in self._results, f"{self.kind} engine reused batch id {batch_id}")
        self._results[batch_id] = results
        return batch_id

    def wait(self, batch_id: int) -> np.ndarray:
        """Block (GIL released) until the batch is done; int64 results, see the module docstring."""
        self._check_open()
        results = self._results.get(batch_id)
        if results is None:
            raise NotFound(f"no batch {batch_id!r} in flight on this engine")
        self._wait(batch_id)
        del self._results[batch_id]
        return results

    def fsync(self, file_index: int, *, datasync: bool = True) -> None:
        """Flush a registered file (fdatasync by default); raises OSError when it fails.

        Covers every write submitted before the call, waited or not.
        """
        self._check_open()
        if not (isinstance(file_index, int) and 0 <= file_index < self._file_count):
            raise InvalidArgument(f"file_index {file_index!r} outside the {self._file_count} registered files")
        result = self._fsync(file_index, bool(datasync))
        if result < 0:
            raise OSError(-result, f"fsync of file index {file_index}: {os.strerror(-result)}")

    def inject_fault(self, op: Op, *, file_index: int | None = None, offset_range: tuple[int, int] | None = None,
                     errno: int | None = None, short_bytes: int | None = None, count: int = 1) -> None:
        """Make the next `count` matching entries fail with -errno, or move at most short_bytes.

        Matching happens when a batch is submitted (see FaultRule). An
        errno fault completes the entry without I/O; a short fault really
        transfers the first short_bytes bytes (with O_DIRECT keep it
        aligned, or the kernel answers -EINVAL). Rules stack; at most
        MAX_FAULT_RULES live at once.
        """
        self._check_open()
        rule = make_fault_rule(op, file_index=file_index, offset_range=offset_range, errno=errno,
                               short_bytes=short_bytes, count=count)
        self._add_fault(rule)

    def clear_faults(self) -> None:
        self._check_open()
        self._clear_faults()

    def close(self) -> None:
        """Drain and release; idempotent. Unwaited batches' results are dropped.

        Entries the kernel already holds are waited for (they may still
        write caller memory); the rest complete as -ECANCELED unseen.
        """
        if self._closed:
            return
        self._closed = True
        self._results.clear()
        self._close()

    def __enter__(self) -> EngineBase:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._results)} batches in flight"
        return f"<{type(self).__name__} queue_depth={self.queue_depth} {state}>"


def uring_unavailable_reason() -> str | None:
    """Why `open_engine("uring")` would fail here, or None when it works."""
    try:
        engine = open_engine("uring", queue_depth=1, max_batches=1)
    except Unavailable as error:
        return error.message
    engine.close()
    return None


def open_engine(kind: Literal["auto", "uring", "fallback"] = "auto", queue_depth: int = 64, *,
                max_batches: int = 64, max_batch_entries: int = 1 << 20, single_issuer: bool = False) -> EngineBase:
    """Open an I/O engine. "auto" is io_uring when it works here, else the fallback (logged)."""
    options = EngineOptions(queue_depth=queue_depth, max_batches=max_batches, max_batch_entries=max_batch_entries,
                            single_issuer=single_issuer)
    options.validate()
    # Imported here: both modules import this one.
    from kvd.io.fallback import FallbackEngine
    from kvd.io.uring import UringEngine

    if kind == "uring":
        return UringEngine(options)
    if kind == "fallback":
        return FallbackEngine(options)
    if kind != "auto":
        raise InvalidArgument(f"engine kind must be auto, uring or fallback, got {kind!r}")
    try:
        return UringEngine(options)
    except Unavailable as error:
        log.warning("io_uring engine unavailable (%s); using the thread-pool fallback", error.message)
        return FallbackEngine(options)
