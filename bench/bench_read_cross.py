#!/usr/bin/env python3
"""kvd's disk read path against vLLM's FS-tier reader, in one process, crossed over layout and memory.

    make bench-read-cross    (or: .venv-vllm/bin/python bench/bench_read_cross.py [--total-mib 1024]
                                  [--tokens 16 256] [--rounds 5] [--dir DIR] [--store-before-read])

bench_peers.py runs each contender in its own process on its own bytes, so
a gap between two of them may come from the readers, from where their
bytes lie, or from the memory they read into. This benchmark takes the
three apart: it runs in vLLM's venv (for vLLM's own native reader,
vllm.fs_io_C, on its DualQueueThreadPool of 16 read threads, as
bench/peers/vllm_fs.py drives it) with kvd's io_uring engine imported
from this checkout, and reads the same pattern, in the same rounds, with:

* vLLM's reader, its files (one per block, written by its own store)
  into its buffer (4 KiB-page shared memory, bench/peers/protocol.py):
  what vLLM's FS tier does;
* kvd's engine, kvd's layout (two preallocated segment files, blocks
  striped over them, written by the engine) into kvd's kind of arena (a
  sealed memfd with huge pages, populated): what a kvd restore does below
  the daemon, checksums left out (bench_disk_restore shows they are
  hidden under the reads);
* the crossings: vLLM's reader into kvd's arena, kvd's engine over
  vLLM's files, kvd's engine into vLLM's buffer.

The page cache is dropped before every read (root), every read is checked
against the pattern, and the order rotates each round. Reported: median
GiB/s of each, kvd over vLLM (the target of issue 13 is 1.1x), and the two
factors: reader (kvd's engine over vLLM's reader, both into the same
arena) and memory (kvd's arena over vLLM's buffer, same engine, same
segments); and how many physically contiguous runs a 2 MiB stretch of
each buffer spans (/proc/self/pagemap): a 4 KiB-page buffer reads about
as fast as it is contiguous, which depends on what the kernel had free.
The disk here is virtual and shared: compare within one run.
"""

from __future__ import annotations

import argparse
import fcntl
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import protocol  # noqa: E402
from _common import REPO_ROOT, progress, ratio, report, write_result  # noqa: E402

from kvd.io import engine as io_engine  # noqa: E402
from kvd.io.engine import address_of  # noqa: E402

TOKEN_BYTES = 32 * 2 * 8 * 128 * 2  # a Llama-3-8B-like block in bf16: 32 layers x K/V x 8 heads x 128 dims
QUEUE_DEPTH = 128  # the daemon's disk.queue_depth
SEED = 7
_F_ADD_SEALS, _F_SEAL_SHRINK, _F_SEAL_GROW = 1033, 2, 4
_MADV_POPULATE_WRITE = 23
TARGET = 1.1
PAGE = mmap.PAGESIZE


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1\n")


def arena_memory(nbytes: int) -> tuple[np.ndarray, mmap.mmap]:
    """Memory as kvd's arena is: a sealed memfd, huge pages advised, populated."""
    fd = os.memfd_create("kvd-cross-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, _F_ADD_SEALS, _F_SEAL_SHRINK | _F_SEAL_GROW)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    mapping.madvise(_MADV_POPULATE_WRITE)
    return np.frombuffer(mapping, dtype=np.uint8), mapping


class VllmFiles:
    """vLLM's FS tier as bench/peers/vllm_fs.py drives it (its files, its pool, its buffer), readable into any memory."""

    def __init__(self, root: Path, blocks: int, block_bytes: int) -> None:
        from vllm_fs import VllmFsContender, fs_io

        if not fs_io._HAS_FSIO_C:
            raise SystemExit("vllm.fs_io_C is missing: this vLLM has only the Python fallback of its FS tier")
        workload = protocol.Workload(dir=str(root), layers=1, layer_bytes=block_bytes, blocks=blocks, seed=SEED)
        self.contender = VllmFsContender(workload)
        self.buffer, self.paths = self.contender.buffer, self.contender.paths

    def store(self, buffer: np.ndarray) -> None:
        self.contender.store_from(memoryview(buffer))

    def load(self, buffer: np.ndarray) -> None:
        self.contender.load_into(memoryview(buffer))

    def close(self) -> None:
        self.contender.pool.shutdown()


class KvdReads:
    """kvd's engine over two segment files (blocks striped as over two drives), or over any files."""

    def __init__(self, root: Path, blocks: int, block_bytes: int) -> None:
        self.blocks, self.block_bytes = blocks, block_bytes
        per_drive = -(-blocks // 2) * block_bytes
        self.fds = []
        for drive in range(2):
            fd = os.open(root / f"seg-{drive}.kvd", os.O_CREAT | os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC, 0o600)
            os.posix_fallocate(fd, 0, per_drive)
            self.fds.append(fd)
        index = np.arange(blocks)
        self.striped = (self.fds, index % 2, (index // 2) * block_bytes)

    def _batch(self, op: io_engine.Op, places, buffer: np.ndarray) -> float:
        fds, file_index, offsets = places
        with io_engine.open_engine("uring", queue_depth=QUEUE_DEPTH) as engine:
            engine.register_files(fds)
            addresses = address_of(buffer) + np.arange(self.blocks) * self.block_bytes
            started = time.perf_counter()
            results = engine.wait(engine.submit(op, file_index, offsets, np.full(self.blocks, self.block_bytes),
                                                addresses))
            seconds = time.perf_counter() - started
            if op == io_engine.Op.WRITE:
                for index in range(len(fds)):
                    engine.fsync(index)
        if not (results == self.block_bytes).all():
            raise RuntimeError(f"kvd's engine moved short or failed entries: {results[results != self.block_bytes]}")
        return seconds

    def store(self, buffer: np.ndarray) -> None:
        self._batch(io_engine.Op.WRITE, self.striped, buffer)

    def load(self, buffer: np.ndarray) -> float:
        return self._batch(io_engine.Op.READ, self.striped, buffer)

    def load_files(self, paths: list[str], buffer: np.ndarray) -> float:
        fds = [os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC) for path in paths]
        try:
            return self._batch(io_engine.Op.READ, (fds, np.arange(self.blocks), np.zeros(self.blocks, np.int64)),
                               buffer)
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


def physical_runs_per_2mib(buffer: np.ndarray) -> float:
    """How many physically contiguous runs a 2 MiB stretch of `buffer` spans, on average (from
    /proc/self/pagemap, root): 1.0 for huge pages; a 4 KiB-page buffer gets what the kernel had free."""
    pages, first = len(buffer) // PAGE, address_of(buffer) // PAGE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read(pages * 8), dtype=np.uint64)
    frames = (entries & np.uint64((1 << 55) - 1)).astype(np.int64)
    per_window = (2 << 20) // PAGE
    runs = [1 + np.count_nonzero(np.diff(frames[i:i + per_window]) != 1) for i in range(0, pages, per_window)]
    return float(np.mean(runs))


def timed(action: Callable[[], float | None]) -> float:
    started = time.perf_counter()
    inner = action()
    return inner if inner is not None else time.perf_counter() - started


def run_shape(tokens: int, total: int, rounds: int, root: Path, store_first: bool) -> dict:
    block_bytes = tokens * TOKEN_BYTES
    blocks = max(1, total // block_bytes)
    nbytes = blocks * block_bytes
    vllm = VllmFiles(root / "vllm", blocks, block_bytes)  # its buffer first, as before the arena
    vllm_buffer = vllm.buffer
    arena, _mapping = arena_memory(nbytes)
    kvd = KvdReads(root, blocks, block_bytes)
    try:
        progress(f"{tokens} tokens: storing {blocks} blocks each way")
        protocol.fill(vllm_buffer, SEED)
        vllm.store(vllm_buffer)
        protocol.fill(arena, SEED)
        kvd.store(arena)
        readers = {
            "vllm reader, vllm files -> vllm buffer": (vllm_buffer, lambda: vllm.load(vllm_buffer)),
            "vllm reader, vllm files -> kvd arena": (arena, lambda: vllm.load(arena)),
            "kvd engine, kvd segments -> kvd arena": (arena, lambda: kvd.load(arena)),
            "kvd engine, vllm files -> kvd arena": (arena, lambda: kvd.load_files(vllm.paths, arena)),
            "kvd engine, kvd segments -> vllm buffer": (vllm_buffer, lambda: kvd.load(vllm_buffer)),
        }
        rates: dict[str, list[float]] = {name: [] for name in readers}
        names = list(readers)
        for index in range(rounds):
            for name in names[index % len(names):] + names[:index % len(names)]:
                target, read = readers[name]
                if store_first:  # untimed: the buffer's last DMA is a write from it, as in bench_peers' rounds
                    (vllm.store if target is vllm_buffer else kvd.store)(target)
                protocol.scramble(target)
                drop_page_cache()
                rates[name].append(nbytes / timed(read) / (1 << 30))
                if not protocol.check(target, SEED):
                    raise RuntimeError(f"{name}: the bytes read back are not the ones stored")
            progress(f"{tokens} tokens: round {index + 1}/{rounds}")
    finally:
        vllm.close()
        kvd.close()
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {"block_bytes": block_bytes, "blocks": blocks, "gib_s": rates, "median_gib_s": medians,
            "kvd_vs_vllm": ratio(medians["kvd engine, kvd segments -> kvd arena"],
                                 medians["vllm reader, vllm files -> vllm buffer"]),
            "reader_kvd_vs_vllm_same_arena": ratio(medians["kvd engine, vllm files -> kvd arena"],
                                                   medians["vllm reader, vllm files -> kvd arena"]),
            "memory_arena_vs_vllm_buffer": ratio(medians["kvd engine, kvd segments -> kvd arena"],
                                                 medians["kvd engine, kvd segments -> vllm buffer"]),
            "physical_runs_per_2mib": {"vllm buffer": physical_runs_per_2mib(vllm_buffer),
                                       "kvd arena": physical_runs_per_2mib(arena)}}


def print_shape(tokens: int, result: dict) -> None:
    report(f"\n{tokens}-token blocks ({result['blocks']} x {result['block_bytes'] >> 20} MiB)")
    for name, value in result["median_gib_s"].items():
        report(f"  {name:42s} median {value:5.2f} GiB/s")
    report(f"  kvd over vLLM                              {result['kvd_vs_vllm']:.2f}x (target {TARGET}x)")
    report(f"  reader: kvd's engine / vLLM's, same arena  {result['reader_kvd_vs_vllm_same_arena']:.2f}x")
    report(f"  memory: kvd's arena / vLLM's buffer        {result['memory_arena_vs_vllm_buffer']:.2f}x")
    runs = result["physical_runs_per_2mib"]
    report(f"  physical runs per 2 MiB: vLLM's buffer {runs['vllm buffer']:.1f}, kvd's arena {runs['kvd arena']:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the files go (default: a temp dir under the repository)")
    parser.add_argument("--store-before-read", action="store_true",
                        help="store again (untimed) into the files before each read, as bench_peers' rounds do")
    args = parser.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("bench_read_cross drops the page cache before every read: run it as root")
    root = Path(tempfile.mkdtemp(prefix="kvd-read-cross-", dir=args.dir or REPO_ROOT))
    try:
        shapes = {}
        for tokens in args.tokens:
            (root / str(tokens) / "vllm").mkdir(parents=True)
            shapes[tokens] = run_shape(tokens, args.total_mib << 20, args.rounds, root / str(tokens),
                                       args.store_before_read)
            print_shape(tokens, shapes[tokens])
    finally:
        shutil.rmtree(root, ignore_errors=True)
    met = all(shape["kvd_vs_vllm"] >= TARGET for shape in shapes.values())
    report(f"\nkvd over vLLM at every block size >= {TARGET}x: {'met' if met else 'MISSED'}")
    write_result("bench_read_cross", {"parameters": vars(args), "shapes": shapes, "target": TARGET, "met": met})


if __name__ == "__main__":
    main()
