#!/usr/bin/env python3
"""O_DIRECT reads into three kinds of memory: what the destination's pages cost a restore.

What: `--mib` of `--read-kib` reads at random aligned offsets of a file (written once, `--file-mib`),
through kvd's io_uring engine in batches of 512, into:

* shared: a memfd mapped MAP_SHARED, the way kvd's host arena is (clients map it too); shmem gets
  transparent huge pages only where /sys/kernel/mm/transparent_hugepage/shmem_enabled allows;
* private: anonymous private memory in 4 KiB pages;
* private-thp: anonymous private memory on 2 MiB boundaries, advised into transparent huge pages
  (what the ring proxy's staging uses, kvd.device.io_ring.huge_page_memory);
* shared-via-thp: into the shared memfd again, but each batch read into a huge-page bounce buffer
  first and copied into place in one native call (what a disk tier could do for the arena).

Rounds are interleaved; prints GiB/s per kind and the ratios to `shared`, writes
bench/results/bench_dma_target.json. A lead for the disk tier's restore speed (issue 13): the arena
is shared memory, and on this machine shmem gets no huge pages.

Run: .venv/bin/python bench/bench_dma_target.py [--mib 256] [--read-kib 64] [--rounds 4]
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_ratio, progress, ratio, report, warn_if_busy, write_result  # noqa: E402

from kvd._native import copy_chunks  # noqa: E402
from kvd.pages import huge_page_memory  # noqa: E402
from kvd.io import Op, address_of, open_engine  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BATCH = 512


def targets(nbytes: int) -> dict[str, np.ndarray]:
    fd = os.memfd_create("kvd-bench-arena", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    shared = np.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED), dtype=np.uint8)
    os.close(fd)
    private = np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=np.uint8)
    thp = np.frombuffer(huge_page_memory(nbytes), dtype=np.uint8)
    for memory in (shared, private, thp):
        memory[::4096] = 0  # every page faulted in before timing
    return {"shared": shared, "private": private, "private-thp": thp}


def read_into(engine, memory: np.ndarray, offsets: np.ndarray, read_bytes: int,
              bounce: np.ndarray | None = None) -> float:
    """Seconds to read every offset into `memory` (through `bounce`, a batch at a time, if given)."""
    count = len(offsets)
    step = np.arange(BATCH, dtype=np.uint64) * np.uint64(read_bytes)
    lengths = np.full(BATCH, read_bytes, dtype=np.uint32)
    files = np.zeros(BATCH, dtype=np.int32)
    started = time.perf_counter()
    for first in range(0, count, BATCH):
        last = min(first + BATCH, count)
        places = np.uint64(address_of(memory)) + np.uint64(first * read_bytes) + step[:last - first]
        landing = places if bounce is None else np.uint64(address_of(bounce)) + step[:last - first]
        results = engine.wait(engine.submit(Op.READ, files[:last - first], offsets[first:last],
                                            lengths[:last - first], landing))
        if not np.all(results == read_bytes):
            raise RuntimeError(f"short or failed reads: {np.unique(results)}")
        if bounce is not None:
            copy_chunks(places, landing, read_bytes)
    return time.perf_counter() - started


def measure(args: argparse.Namespace, directory: Path) -> dict:
    nbytes, read_bytes = args.mib << 20, args.read_kib << 10
    path = directory / "blocks"
    np.random.default_rng(1).integers(0, 256, args.file_mib << 20, dtype=np.uint8).tofile(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
    engine = open_engine("uring", 64, max_batch_entries=BATCH)
    engine.register_files([fd])
    offsets = np.random.default_rng(2).choice((args.file_mib << 20) // read_bytes, nbytes // read_bytes,
                                              replace=False).astype(np.int64) * read_bytes
    memories = targets(nbytes)
    bounce = np.frombuffer(huge_page_memory(BATCH * read_bytes), dtype=np.uint8)
    runs = {name: (memory, None) for name, memory in memories.items()}
    runs["shared-via-thp"] = (memories["shared"], bounce)
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for round_number in range(args.rounds):
        names = list(runs) if round_number % 2 == 0 else list(reversed(runs))
        for name in names:
            memory, bounce_buffer = runs[name]
            seconds[name].append(read_into(engine, memory, offsets, read_bytes, bounce_buffer))
        progress(f"round {round_number + 1}/{args.rounds}: " + ", ".join(
            f"{name} {nbytes / s[-1] / (1 << 30):.2f} GiB/s" for name, s in seconds.items()))
    engine.close()
    os.close(fd)
    rates = {name: statistics.median(nbytes / s / (1 << 30) for s in values) for name, values in seconds.items()}
    shmem = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
    return {"bytes": nbytes, "read_bytes": read_bytes, "rounds": args.rounds, "gib_s": rates, "seconds": seconds,
            "over_shared": {name: ratio(rate, rates["shared"]) for name, rate in rates.items()},
            "shmem_enabled": shmem.read_text().strip() if shmem.exists() else "unknown"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--read-kib", type=int, default=64)
    parser.add_argument("--file-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dir", default=str(ROOT / "build"))
    args = parser.parse_args()
    warn_if_busy()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-dma-") as directory:
        result = measure(args, Path(directory))
    report(f"O_DIRECT reads of {args.read_kib} KiB into each kind of memory, median of {args.rounds} rounds "
           f"(shmem THP: {result['shmem_enabled']}):")
    for name, rate in result["gib_s"].items():
        report(f"  {name:<12} {rate:6.2f} GiB/s   {fmt_ratio(result['over_shared'][name])} of shared")
    write_result("bench_dma_target", result)


if __name__ == "__main__":
    main()
