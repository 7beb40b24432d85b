#!/usr/bin/env python3
"""Batched O_DIRECT reads: the io_uring engine vs the thread-pool fallback vs fio.

What: one repetition reads a whole preallocated, fully written file
(1 GiB by default) with O_DIRECT in 64 KiB entries, sequentially, as
batches of `--batch-entries` entries into one aligned buffer: submit a
batch, wait for it, submit the next (what a disk tier restoring a request
does). At each queue depth (32 and 128 by default) the contenders are:

* uring: `open_engine("uring")`, plain READ entries;
* uring+fixed: the same with the destination buffer registered
  (`register_buffers`, READ_FIXED), to see whether registration pays;
* uring+single: plain READ entries on a ring set up with
  IORING_SETUP_SINGLE_ISSUER | DEFER_TASKRUN (the ring is single-threaded
  by contract), to see whether those flags pay;
* fallback: `open_engine("fallback")` (min(queue depth, 16) threads);
* fio: `fio --ioengine=io_uring --direct=1 --rw=read --bs=64k
  --iodepth=<queue depth> --iodepth_batch_submit=<queue depth>
  --iodepth_batch_complete_max=<queue depth>` over the same file, when
  fio is installed (Debian package fio; `make bench` installs it). Its
  GiB/s is fio's own (I/O time, not its start-up).

Contenders are interleaved round by round (the order rotates), so their
ratios hold on a shared machine. The disk here is virtual and its host
caches even O_DIRECT reads: absolute GiB/s mean little, compare within
one run only.

Reported per contender: median and best GiB/s over rounds, CPU time per
entry (user+system of this process from getrusage, which includes the
fallback's threads and io_uring's worker threads; for fio, its own
usr+sys report), and submission system calls per batch (engine stats).
After every repetition the last batch's bytes are checked against the
pattern the file was written with.

Run:  .venv/bin/python bench/bench_io_engine.py [--file-mib 1024] [--queue-depths 32 128]
                                                 [--rounds 5] [--batch-entries 1024] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_ratio, progress, ratio, report, warn_if_busy, write_result  # noqa: E402

from kvd.io import Op, address_of, aligned_empty, open_engine  # noqa: E402

ENTRY_BYTES_DEFAULT = 64 << 10


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def write_test_file(path: Path, file_bytes: int, entry_bytes: int) -> None:
    """Every entry-sized chunk starts with its index (uint64), the rest is random."""
    rng = np.random.default_rng(1)
    chunk_bytes = 64 << 20
    pattern = rng.integers(0, 256, chunk_bytes, dtype=np.uint8)
    entries_per_chunk = chunk_bytes // entry_bytes
    with open(path, "wb") as handle:
        for chunk in range(file_bytes // chunk_bytes):
            headers = pattern.reshape(entries_per_chunk, entry_bytes)[:, :8].view(np.uint64)
            headers[:, 0] = np.arange(entries_per_chunk, dtype=np.uint64) + chunk * entries_per_chunk
            handle.write(pattern.data)
        handle.flush()
        os.fsync(handle.fileno())


class EngineReader:
    """Reads the whole file through one engine, batch after batch."""

    def __init__(self, kind: str, fd: int, queue_depth: int, file_bytes: int, entry_bytes: int,
                 batch_entries: int, fixed_buffers: bool, single_issuer: bool = False) -> None:
        self.engine = open_engine(kind, queue_depth, max_batch_entries=batch_entries, single_issuer=single_issuer)
        self.engine.register_files([fd])
        self.buffer = aligned_empty(batch_entries * entry_bytes)
        self.buffer[:] = 0  # fault the pages in before timing
        if fixed_buffers:
            self.engine.register_buffers([(address_of(self.buffer), self.buffer.size)])
        self.entry_bytes = entry_bytes
        self.batch_entries = batch_entries
        self.total_entries = file_bytes // entry_bytes
        index = np.arange(batch_entries)
        self.file_index = np.zeros(batch_entries, dtype=np.int32)
        self.length = np.full(batch_entries, entry_bytes, dtype=np.uint32)
        self.address = np.uint64(address_of(self.buffer)) + (index * entry_bytes).astype(np.uint64)
        self.offsets = [(index + first).astype(np.int64) * entry_bytes
                        for first in range(0, self.total_entries, batch_entries)]

    def run(self) -> dict[str, float]:
        before = self.engine.stats
        cpu_before = cpu_seconds()
        started = time.perf_counter()
        for offset in self.offsets:
            results = self.engine.wait(self.engine.submit(Op.READ, self.file_index, offset, self.length, self.address))
            if not np.all(results == self.entry_bytes):
                raise RuntimeError(f"{self.engine.kind}: short or failed reads: {np.unique(results)}")
        seconds = time.perf_counter() - started
        cpu = cpu_seconds() - cpu_before
        after = self.engine.stats
        # The last batch read entries [total - batch, total): check their headers.
        headers = self.buffer.reshape(self.batch_entries, self.entry_bytes)[:, :8].copy().view(np.uint64)[:, 0]
        expected = np.arange(self.total_entries - self.batch_entries, self.total_entries, dtype=np.uint64)
        if not np.array_equal(headers, expected):
            raise RuntimeError(f"{self.engine.kind}: read bytes do not match the file")
        batches = after["batches"] - before["batches"]
        return {
            "seconds": seconds,
            "cpu_seconds": cpu,
            "entries": after["entries"] - before["entries"],
            "submit_calls_per_batch": (after["submit_calls"] - before["submit_calls"]) / batches,
            "enter_calls_per_batch": (after["enter_calls"] - before["enter_calls"]) / batches,
            "fixed_buffer_entries": after["fixed_buffer_entries"] - before["fixed_buffer_entries"],
        }

    def close(self) -> None:
        self.engine.close()


class FioReader:
    def __init__(self, binary: str, path: Path, queue_depth: int, file_bytes: int, entry_bytes: int) -> None:
        self.command = [
            binary, "--name=kvd-bench", f"--filename={path}", "--rw=read", f"--bs={entry_bytes}",
            "--direct=1", "--ioengine=io_uring", f"--iodepth={queue_depth}", f"--size={file_bytes}",
            # Submit and reap up to a queue's worth per call, like the engine;
            # fio's default (one per call) was slower here at depth 32.
            f"--iodepth_batch_submit={queue_depth}", f"--iodepth_batch_complete_max={queue_depth}",
            "--numjobs=1", "--output-format=json",
        ]
        self.entry_bytes = entry_bytes

    def run(self) -> dict[str, float]:
        started = time.perf_counter()
        out = subprocess.run(self.command, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - started
        job = json.loads(out.stdout)["jobs"][0]
        read = job["read"]
        seconds = read["io_bytes"] / read["bw_bytes"]  # fio's own I/O time, without its start-up
        job_seconds = job["job_runtime"] / 1e3
        return {
            "seconds": seconds,
            "wall_seconds_with_startup": wall,
            "cpu_seconds": (job["usr_cpu"] + job["sys_cpu"]) / 100 * job_seconds,
            "entries": read["total_ios"],
            "submit_calls_per_batch": None,
            "enter_calls_per_batch": None,
            "fixed_buffer_entries": 0,
        }

    def close(self) -> None:
        pass


def summarize(file_bytes: int, samples: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [file_bytes / sample["seconds"] / (1 << 30) for sample in samples]
    entries = sum(sample["entries"] for sample in samples)
    per_batch = [sample["submit_calls_per_batch"] for sample in samples if sample["submit_calls_per_batch"] is not None]
    enters = [sample["enter_calls_per_batch"] for sample in samples if sample["enter_calls_per_batch"] is not None]
    return {
        "median_gib_s": statistics.median(rates),
        "best_gib_s": max(rates),
        "gib_s": rates,
        "cpu_us_per_entry": sum(sample["cpu_seconds"] for sample in samples) / entries * 1e6,
        "submit_calls_per_batch": statistics.fmean(per_batch) if per_batch else None,
        "enter_calls_per_batch": statistics.fmean(enters) if enters else None,
        "samples": samples,
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file-mib", type=int, default=1024)
    parser.add_argument("--entry-kib", type=int, default=ENTRY_BYTES_DEFAULT >> 10)
    parser.add_argument("--queue-depths", type=int, nargs="+", default=[32, 128])
    parser.add_argument("--batch-entries", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the test file goes (default: the system temp dir)")
    parser.add_argument("--no-fio", action="store_true")
    args = parser.parse_args()
    file_bytes, entry_bytes = args.file_mib << 20, args.entry_kib << 10
    if file_bytes % (64 << 20) or file_bytes % (entry_bytes * args.batch_entries):
        parser.error("--file-mib must be a multiple of 64 and of the batch size")
    return args


def measure_queue_depth(args: argparse.Namespace, fd: int, path: Path, fio: str | None, queue_depth: int
                        ) -> dict[str, Any]:
    """Every contender at one queue depth, interleaved round by round."""
    file_bytes, entry_bytes, batch = args.file_mib << 20, args.entry_kib << 10, args.batch_entries
    contenders: dict[str, Any] = {
        "uring": EngineReader("uring", fd, queue_depth, file_bytes, entry_bytes, batch, False),
        "uring+fixed": EngineReader("uring", fd, queue_depth, file_bytes, entry_bytes, batch, True),
        "uring+single": EngineReader("uring", fd, queue_depth, file_bytes, entry_bytes, batch, False,
                                     single_issuer=True),
        "fallback": EngineReader("fallback", fd, queue_depth, file_bytes, entry_bytes, batch, False),
    }
    if fio:
        contenders["fio"] = FioReader(fio, path, queue_depth, file_bytes, entry_bytes)
    names = list(contenders)
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for name in names:  # warm-up: first touches, thread start-up, the host's cache
        contenders[name].run()
    for round_index in range(args.rounds):
        order = names[round_index % len(names):] + names[: round_index % len(names)]
        for name in order:
            samples[name].append(contenders[name].run())
        progress(f"queue depth {queue_depth}: round {round_index + 1}/{args.rounds} done")
    for contender in contenders.values():
        contender.close()
    return {name: summarize(file_bytes, samples[name]) for name in names}


def ratios_of(by_name: dict[str, Any]) -> dict[str, float | None]:
    uring = by_name["uring"]["median_gib_s"]
    return {
        "uring_vs_fallback": ratio(uring, by_name["fallback"]["median_gib_s"]),
        "uring_vs_fio": ratio(uring, by_name["fio"]["median_gib_s"]) if "fio" in by_name else None,
        "uring_fixed_vs_uring": ratio(by_name["uring+fixed"]["median_gib_s"], uring),
        "uring_single_issuer_vs_uring": ratio(by_name["uring+single"]["median_gib_s"], uring),
        "uring_single_issuer_vs_uring_cpu_per_entry": ratio(by_name["uring+single"]["cpu_us_per_entry"],
                                                            by_name["uring"]["cpu_us_per_entry"]),
        "fallback_vs_uring_cpu_per_entry": ratio(by_name["fallback"]["cpu_us_per_entry"],
                                                 by_name["uring"]["cpu_us_per_entry"]),
    }


def print_results(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    report(f"== batched O_DIRECT reads: {args.file_mib} MiB file, {args.entry_kib} KiB entries, "
           f"batches of {args.batch_entries} entries, {args.rounds} rounds (median GiB/s) ==")
    report(f"{'queue depth':>11} {'contender':<12} {'GiB/s':>7} {'best':>7} {'CPU us/entry':>13} "
           f"{'submits/batch':>14} {'enters/batch':>13}")
    ratios: dict[str, dict[str, float | None]] = {}
    for key, by_name in results.items():
        for name, summary in by_name.items():
            submits = summary["submit_calls_per_batch"]
            enters = summary["enter_calls_per_batch"]
            report(f"{key[2:]:>11} {name:<12} {summary['median_gib_s']:>7.2f} {summary['best_gib_s']:>7.2f} "
                   f"{summary['cpu_us_per_entry']:>13.2f} {'-' if submits is None else f'{submits:.1f}':>14} "
                   f"{'-' if enters is None else f'{enters:.1f}':>13}")
        ratios[key] = ratios_of(by_name)
    report("")
    report("ratios (medians, same run):")
    for key, values in ratios.items():
        report(f"  queue depth {key[2:]}: " + ", ".join(f"{name} {fmt_ratio(value)}" for name, value in values.items()))
    return ratios


def main() -> int:
    args = parse_args()
    warn_if_busy()
    entry_bytes = args.entry_kib << 10
    file_bytes = args.file_mib << 20
    fio = None if args.no_fio else shutil.which("fio")
    if fio is None and not args.no_fio:
        progress("fio not found (Debian package fio): the fio column is skipped")
    directory = Path(tempfile.mkdtemp(prefix="kvd-bench-io-", dir=args.dir))
    path = directory / "data.bin"
    progress(f"writing {args.file_mib} MiB to {path}")
    write_test_file(path, file_bytes, entry_bytes)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    results: dict[str, Any] = {}
    try:
        for queue_depth in args.queue_depths:
            results[f"qd{queue_depth}"] = measure_queue_depth(args, fd, path, fio, queue_depth)
    finally:
        os.close(fd)
        shutil.rmtree(directory)
    ratios = print_results(args, results)
    # Target: the native engine is worth having: faster than the fallback,
    # and within 20% of fio driving the same io_uring reads.
    verdicts = []
    for values in ratios.values():
        verdicts.append(values["uring_vs_fallback"] is not None and values["uring_vs_fallback"] >= 1.0)
        if values["uring_vs_fio"] is not None:
            verdicts.append(values["uring_vs_fio"] >= 0.8)
    passed = all(verdicts)
    report(f"target: uring >= 1.0x fallback and >= 0.8x fio at every queue depth: {'PASS' if passed else 'FAIL'}")
    write_result("bench_io_engine", {
        "parameters": vars(args) | {"entry_bytes": entry_bytes, "file_bytes": file_bytes, "fio": fio},
        "results": results,
        "ratios": ratios,
        "target": "uring >= 1.0x fallback and >= 0.8x fio (median GiB/s) at every queue depth",
        "pass": passed,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
