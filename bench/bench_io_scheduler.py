#!/usr/bin/env python3
"""Restores under a write-back stream: the slack-aware schedule vs a plain FIFO vs reads alone.

What: one DiskTier (2 directories, the daemon's defaults: io_uring, queue
depth 128, 512 KiB extents) and its one I/O thread, driven the way the
daemon drives it (kvd.planes.io_executor.ScheduledExecutor over
kvd.planner.io_schedule.IoSchedule):

* restores: back-to-back `read_blocks` of `--restore-blocks` blocks (a
  long prompt: 128 blocks x 2 MiB = 256 MiB by default; 16 tokens per
  block, 32 layers of 64 KiB), checksums verified, each one RESTORE job;
* write-back: a task that writes `--write-batch-blocks` blocks (64, the
  daemon's disk.write_batch_blocks) at a time, for as long as the restores
  run, removing the previous copies first (as eviction does), strict
  fsync.

Contenders, interleaved round by round in one process:

* reads alone: no write-back;
* fifo: the schedule in arrival order, each write batch one job (what the
  daemon did before the scheduler);
* slack: restores first, write-back in chunks of `--write-chunk-blocks`
  (8, disk.write_chunk_blocks); a write job starts only when no read is
  waiting and runs the batch's chunks pipelined (DiskTier.write_chunks),
  stopping between chunks as soon as a read is queued, as the daemon's
  write jobs do;
* slack, backlog full: the same with the write backlog over its bound, so
  writes get one job after every disk.write_share (4) reads: what the
  restores keep while memory needs writing;
* slack, profiled: slack with write jobs sized as the daemon sizes them
  under disk.slack_profile (kvd.planner.slack.WriteSizer): the write budget
  the slack table (`--slack-table`, measured by `make slack-profile` from a
  real model's per-layer timings) leaves in every layer of a restore of
  this length, with the drive's read and write bandwidths as observed in
  this run. A write job whose first chunk fits also runs inside a
  restore, between its layer groups, in those layers' slack (that chunk
  only), as the daemon runs them.

Reported: restore bandwidth (median over restores, GiB/s) and p50/p99
restore latency, the write bandwidth the stream got meanwhile, ratios to
reads alone. Target (issue 4): restores under write load keep >= 0.9x the
read-alone bandwidth with the scheduler.

The development VM's disk is shared and its host caches even O_DIRECT
reads; compare within one run.

Run:  .venv/bin/python bench/bench_io_scheduler.py [--rounds 3] [--restores 6] [--restore-blocks 128]
          [--write-batch-blocks 64] [--write-chunk-blocks 8] [--dir /tmp] [--slack-table FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_ratio, percentile, progress, ratio, report, warn_if_busy, write_result

from kvd.config import DiskSettings
from kvd.planner.io_schedule import IoClass, IoSchedule
from kvd.core.keys import DType, NamespaceSpec
from kvd.planner.slack import SlackTable, WriteSizer
from kvd.planes.io_executor import ScheduledExecutor
from kvd.testing import disk_ops
from kvd.tiers.disk.journal import FsyncPolicy
from kvd.tiers.disk.layout import DiskConfig
from kvd.tiers.disk.tier import DiskTier
from kvd.tiers.host import ArenaLayout, HostArena

SEGMENT_BYTES = 256 << 20
TARGET = 0.9
SPEC = NamespaceSpec("bench-llama-8b-like", num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16,
                     kv_dtype=DType.BFLOAT16)


def key_of(index: int) -> bytes:
    return hashlib.blake2b(index.to_bytes(8, "little"), digest_size=32).digest()


class Rig:
    """The tier, an arena holding the restore set and the write set, and their records."""

    def __init__(self, root: Path, restore_blocks: int, write_blocks: int, table: SlackTable) -> None:
        # Bandwidths observed over every contender's jobs; the profiled one sizes its writes with them.
        self.sizer = WriteSizer(table)
        self.sizer.restore(restore_blocks * SPEC.block_tokens, SPEC.layer_bytes // SPEC.block_tokens, SPEC.num_layers)
        # The profiled contender's writes inside a restore (as kvd.planes.disk runs them); None: none.
        self.between_groups = None
        self.restore_blocks = restore_blocks
        self.write_blocks = write_blocks
        self.block_bytes = SPEC.block_bytes
        count = restore_blocks + write_blocks
        self.arena = HostArena(ArenaLayout(self.block_bytes, count + restore_blocks), prefault=True)
        rng = np.random.default_rng(5)
        self.arena.array[: count * self.block_bytes] = rng.integers(0, 256, count * self.block_bytes, dtype=np.uint8)
        defaults = DiskSettings()
        per_drive = -(-(count // 2 + 1) * self.block_bytes // SEGMENT_BYTES) * SEGMENT_BYTES
        self.tier = DiskTier(DiskConfig(
            directories=(root / "drive0", root / "drive1"), capacity_bytes=per_drive, slot_bytes=self.block_bytes,
            segment_bytes=SEGMENT_BYTES, fsync_policy=FsyncPolicy.STRICT, queue_depth=defaults.queue_depth,
            read_extent_bytes=defaults.read_extent_bytes,
        ))
        for directory in self.tier.config.directories:
            directory.mkdir(parents=True, exist_ok=True)
        self.tier.open()
        self.namespace_id = SPEC.namespace_id()
        self.tier.register_namespace(self.namespace_id, SPEC.encode())
        # Disk slots 0.. hold the restore set (written once); the write set
        # cycles through the slots after it.
        items = [(key_of(i), b"", i, self.arena.address(i)) for i in range(restore_blocks)]
        for start in range(0, len(items), 64):
            if not all(disk_ops.write_blocks(self.tier, self.namespace_id, SPEC.layer_bytes, SPEC.num_layers,
                                             items[start:start + 64])):
                raise RuntimeError("setup write failed")
        # Restores land in arena slots after both sets.
        self.restore_items = [
            (key_of(i), i, self.arena.address(count + i), self.tier.layer_checksums_of(i))
            for i in range(restore_blocks)
        ]
        self.write_generation = 0
        self.written: list[tuple[bytes, int]] = []

    def restore(self) -> int:
        """I/O thread: one restore; the number of good blocks."""
        started = time.perf_counter()
        ok = self.tier.read_blocks(self.namespace_id, SPEC.layer_bytes, SPEC.num_layers, self.restore_items,
                                   between_groups=self.between_groups)
        self.sizer.observe(True, len(self.restore_items) * self.block_bytes, time.perf_counter() - started)
        return int(ok.sum())

    def remove_written(self) -> None:
        """I/O thread: journal the removal of the write set's previous copies (eviction's REMOVEs)."""
        if self.written:
            if not all(self.tier.remove_blocks(self.namespace_id, self.written)):
                raise RuntimeError("remove failed")
            self.written = []

    def write_items(self, first: int, count: int) -> list[tuple[bytes, bytes, int, int]]:
        base = self.restore_blocks
        self.write_generation += 1
        return [(key_of(1_000_000 * self.write_generation + i), b"", base + (first + i) % self.write_blocks,
                 self.arena.address(base + (first + i) % self.write_blocks)) for i in range(count)]

    def write(self, pieces, stop) -> tuple[int, int]:
        """I/O thread: one write job, as the daemon runs one: the chunks pipelined until stop()
        says a read waits (the first at least); (chunks written, blocks made durable)."""
        started = time.perf_counter()
        done = self.tier.write_chunks(self.namespace_id, SPEC.layer_bytes, SPEC.num_layers, pieces, stop=stop)
        good = 0
        for items, ok in zip(pieces, done):
            self.written += [(item[0], item[2]) for item, kept in zip(items, ok, strict=True) if kept]
            good += sum(ok)
        self.sizer.observe(False, good * self.block_bytes, time.perf_counter() - started)
        return len(done), good

    def close(self) -> None:
        self.tier.close()
        self.arena.close()


async def run_mode(rig: Rig, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """`args.restores` back-to-back restores, with the write-back stream unless mode is 'alone'."""
    schedule_mode = "fifo" if mode == "fifo" else "slack"
    settings = DiskSettings()
    executor = ScheduledExecutor(IoSchedule(schedule_mode, write_share=settings.write_share,
                                            backlog_limit=settings.write_backlog_blocks,
                                            anticipation_s=settings.write_anticipation_ms / 1000.0))
    executor.backlog = 10**9 if mode == "slack, backlog full" else 0
    stop = asyncio.Event()
    written_blocks = 0
    sizer = rig.sizer if mode == "slack, profiled" else None
    chunks: list[int] = []

    def chunk_blocks() -> int:
        if schedule_mode == "fifo":
            return args.write_batch_blocks
        if sizer is None:
            return args.write_chunk_blocks
        return sizer.chunk_blocks(rig.block_bytes, args.write_chunk_blocks, args.write_batch_blocks)

    async def write_back() -> None:
        nonlocal written_blocks
        while not stop.is_set():
            await executor.run(IoClass.CONTROL, rig.remove_written)
            items = rig.write_items(0, args.write_batch_blocks)
            size = chunk_blocks()
            pieces = [items[start:start + size] for start in range(0, len(items), size)]
            while pieces:
                done, good = await executor.run(IoClass.WRITE, rig.write, pieces, executor.yield_to_reads,
                                                nbytes=len(pieces[0]) * rig.block_bytes)
                chunks.extend(len(piece) for piece in pieces[:done])
                written_blocks += good
                pieces = pieces[done:]

    rig.between_groups = slack_writes(rig, executor) if sizer is not None else None
    writer = None if mode == "alone" else asyncio.create_task(write_back())
    await asyncio.sleep(0.05 if writer is not None else 0)  # the stream is under way
    latencies = []
    started = time.perf_counter()
    try:
        for _ in range(args.restores):
            t0 = time.perf_counter()
            good = await executor.run(IoClass.RESTORE, rig.restore, nbytes=rig.restore_blocks * rig.block_bytes)
            latencies.append(time.perf_counter() - t0)
            if good != rig.restore_blocks:
                raise RuntimeError(f"{mode}: restore verified only {good}/{rig.restore_blocks} blocks")
        elapsed = time.perf_counter() - started
    finally:
        stop.set()
        if writer is not None:
            await writer
        executor.shutdown()
    restore_bytes = rig.restore_blocks * rig.block_bytes
    return {
        "restore_seconds": latencies,
        "restore_gib_s": [restore_bytes / s / (1 << 30) for s in latencies],
        "elapsed_seconds": elapsed,
        "write_gib_s": written_blocks * rig.block_bytes / elapsed / (1 << 30),
        "written_blocks": written_blocks,
        "schedule": {"forced_writes": executor.schedule.counters.forced_writes,
                     "deferred_writes": executor.schedule.counters.deferred_writes},
        "max_restore_wait_ms": executor.stats.by_class["restore"].max_wait_seconds * 1e3,
        "write_job_blocks": statistics.median(chunks) if chunks else 0,
        "slack_writes": executor.schedule.counters.slack_writes,
    }


def slack_writes(rig: Rig, executor: ScheduledExecutor):
    """Between a restore's layer groups, the queued writes that fit those layers' slack."""
    budgets = rig.sizer.layer_budgets(rig.restore_blocks * SPEC.block_tokens, SPEC.layer_bytes // SPEC.block_tokens,
                                      SPEC.num_layers)
    if budgets is None:
        return None

    return lambda first, stop: executor.run_within(int(budgets[first:stop].sum()))


MODES = ("alone", "fifo", "slack", "slack, backlog full", "slack, profiled")


def print_summary(summary: dict[str, Any], ratios: dict[str, Any], args: argparse.Namespace) -> None:
    restore_mib = args.restore_blocks * SPEC.block_bytes >> 20
    report(f"== restores of {args.restore_blocks} blocks ({restore_mib} MiB, 32 layers x 64 KiB) under a write-back "
           f"stream of {args.write_batch_blocks}-block batches; {args.rounds} rounds x {args.restores} restores ==")
    report(f"{'contender':<22} {'restore GiB/s':>13} {'vs alone':>8} {'p50 ms':>7} {'p99 ms':>7} "
           f"{'max wait ms':>11} {'writes GiB/s':>12} {'write job':>9}")
    for mode in MODES:
        s = summary[mode]
        report(f"{mode:<22} {s['restore_median_gib_s']:>13.2f} {fmt_ratio(ratios.get(mode, 1.0)):>8} "
               f"{s['restore_p50_ms']:>7.0f} {s['restore_p99_ms']:>7.0f} {s['max_restore_wait_ms']:>11.1f} "
               f"{s['write_gib_s']:>12.2f} {s['write_job_blocks']:>9.0f}")
    profiled, fixed = summary["slack, profiled"], summary["slack"]
    report(f"profiled: {profiled['slack_writes']} write jobs ran inside restores, in their layers' slack")
    report(f"profiled vs fixed {args.write_chunk_blocks}-block write jobs: restore bandwidth "
           f"{fmt_ratio(ratio(profiled['restore_median_gib_s'], fixed['restore_median_gib_s']))}, restore p99 "
           f"{fmt_ratio(ratio(profiled['restore_p99_ms'], fixed['restore_p99_ms']))}, writes "
           f"{fmt_ratio(ratio(profiled['write_gib_s'], fixed['write_gib_s']))}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--restores", type=int, default=6, help="restores per contender per round")
    parser.add_argument("--restore-blocks", type=int, default=128)
    parser.add_argument("--write-batch-blocks", type=int, default=DiskSettings().write_batch_blocks)
    parser.add_argument("--write-chunk-blocks", type=int, default=DiskSettings().write_chunk_blocks)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--slack-table", type=Path, default=Path(__file__).resolve().parent / "results" / "slack_table.json",
                        help="the profiled contender's slack table (make slack-profile)")
    args = parser.parse_args()
    warn_if_busy()
    root = Path(tempfile.mkdtemp(prefix="kvd-bench-sched-", dir=args.dir))
    samples: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    try:
        progress(f"writing the restore set: {args.restore_blocks} blocks x {SPEC.block_bytes >> 20} MiB")
        rig = Rig(root, args.restore_blocks, 2 * args.write_batch_blocks, SlackTable.load(args.slack_table))
        try:
            asyncio.run(run_mode(rig, "slack", argparse.Namespace(**{**vars(args), "restores": 1})))  # warm-up
            for round_index in range(args.rounds):
                shift = round_index % len(MODES)
                for mode in MODES[shift:] + MODES[:shift]:
                    samples[mode].append(asyncio.run(run_mode(rig, mode, args)))
                progress(f"round {round_index + 1}/{args.rounds}: " + ", ".join(
                    f"{mode} {statistics.median(samples[mode][-1]['restore_gib_s']):.2f} GiB/s" for mode in MODES))
        finally:
            rig.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    summary: dict[str, Any] = {}
    for mode, runs in samples.items():
        rates = [rate for run in runs for rate in run["restore_gib_s"]]
        seconds = [s for run in runs for s in run["restore_seconds"]]
        summary[mode] = {
            "restore_median_gib_s": statistics.median(rates),
            "restore_p50_ms": percentile(seconds, 0.5) * 1e3,
            "restore_p99_ms": percentile(seconds, 0.99) * 1e3,
            "write_gib_s": statistics.median(run["write_gib_s"] for run in runs),
            "max_restore_wait_ms": max(run["max_restore_wait_ms"] for run in runs),
            "forced_writes": sum(run["schedule"]["forced_writes"] for run in runs),
            "write_job_blocks": statistics.median(run["write_job_blocks"] for run in runs),
            "slack_writes": sum(run["slack_writes"] for run in runs),
        }
    alone = summary["alone"]["restore_median_gib_s"]
    ratios = {mode: ratio(summary[mode]["restore_median_gib_s"], alone) for mode in MODES if mode != "alone"}
    print_summary(summary, ratios, args)
    passed = ratios["slack"] is not None and ratios["slack"] >= TARGET
    report("")
    report(f"target: restores under write load with the scheduler >= {TARGET}x reads alone: "
           f"{fmt_ratio(ratios['slack'])} {'PASS' if passed else 'FAIL'} (fifo: {fmt_ratio(ratios['fifo'])})")
    write_result("bench_io_scheduler", {
        "parameters": vars(args),
        "summary": summary,
        "ratios_vs_alone": ratios,
        "samples": samples,
        "target": f"slack restore bandwidth under write-back >= {TARGET}x reads alone",
        "pass": passed,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
