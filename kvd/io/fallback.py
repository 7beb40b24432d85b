"""The pure-Python I/O engine: a bounded thread pool doing preadv/pwritev.

It runs where io_uring is unavailable (old kernels, seccomp profiles that
block it) and is the oracle the native engine is tested against, so it is
written to be obviously right rather than fast: one system call per entry,
results written into the batch's array by position, fault rules matched in
plain Python in the same order as the C code matches them.

A batch is cut into contiguous slices, one task per slice, at most
`threads` tasks running at once; that is this engine's queue depth. The
pool's queue holds at most max_batches x threads tasks. Each task returns
its own tally, summed into `stats` when the batch is waited, so the worker
threads share no counters.
"""

from __future__ import annotations

import ctypes
import os
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import crc32c
import numpy as np

from kvd.errors import ResourceExhausted
from kvd.invariants import check
from kvd.io.engine import MAX_FAULT_RULES, STATS_KEYS, Batch, EngineBase, EngineOptions, FaultRule, Op, sync_file

# More threads than this only add contention on a small machine; the
# native engine is the one meant for deep queues.
MAX_THREADS = 16


@dataclass(slots=True)
class _Tally:
    enter_calls: int = 0
    bytes_moved: int = 0
    errors: int = 0
    short_transfers: int = 0
    checksum_chunks: int = 0


@dataclass(slots=True)
class _Flight:
    op: Op
    futures: list[Future[_Tally]]


def _checksum_entry(batch: Batch, first: int, buffer: ctypes.Array, tally: _Tally) -> None:
    """The crc32c of each checksum_chunk bytes of a fully read entry, into cells from `first`."""
    assert batch.checksums is not None
    chunk = batch.checksum_chunk
    view = memoryview(buffer).cast("B")
    for j in range(len(view) // chunk):
        batch.checksums[first + j] = crc32c.crc32c(view[j * chunk:(j + 1) * chunk])
        tally.checksum_chunks += 1


def _run_slice(op: Op, fds: tuple[int, ...], batch: Batch, transfer_length: np.ndarray, fault_errno: np.ndarray,
               first_cells: np.ndarray | None, results: np.ndarray, start: int, stop: int) -> _Tally:
    """Entries [start, stop) of one batch, one system call each (a worker thread)."""
    tally = _Tally()
    for index in range(start, stop):
        requested = int(batch.length[index])
        if fault_errno[index]:
            results[index] = -int(fault_errno[index])
            tally.errors += 1
            continue
        nbytes = int(transfer_length[index])
        # A view of caller memory at a raw address; the kernel reads or
        # writes it, Python never dereferences it.
        buffer = (ctypes.c_char * nbytes).from_address(int(batch.address[index]))
        fd = fds[int(batch.file_index[index])]
        offset = int(batch.offset[index])
        tally.enter_calls += 1
        try:
            if op == Op.READ:
                done = os.preadv(fd, [buffer], offset)
            else:
                done = os.pwritev(fd, [buffer], offset)
        except OSError as error:
            results[index] = -error.errno
            tally.errors += 1
            continue
        results[index] = done
        tally.bytes_moved += done
        if done < requested:
            tally.short_transfers += 1
        elif first_cells is not None:
            _checksum_entry(batch, int(first_cells[index]), buffer, tally)
    return tally


class FallbackEngine(EngineBase):
    kind = "fallback"

    def __init__(self, options: EngineOptions, *, threads: int | None = None) -> None:
        super().__init__(options)
        self.threads = threads or min(options.queue_depth, MAX_THREADS)
        check(1 <= self.threads <= MAX_THREADS, f"fallback threads out of range: {self.threads}")
        self._pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="kvd-io")
        self._fds: tuple[int, ...] = ()
        self._regions: list[tuple[int, int]] = []
        self._rules: list[FaultRule] = []
        self._flights: dict[int, _Flight] = {}
        self._next_id = 1
        self._counters = dict.fromkeys(STATS_KEYS, 0)

    def _register_files(self, fds: np.ndarray) -> None:
        self._fds = tuple(int(fd) for fd in fds)

    def _register_buffers(self, addresses: np.ndarray, lengths: np.ndarray) -> None:
        # Nothing to gain without io_uring; kept so both engines accept the same calls.
        self._regions = list(zip(addresses.tolist(), lengths.tolist(), strict=True))

    def _match_fault(self, op: Op, file_index: int, offset: int) -> FaultRule | None:
        for rule in self._rules:
            if rule.matches(op, file_index, offset):
                rule.remaining -= 1
                self._counters["faults_injected"] += 1
                return rule
        return None

    def _submit(self, batch: Batch, results: np.ndarray) -> int:
        count = len(batch)
        transfer_length = batch.length.copy()
        fault_errno = np.zeros(count, dtype=np.int32)
        if self._rules:
            for index in range(count):
                rule = self._match_fault(batch.op, int(batch.file_index[index]), int(batch.offset[index]))
                if rule is None:
                    continue
                if rule.error:
                    fault_errno[index] = rule.error
                else:
                    transfer_length[index] = min(int(transfer_length[index]), rule.short_bytes)
        first_cells = None
        if batch.checksums is not None:  # entry i's first cell: the cells of the entries before it
            cells = (batch.length // batch.checksum_chunk).astype(np.int64)
            first_cells = np.cumsum(cells) - cells
        slice_entries = max(1, -(-count // self.threads))
        futures = [
            self._pool.submit(_run_slice, batch.op, self._fds, batch, transfer_length, fault_errno, first_cells,
                              results, start, min(start + slice_entries, count))
            for start in range(0, count, slice_entries)
        ]
        batch_id = self._next_id
        self._next_id += 1
        self._flights[batch_id] = _Flight(batch.op, futures)
        self._counters["batches"] += 1
        self._counters["entries"] += count
        return batch_id

    def _wait(self, batch_id: int) -> None:
        flight = self._flights.pop(batch_id)
        for future in flight.futures:
            self._count(flight.op, future.result())

    def _count(self, op: Op, tally: _Tally) -> None:
        self._counters["enter_calls"] += tally.enter_calls
        self._counters["submit_calls"] += tally.enter_calls
        self._counters["bytes_read" if op == Op.READ else "bytes_written"] += tally.bytes_moved
        self._counters["errors"] += tally.errors
        self._counters["short_transfers"] += tally.short_transfers
        self._counters["checksum_chunks"] += tally.checksum_chunks

    def _fsync(self, file_index: int, datasync: bool) -> int:
        # Like the drained io_uring fsync: after every write already submitted.
        for flight in self._flights.values():
            wait_futures(flight.futures)
        self._counters["fsyncs"] += 1
        rule = self._match_fault(Op.FSYNC, file_index, 0)
        if rule is not None:
            self._counters["errors"] += 1
            return -rule.error
        self._counters["enter_calls"] += 1
        self._counters["submit_calls"] += 1
        return sync_file(self._fds[file_index], datasync, self._counters)

    def _add_fault(self, rule: FaultRule) -> None:
        self._rules = [live for live in self._rules if live.remaining > 0]
        if len(self._rules) == MAX_FAULT_RULES:
            raise ResourceExhausted(f"at most {MAX_FAULT_RULES} live fault rules")
        self._rules.append(rule)

    def _clear_faults(self) -> None:
        self._rules = []

    def _stats(self) -> dict[str, int]:
        return dict(self._counters)

    def _close(self) -> None:
        # Tasks not started never touch caller memory; running ones finish.
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._flights.clear()
