"""LMCache's local disk tier as a bench_peers contender (runs in .venv-lmcache).

What it drives: LMCache's own StorageManager, built from an LMCacheEngineConfig
with ``local_cpu: false`` (no hot CPU cache: the LocalCPUBackend is only the
allocator of the staging pool that memory objects come from) and
``local_disk: <workload.dir>``, so the manager creates the real
LocalDiskBackend, which writes one file per KV chunk. The disk knobs are
LMCache's: ``extra_config.use_odirect`` (O_DIRECT reads and writes, taken by
LMCache only where a chunk's size is a multiple of the file system's block
size) and ``extra_config.disk_io_threads`` (its write pool and its read pool;
4, LMCache's default and what the benchmark this reproduces used; override
with LMCACHE_BENCH_DISK_THREADS). With no GPU LMCache picks its CPU device
stub by itself, so the only GPU step missing is the connector's gather
from the paged GPU cache, which here is the copy between the caller's buffer
and the memory objects, and that copy is timed on both sides.

One block is one LMCache chunk: a KV_2LTD memory object of shape
[2, layers, tokens, 1024] bfloat16 (tokens = layer_bytes / 4096, so
256 tokens for 1 MiB layers; layer_bytes not a multiple of 4096 gives one
token of layer_bytes / 4 elements). Layer j of a block in the caller's buffer
holds that layer's K half then its V half, and lands in [0, j] and [1, j] of
the chunk, the way LMCache's connector gathers per-layer caches.

store: allocate the chunks from LMCache's pool, copy the blocks in,
StorageManager.batched_put, then wait until the LocalDiskBackend indexes
every key, which it does only after the file's write() returned (and with
O_DIRECT the data is then on the device); "sync" adds a syncfs of the
directory. restore: StorageManager.batched_get(location="LocalDiskBackend"),
which reads the files with the backend's read pool, then the copy out into
the caller's buffer. Answers carry copy_s (the part of the timed section spent
copying between the caller's buffer and LMCache's memory objects) and, for a
synced store, sync_s. Workloads larger than the staging pool (1 GiB unless
LMCACHE_BENCH_POOL_MIB says otherwise) go through it in batches.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time

# LMCache sends usage telemetry unless told not to; its log goes to stderr.
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lmcache
import numpy as np
import protocol
import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend
from lmcache.v1.storage_backend.storage_manager import StorageManager

NAME = "lmcache-disk"
MODEL = "kvd-peers-bench"
DTYPE = torch.bfloat16
HIDDEN = 1024  # bf16 elements per token per K or V half of a layer (8 heads x 128)
GIB = 1 << 30
MIB = 1 << 20
POLL_S = 0.0002


def _chunk_shape(workload: protocol.Workload) -> torch.Size:
    if workload.layer_bytes % (4 * HIDDEN) == 0:
        tokens, hidden = workload.layer_bytes // (4 * HIDDEN), HIDDEN
    elif workload.layer_bytes % 4 == 0:
        tokens, hidden = 1, workload.layer_bytes // 4
    else:
        raise ValueError(f"layer_bytes {workload.layer_bytes} is not a whole number of bf16 K and V halves")
    return torch.Size([2, workload.layers, tokens, hidden])


def _syncfs(path: str) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if libc.syncfs(fd) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"syncfs({path}): {os.strerror(error)}")
    finally:
        os.close(fd)


class LMCacheDisk:
    def __init__(self, workload: protocol.Workload) -> None:
        self.workload = workload
        self.layers = workload.layers
        self.half = workload.layer_bytes // 2
        self.block_bytes = workload.block_bytes
        self.threads = int(os.environ.get("LMCACHE_BENCH_DISK_THREADS", "4"))
        self.shape = _chunk_shape(workload)

        pool_cap = int(os.environ.get("LMCACHE_BENCH_POOL_MIB", "1024")) * MIB
        pool_blocks = max(1, min(workload.blocks, pool_cap // self.block_bytes))
        self.batch = pool_blocks
        # The pool carves objects at 4 KiB alignment; one block of slack.
        pool_bytes = (pool_blocks + 1) * self.block_bytes + 4 * MIB
        disk_bytes = workload.total_bytes + workload.total_bytes // 4 + 64 * MIB

        os.makedirs(workload.dir, exist_ok=True)
        self.config = LMCacheEngineConfig.from_dict(
            {
                "chunk_size": self.shape[2],
                "local_cpu": False,  # no hot CPU cache: restore must read the disk
                "max_local_cpu_size": pool_bytes / GIB,  # the staging pool only
                "local_disk": workload.dir,
                "max_local_disk_size": disk_bytes / GIB,
                "extra_config": {"use_odirect": True, "disk_io_threads": self.threads},
            }
        )
        metadata = LMCacheMetadata(
            model_name=MODEL,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=DTYPE,
            kv_shape=(self.layers, 2, self.shape[2], 8, self.shape[3] // 8),
            role="worker",
            chunk_size=self.shape[2],
        )
        self.manager = StorageManager(self.config, metadata, EventManager())
        disk = self.manager.storage_backends.get("LocalDiskBackend")
        cpu = self.manager.storage_backends.get("LocalCPUBackend")
        if not isinstance(disk, LocalDiskBackend) or not isinstance(cpu, LocalCPUBackend):
            raise TypeError(
                f"LMCache built {list(self.manager.storage_backends)}, not a LocalCPUBackend "
                "allocator and a LocalDiskBackend"
            )
        if not disk.use_odirect:
            raise RuntimeError("LMCache's LocalDiskBackend did not take extra_config.use_odirect")
        self.disk, self.cpu = disk, cpu
        # LMCache uses O_DIRECT only for chunks a whole number of file system blocks long.
        self.odirect = self.block_bytes % disk.os_disk_bs == 0
        if not self.odirect:
            print(
                f"lmcache_disk: block of {self.block_bytes} bytes is not a multiple of {disk.os_disk_bs}; "
                "LMCache falls back to buffered I/O",
                file=sys.stderr,
                flush=True,
            )
        self.keys = [CacheEngineKey(MODEL, 1, 0, index, DTYPE) for index in range(workload.blocks)]

        self.buf = np.empty(workload.total_bytes, dtype=np.uint8)
        protocol.fill(self.buf, workload.seed)
        self.buf_t = torch.from_numpy(self.buf)

    # -- helpers ---------------------------------------------------------

    def _extras(self) -> dict:
        return {"odirect": self.odirect, "disk_io_threads": self.threads, "batch_blocks": self.batch}

    def _block_layers(self, index: int) -> torch.Tensor:
        """Block `index` of the caller's buffer as [2 (K, V), layers, half-layer bytes]."""
        start = index * self.block_bytes
        return self.buf_t[start : start + self.block_bytes].view(self.layers, 2, self.half).permute(1, 0, 2)

    def _chunk_bytes(self, memory_obj) -> torch.Tensor:
        tensor = memory_obj.tensor
        if tensor is None or tensor.shape != self.shape or tensor.dtype != DTYPE:
            raise RuntimeError(f"LMCache gave a memory object of {None if tensor is None else tensor.shape}")
        return tensor.view(torch.uint8).view(2, self.layers, self.half)

    def _stored(self) -> list:
        return [key for key in self.keys if self.disk.contains(key)]

    def _remove_all(self) -> int:
        present = self._stored()
        if not present:
            return 0
        with self.disk.disk_lock:
            sizes = sum(self.disk.dict[key].size for key in present)
        removed = self.disk.batched_remove(present)
        if removed != len(present):
            raise RuntimeError(f"LMCache removed {removed} of {len(present)} chunks")
        # LMCache 0.5.6's LocalDiskBackend.remove() deletes the file but never gives its
        # bytes back to current_cache_size (only its own eviction does), so without this
        # the second store after a clear is refused for want of space.
        with self.disk.disk_lock:
            self.disk.current_cache_size = max(0.0, self.disk.current_cache_size - sizes)
        return removed

    def _wait_written(self, keys: list) -> None:
        pending = list(keys)
        # A key the backend neither holds nor is writing was refused (e.g. for space).
        # (in-flight first: the backend indexes a key before it drops the in-flight mark)
        refused = [key for key in pending if not self.disk.exists_in_put_tasks(key) and not self.disk.contains(key)]
        if refused:
            raise RuntimeError(
                f"LocalDiskBackend did not take {len(refused)} of {len(keys)} chunks (see LMCache's log on stderr)"
            )
        deadline = time.monotonic() + 120 + len(keys) * self.block_bytes / (20 * MIB)
        while pending:
            pending = [key for key in pending if not self.disk.contains(key)]
            if not pending:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{len(pending)} chunk writes never completed (a write failed in "
                    "LMCache's disk worker? see its log on stderr)"
                )
            time.sleep(POLL_S)

    # -- ops -------------------------------------------------------------

    def store(self, command: dict) -> dict:
        replaced = self._remove_all()  # LMCache skips keys it holds; make every store write
        sync = bool(command.get("sync"))
        parts = {"copy_s": 0.0, "sync_s": 0.0}

        def run() -> None:
            for first in range(0, len(self.keys), self.batch):
                keys = self.keys[first : first + self.batch]
                objs = self.manager.batched_allocate(
                    self.shape, DTYPE, len(keys), fmt=MemoryFormat.KV_2LTD, busy_loop=False
                )
                if objs is None or len(objs) != len(keys):
                    raise RuntimeError(f"LMCache's pool could not allocate {len(keys)} chunks")
                started = time.perf_counter()
                for offset, obj in enumerate(objs):
                    self._chunk_bytes(obj).copy_(self._block_layers(first + offset))
                parts["copy_s"] += time.perf_counter() - started
                self.manager.batched_put(keys, objs)
                self._wait_written(keys)
            if sync:
                started = time.perf_counter()
                _syncfs(self.workload.dir)
                parts["sync_s"] = time.perf_counter() - started

        seconds, _ = protocol.timed(run)
        return {"seconds": seconds, "ok": True, "replaced": replaced, **parts, **self._extras()}

    def clear(self, command: dict) -> dict:
        removed = self._remove_all()
        left = [name for name in os.listdir(self.workload.dir) if name.endswith(".pt")]
        if left:
            raise RuntimeError(f"{len(left)} chunk files left in {self.workload.dir} after remove")
        return {"seconds": 0.0, "ok": True, "removed": removed}

    def cold(self, command: dict) -> dict:
        # local_cpu is off, so LMCache keeps no hot copy; empty it anyway and prove it.
        self.manager.clear(locations=["LocalCPUBackend"])
        hot = len(self.cpu.hot_cache)
        if hot:
            raise RuntimeError(f"LMCache's CPU backend still holds {hot} chunks")
        # The staging pool's freed memory still holds the bytes the store copied in, at the
        # addresses the restore's memory objects will get again: scrub it, so that a read that
        # fell short (LMCache does not check readinto's count) fails the check.
        pool = getattr(self.cpu.memory_allocator, "buffer", None)
        if not isinstance(pool, torch.Tensor) or pool.dtype != torch.uint8:
            raise TypeError(f"cannot find the staging pool of {type(self.cpu.memory_allocator).__name__}")
        pool.fill_(0xA5)
        return {"seconds": 0.0, "ok": True, "hot_cache_entries": hot, "pool_scrubbed_bytes": pool.numel()}

    def restore(self, command: dict) -> dict:
        missing = len(self.keys) - len(self._stored())
        if missing:
            raise RuntimeError(f"{missing} of {len(self.keys)} chunks are not in the LocalDiskBackend")
        protocol.scramble(self.buf)
        parts = {"copy_s": 0.0}

        def run() -> None:
            for first in range(0, len(self.keys), self.batch):
                keys = self.keys[first : first + self.batch]
                objs = self.manager.batched_get(keys, location="LocalDiskBackend")
                try:
                    if any(obj is None for obj in objs):
                        got = sum(obj is not None for obj in objs)
                        raise RuntimeError(f"LMCache returned {got} of {len(keys)} chunks from disk")
                    started = time.perf_counter()
                    for offset, obj in enumerate(objs):
                        self._block_layers(first + offset).copy_(self._chunk_bytes(obj))
                    parts["copy_s"] += time.perf_counter() - started
                finally:
                    for obj in objs:
                        if obj is not None:
                            obj.ref_count_down()

        seconds, _ = protocol.timed(run)
        ok = protocol.check(self.buf, self.workload.seed)
        return {"seconds": seconds, "ok": ok, **parts, **self._extras()}

    def close(self) -> None:
        self.manager.close()


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: lmcache_disk.py '<Workload JSON>'")
    workload = protocol.Workload.from_json(sys.argv[1])
    if torch.version.cuda is not None:
        print(f"lmcache_disk: note: torch {torch.__version__} is a CUDA build", file=sys.stderr)
    peer = LMCacheDisk(workload)
    try:
        protocol.serve(
            NAME,
            lmcache.__version__,
            {
                "store": peer.store,
                "clear": peer.clear,
                "cold": peer.cold,
                "restore": peer.restore,
            },
        )
    finally:
        peer.close()


if __name__ == "__main__":
    main()
