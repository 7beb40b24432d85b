"""The cuFile engine: the disk interface (kvd.io.engine) between files and GPU memory, through NVIDIA
cuFile (GPUDirect Storage): entry addresses are device pointers, and a read's DMA goes from the drive
straight into them where the platform has nvidia-fs.

    engine = open_cufile_engine(queue_depth=64)        # OSError: no libcufile, or its driver refuses
    engine.register_files([fd])
    results = engine.wait(engine.submit(Op.READ, file_index, offset, length, device_addresses))

Differences from the other engines, all refused precisely rather than ignored:
- a batch runs when it is submitted (cuFileRead and cuFileWrite are synchronous), on the calling
  thread with the GIL released; wait() hands the results back;
- no checksums: the bytes land in device memory, where the CPU cannot read them; the disk tier's
  per-layer verification needs a GPU-side crc32c before it may use this engine (not built);
- no fault injection.

Never run against a GPU: none of kvd's machines has had one. Here libcufile loads (the
nvidia-cufile wheel, `make cufile`) and its driver refuses to open without a CUDA driver, which
tests/device/test_cufile.py checks.
"""

from __future__ import annotations

import os

import numpy as np

from kvd.errors import FailedPrecondition, InvalidArgument
from kvd.io.engine import STATS_KEYS, Batch, EngineBase, EngineOptions, FaultRule, Op, sync_file

# Where the library is looked for first: $KVD_CUFILE_LIBRARY (make cufile points it at the wheel's).
LIBRARY_ENV = "KVD_CUFILE_LIBRARY"


def library_path() -> str | None:
    return os.environ.get(LIBRARY_ENV) or None


def cufile_version(library: str | None = None) -> int:
    """libcufile's version (1150 is 1.15.0), without opening its driver; OSError when it is not there."""
    from kvd._native import cufile_version as native_version

    return native_version(library or library_path())


class CuFileEngine(EngineBase):
    kind = "cufile"

    def __init__(self, options: EngineOptions, library: str | None = None) -> None:
        super().__init__(options)
        from kvd._native import CuFile

        self._native = CuFile(library or library_path())  # OSError: no library, or no driver
        self._fds: tuple[int, ...] = ()
        self._next_id = 1
        self._counters = dict.fromkeys(STATS_KEYS, 0)

    def _register_files(self, fds: np.ndarray) -> None:
        self._native.register_files(fds)
        self._fds = tuple(int(fd) for fd in fds)

    def _register_buffers(self, addresses: np.ndarray, lengths: np.ndarray) -> None:
        raise InvalidArgument("the cuFile engine registers no host buffers (cuFileBufRegister is for device memory)")

    def _submit(self, batch: Batch, results: np.ndarray) -> int:
        if batch.checksums is not None:
            raise InvalidArgument("the cuFile engine reads into device memory, which the CPU cannot checksum")
        if batch.op not in (Op.READ, Op.WRITE):
            raise InvalidArgument(f"the cuFile engine reads and writes, not {batch.op.name}")
        failed = self._native.run(batch.op == Op.WRITE, batch.file_index, batch.offset, batch.length, batch.address,
                                  results)
        moved = int(np.clip(results, 0, None).sum())
        self._counters["bytes_read" if batch.op == Op.READ else "bytes_written"] += moved
        self._counters["errors"] += int((results < 0).sum())
        self._counters["short_transfers"] += failed - int((results < 0).sum())
        self._counters["batches"] += 1
        self._counters["entries"] += len(batch)
        batch_id = self._next_id
        self._next_id += 1
        return batch_id

    def _wait(self, batch_id: int) -> None:
        """Nothing left to wait for: the batch ran when it was submitted."""

    def _fsync(self, file_index: int, datasync: bool) -> int:
        self._counters["fsyncs"] += 1
        return sync_file(self._fds[file_index], datasync, self._counters)

    def _add_fault(self, rule: FaultRule) -> None:
        raise FailedPrecondition("the cuFile engine has no fault injection")

    def _clear_faults(self) -> None:
        """No rules to clear."""

    def _stats(self) -> dict[str, int]:
        return dict(self._counters)

    def _close(self) -> None:
        self._native.close()


def open_cufile_engine(queue_depth: int = 64, *, max_batches: int = 64, max_batch_entries: int = 1 << 20,
                       library: str | None = None) -> CuFileEngine:
    """A cuFile engine; OSError naming what is missing (the library, or its driver) where it cannot open."""
    return CuFileEngine(EngineOptions(queue_depth=queue_depth, max_batches=max_batches,
                                      max_batch_entries=max_batch_entries), library)
