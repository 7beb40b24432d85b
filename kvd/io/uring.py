"""The io_uring engine: kvd._native (native/uring_batch.c) behind the IoEngine interface.

This module only adapts: the base class has already checked and converted
every argument, the C code owns the ring, the batches in flight and the
fault rules. Files are always registered with the ring (fixed files);
buffers optionally (see `register_buffers`).
"""

from __future__ import annotations

import errno as errno_codes

import numpy as np

from kvd.errors import ResourceExhausted, Unavailable
from kvd.invariants import check
from kvd.io.engine import (
    MAX_BATCH_ENTRIES,
    MAX_BATCHES,
    MAX_BUFFERS,
    MAX_FAULT_RULES,
    MAX_FILES,
    MAX_QUEUE_DEPTH,
    Batch,
    EngineBase,
    EngineOptions,
    FaultRule,
    Op,
)


def _load_native():
    try:
        from kvd import _native
    except ImportError as error:
        raise Unavailable(f"kvd._native is not built or cannot load: {error}") from None
    # The Python limits and op codes are written down twice; catch drift here.
    check(
        (_native.OP_READ, _native.OP_WRITE, _native.OP_FSYNC) == (Op.READ, Op.WRITE, Op.FSYNC)
        and (_native.MAX_QUEUE_DEPTH, _native.MAX_BATCHES, _native.MAX_BATCH_ENTRIES, _native.MAX_FAULTS,
             _native.MAX_FILES, _native.MAX_BUFFERS)
        == (MAX_QUEUE_DEPTH, MAX_BATCHES, MAX_BATCH_ENTRIES, MAX_FAULT_RULES, MAX_FILES, MAX_BUFFERS),
        "kvd._native and kvd.io.engine disagree on op codes or limits",
    )
    return _native


class UringEngine(EngineBase):
    kind = "uring"

    def __init__(self, options: EngineOptions) -> None:
        super().__init__(options)
        native = _load_native()
        try:
            self._ring = native.Ring(options.queue_depth, options.max_batches, options.single_issuer)
        except OSError as error:
            # ENOSYS (old kernel), EPERM (seccomp, io_uring_disabled), ENOMEM (memlock).
            raise Unavailable(f"cannot create an io_uring: {error}") from None

    def _register_files(self, fds: np.ndarray) -> None:
        self._ring.register_files(fds)

    def _register_buffers(self, addresses: np.ndarray, lengths: np.ndarray) -> None:
        self._ring.register_buffers(addresses, lengths)

    def _submit(self, batch: Batch, results: np.ndarray) -> int:
        if batch.checksums is None:
            return self._ring.submit(int(batch.op), batch.file_index, batch.offset, batch.length, batch.address,
                                     results)
        return self._ring.submit(int(batch.op), batch.file_index, batch.offset, batch.length, batch.address,
                                 results, batch.checksums, batch.checksum_chunk)

    def _wait(self, batch_id: int) -> None:
        self._ring.wait(batch_id)

    def _fsync(self, file_index: int, datasync: bool) -> int:
        return self._ring.fsync(file_index, datasync)

    def _add_fault(self, rule: FaultRule) -> None:
        try:
            self._ring.add_fault(int(rule.op), rule.file_index, rule.offset_begin, rule.offset_end, rule.error,
                                 rule.short_bytes, rule.remaining)
        except OSError as error:
            if error.errno == errno_codes.ENOSPC:
                raise ResourceExhausted(f"at most {MAX_FAULT_RULES} live fault rules") from None
            raise

    def _clear_faults(self) -> None:
        self._ring.clear_faults()

    def fail_enters(self, errno: int, count: int) -> None:
        """Tests: the next `count` io_uring_enter calls of wait and fsync fail
        with errno (the batch still completes: entries not yet given to the
        kernel carry -errno, the others their real results)."""
        self._check_open()
        self._ring.fail_enters(errno, count)

    def _stats(self) -> dict[str, int]:
        return self._ring.stats()

    def _close(self) -> None:
        self._ring.close()
