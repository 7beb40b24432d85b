#!/usr/bin/env python3
"""How long the event loop is blocked per request, at 10k, 100k and 1M blocks held (issue 35 item 7).

The daemon runs every engine call on its event loop, between awaits, so the
loop is blocked for as long as the synchronous part of a request takes.
That must not grow with the number of blocks held. This benchmark drives
the real core code (kvd.core.engine.Engine with a host and a disk tier,
kvd.core.mover.Mover, kvd.core.durable.DurableWaits, and the daemon's own
EventSnapshot handler) the way the daemon's loop drives it, with the fake
slot contents of the simulator (kvd.sim.plane.SlotContents) standing in
for the bytes, so nothing but bookkeeping is timed and no I/O happens.

At each size N (blocks held) it builds the state of a daemon that has run
a while, then times single operations with time.perf_counter_ns (and,
beside it, time.thread_time_ns: CPU time, which other processes on the
machine do not inflate):

* the disk is full: N blocks of chains of --chain blocks, each durable on
  disk (disk slots: exactly N), written in rounds through the real
  Mover as the fill Puts them (the fill's rounds are large: 4096 blocks);
* host memory holds N * --host-share slots, at its low watermark; a
  backlog of N * --host-share * --backlog-share blocks Put since is not
  written yet (the write queue), and a tenant namespace (host quota:
  --tenant-share of host memory) is at its quota.

Each operation counts the engine calls of one request, summed over its
loop steps (the I/O between them is not counted):

  get          begin_get of the first --get-blocks keys of a random chain
               that has that many stored (mostly on disk only: they are
               given host slots, evicting if needed),
               finish_loads, the removals taken and confirmed, settle_get,
               release of the read lease
  put          reserve + commit of a new chain of --put-blocks blocks
  put_tenant   the same in the tenant namespace at its host quota
               (reserve evicts its own blocks: make_quota_room)
  delete       engine.delete of a stored chain's last 4 blocks (by the
               first of them), the removals taken and confirmed
  writer_turn  a turn of the disk writer with a round: next_round (reclaim,
               pick_writes: disk slots by CLOCK eviction, the disk being
               full), backlog, hopeless_waits (DurableWaits.unwritable),
               round_removals_journalled, chunks, chunk_written per chunk,
               finish_round; run whenever the write queue is at least the
               backlog, so it stays about that long
  durable      DurableWaits.start (MakeDurable) on the oldest chain not yet
               written, at most --waiters calls waiting at once (answered
               by the writer's next rounds)
  snapshot     EventSnapshot of the main namespace, the service's own
               handler, stepped as the loop steps it: its longest step
               (a step ends at each message it sends)

Operations are interleaved round-robin, each until it has --samples
samples (snapshot: --snapshot-samples) or has used --op-seconds of timed
time at that size, so a slow operation at 1M gets fewer samples (its p99 is
then close to its maximum). The report gives p50/p99/max per operation
and size (wall), and the ratio of the largest size's p99 to the smallest's,
against the target of issue 35: within 1.5x (the verdict, on wall time;
the same ratio in CPU time, and of the slowest calls' CPU times, beside
it). Where each operation's slowest 1% went is printed per engine call.
When a target is missed (or an operation passes while its slowest call
grew more than 3x), the operation is profiled at the largest size
(cProfile, each call on its own: the top functions of its slowest calls,
by own and by cumulative time), printed and stored.

Python's cyclic garbage collector runs as in the daemon (which does not tune
it); a timed operation during which a full (generation 2) collection ran is
counted in `gc_full_in_samples`.

Run:  .venv/bin/python bench/bench_loop_time.py [--sizes 10000 100000 1000000] [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, RESULTS_DIR, percentile, progress, report, warn_if_busy, write_result  # noqa: E402
from _loop_rig import OPERATION_CALLS, OPERATIONS, Rig, Stopwatch  # noqa: E402

from kvd.core.mover import WRITE_MODES  # noqa: E402

TARGET_RATIO = 1.5
# A passing operation whose slowest call grew more than this is pointed out (see print_tables).
RARE_STEP_RATIO = 3.0
PROFILE_CALLS = 1000
PROFILE_SLOWEST = 3


# -- measuring ------------------------------------------------------------------------


class GcWatch:
    """Counts full (generation 2) collections, to flag the samples that ran one."""

    def __init__(self) -> None:
        self.full = 0
        self.full_ns = 0
        self._started = 0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter_ns()
        else:
            self.full += 1
            self.full_ns += time.perf_counter_ns() - self._started

    def close(self) -> None:
        gc.callbacks.remove(self._callback)


def _wanted(name: str, args: argparse.Namespace) -> int:
    return args.snapshot_samples if name == "snapshot" else args.samples


# The writer's turns and the durable waits live on the Puts' backlog: Puts go on
# (timed, not recorded) until they are done too. An operation that could not
# run this many turns in a row is given up (say, no chain long enough to Delete).
FED_BY_PUTS = ("writer_turn", "durable")
MAX_SKIPS_IN_A_ROW = 5000


@dataclass
class Tally:
    samples: dict[str, list[int]] = field(default_factory=lambda: {name: [] for name in OPERATIONS})
    cpu: dict[str, list[int]] = field(default_factory=lambda: {name: [] for name in OPERATIONS})
    parts: dict[str, list[dict[str, int]]] = field(default_factory=lambda: {name: [] for name in OPERATIONS})
    spent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPERATIONS, 0))
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPERATIONS, 0))
    skips_in_a_row: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPERATIONS, 0))
    in_gc: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPERATIONS, 0))

    def done(self, name: str, args: argparse.Namespace) -> bool:
        return (len(self.samples[name]) >= _wanted(name, args) or self.spent[name] >= args.op_seconds * 1e9
                or self.skips_in_a_row[name] >= MAX_SKIPS_IN_A_ROW)

    def record(self, name: str, result: Stopwatch | None, in_gc: bool, args: argparse.Namespace) -> None:
        if result is None:
            self.skipped[name] += 1
            self.skips_in_a_row[name] += 1
            return
        self.skips_in_a_row[name] = 0
        if not self.done(name, args):
            self.samples[name].append(result.wall_ns)
            self.cpu[name].append(result.cpu_ns)
            self.parts[name].append(result.parts)
            self.spent[name] += result.wall_ns
            self.in_gc[name] += in_gc


def measure(rig: Rig, args: argparse.Namespace) -> dict[str, dict]:
    """Round-robin over the operations until each has its samples or used its time."""
    tally = Tally()
    active = list(OPERATIONS)
    watch = GcWatch()
    started = last = time.perf_counter()
    try:
        while active and time.perf_counter() - started < args.size_seconds:
            for name in active:
                collections = watch.full
                result = OPERATION_CALLS[name](rig)
                tally.record(name, result, watch.full != collections, args)
            active = [name for name in OPERATIONS if not tally.done(name, args)
                      or (name == "put" and any(not tally.done(fed, args) for fed in FED_BY_PUTS))]
            if time.perf_counter() - last > 10:
                last = time.perf_counter()
                progress("  " + ", ".join(f"{name} {len(tally.samples[name])}" for name in OPERATIONS))
    finally:
        watch.close()
    rig.engine.verify()
    rig.mover.verify()
    return {name: {"wall_ns": tally.samples[name], "cpu_ns": tally.cpu[name], "parts": tally.parts[name],
                   "skipped": tally.skipped[name],
                   "gc_full_in_samples": tally.in_gc[name], "gc_full_total": watch.full,
                   "gc_full_ms_total": watch.full_ns / 1e6} for name in OPERATIONS}


def tail_parts(entry: dict) -> dict[str, float]:
    """Where the samples at or above the p99 went: mean wall ms per engine call, largest first."""
    samples = entry["wall_ns"]
    if not samples:
        return {}
    edge = percentile(samples, 0.99)
    tail = [parts for wall, parts in zip(samples, entry["parts"]) if wall >= edge]
    totals: dict[str, float] = {}
    for parts in tail:
        for name, spent in parts.items():
            totals[name] = totals.get(name, 0.0) + spent / 1e6 / len(tail)
    return dict(sorted(totals.items(), key=lambda item: item[1], reverse=True))


def slim(entry: dict) -> None:
    """What the JSON keeps of the raw samples once summarized: wall time per call in whole
    microseconds, in call order (the CPU times and per-call breakdowns only as summaries)."""
    entry["wall_us"] = [round(value / 1e3) for value in entry.pop("wall_ns")]
    del entry["cpu_ns"], entry["parts"]


def summarize(samples_ns: list[int]) -> dict:
    if not samples_ns:
        return {"calls": 0}
    seconds = [value / 1e9 for value in samples_ns]
    return {"calls": len(seconds), "p50_ms": percentile(seconds, 0.5) * 1e3, "p99_ms": percentile(seconds, 0.99) * 1e3,
            "max_ms": max(seconds) * 1e3, "mean_ms": sum(seconds) / len(seconds) * 1e3}


def run_size(blocks: int, args: argparse.Namespace) -> tuple[Rig, dict]:
    progress(f"N={blocks:,}: filling (host {int(blocks * args.host_share):,} slots, disk {blocks:,} slots)")
    rig = Rig(blocks, args)
    fill = rig.fill()
    state = rig.state()
    progress(f"N={blocks:,}: filled in {fill['seconds']:.1f} s: {state['blocks_indexed']:,} blocks indexed, "
             f"{state['host_resident']:,} in host memory, {state['write_queue']:,} waiting for write-back")
    measured = measure(rig, args)
    for name, entry in measured.items():
        entry["summary"] = summarize(entry["wall_ns"])
        entry["cpu_summary"] = summarize(entry["cpu_ns"])
        entry["tail_parts_ms"] = tail_parts(entry)
        slim(entry)
    progress(f"N={blocks:,}: measured " + ", ".join(
        f"{name} p99 {entry['summary'].get('p99_ms', float('nan')):.3f} ms" for name, entry in measured.items()))
    return rig, {"blocks": blocks, "fill": fill, "state_before": state, "state_after": rig.state(),
                 "durable_waits": {"answered": rig.waits.answered, "failed": rig.waits.failed},
                 "operations": measured}


# -- profiles of the operations that miss ------------------------------------------------


def _site(key: tuple[str, int, str]) -> str:
    filename, line, function = key
    path = Path(filename)
    if path.is_absolute() and REPO_ROOT in path.parents:
        filename = path.relative_to(REPO_ROOT).as_posix()
    return f"{filename}:{line}({function})"


def _listed(profiles: list[cProfile.Profile], top: int) -> dict:
    """The top functions of these profiles together, by own and by cumulative time."""
    if not profiles:
        return {"by_own_time": [], "by_cumulative_time": []}
    stats = pstats.Stats(profiles[0])
    stats.add(*profiles[1:])
    rows = [(_site(key), value[2], value[3], value[1]) for key, value in stats.stats.items()]  # type: ignore[attr-defined]

    def listed(column: int) -> list[dict]:
        ordered = sorted(rows, key=lambda row: row[column], reverse=True)[:top]
        return [{"site": site, "own_s": own, "cumulative_s": cumulative, "calls": count}
                for site, own, cumulative, count in ordered]

    return {"by_own_time": listed(1), "by_cumulative_time": listed(2)}


def profile_operation(rig: Rig, name: str, seconds: float, top: int = 12) -> dict:
    """Calls of the operation, each under its own cProfile: the top functions of all of them, and of
    the slowest few (where a p99 goes when it is not where the mean goes)."""
    profiled: list[tuple[int, cProfile.Profile]] = []
    started = time.perf_counter()
    while len(profiled) < PROFILE_CALLS and time.perf_counter() - started < seconds:
        # In rotation with the operations that feed it (Puts fill the backlog, turns answer waits), unprofiled.
        for other in OPERATIONS:
            if other == name:
                profiler = cProfile.Profile()
                profiler.enable()
                ran = OPERATION_CALLS[name](rig)
                profiler.disable()
                if ran is not None:
                    profiled.append((ran.wall_ns, profiler))
            elif other in ("put", *FED_BY_PUTS):
                OPERATION_CALLS[other](rig)
    profiled.sort(key=lambda pair: pair[0], reverse=True)
    slowest = profiled[:PROFILE_SLOWEST]
    return {"calls": len(profiled), "slowest_calls_ms": [wall / 1e6 for wall, _ in slowest],
            "all": _listed([profiler for _, profiler in profiled], top),
            "slowest": _listed([profiler for _, profiler in slowest], top)}


def print_profile(name: str, profile: dict, blocks: int) -> None:
    slowest = ", ".join(f"{value:.1f}" for value in profile["slowest_calls_ms"])
    report(f"-- profile of {name} at N={blocks:,}: {profile['calls']} calls; the {len(profile['slowest_calls_ms'])} "
           f"slowest ({slowest} ms under the profiler) --")
    for title, key in (("own time", "by_own_time"), ("cumulative time", "by_cumulative_time")):
        report(f"   the slowest calls, by {title}:")
        for row in profile["slowest"][key][:10]:
            report(f"     {row['own_s'] if key == 'by_own_time' else row['cumulative_s']:8.3f} s  "
                   f"{row['calls']:>9,} calls  {row['site']}")


def print_tails(results: list[dict], names: list[str]) -> None:
    """Where the slowest 1% of each operation's samples went, per engine call, at the largest size."""
    largest = results[-1]
    report(f"the slowest 1% of samples at N={largest['blocks']:,}, mean wall ms per engine call:")
    for name in names:
        parts = largest["operations"][name]["tail_parts_ms"]
        report(f"  {name:<12} " + ", ".join(f"{call} {spent:.2f}" for call, spent in list(parts.items())[:5]))


# -- the report --------------------------------------------------------------------------


def _p99_ratio(results: list[dict], name: str, summary: str, figure: str = "p99_ms") -> float | None:
    low = results[0]["operations"][name][summary].get(figure)
    high = results[-1]["operations"][name][summary].get(figure)
    return high / low if low and high is not None else None


def ratios(results: list[dict]) -> dict[str, dict]:
    """Per operation: the largest size's p99 over the smallest's, wall (the verdict) and CPU time."""
    verdicts = {}
    for name in OPERATIONS:
        wall, cpu = _p99_ratio(results, name, "summary"), _p99_ratio(results, name, "cpu_summary")
        verdicts[name] = {"p99_ratio": wall, "cpu_p99_ratio": cpu, "cpu_max_ratio": _p99_ratio(results, name, "cpu_summary", "max_ms"),
                          "pass": wall is not None and wall <= TARGET_RATIO}
    return verdicts


def _suspect(verdict: dict) -> bool:
    growth = verdict["cpu_max_ratio"]
    return not verdict["pass"] or (growth is not None and growth > RARE_STEP_RATIO)


def _cell(summary: dict) -> str:
    if not summary["calls"]:
        return "not run"
    return f"{summary['p50_ms']:.3f} / {summary['p99_ms']:.3f} / {summary['max_ms']:.2f}; {summary['calls']}"


def _ratio(value: float | None) -> str:
    return f"{value:8.1f}x" if value is not None else f"{'n/a':>9}"


def print_tables(results: list[dict], verdicts: dict[str, dict]) -> None:
    sizes = [result["blocks"] for result in results]
    report("wall time the loop is blocked per operation, ms (p50 / p99 / max; samples)")
    report(f"{'operation':<12}" + "".join(f"{f'N={size:,}':>34}" for size in sizes))
    for name in OPERATIONS:
        report(f"{name:<12}" + "".join(f"{_cell(result['operations'][name]['summary']):>34}" for result in results))
    report("")
    report(f"p99, ms: wall / CPU time of this thread, and {sizes[-1]:,} / {sizes[0]:,} of each against the "
           f"target of {TARGET_RATIO}x (the verdict: wall; cpu max: the ratio of the slowest calls' CPU times, for information)")
    report(f"{'operation':<12}" + "".join(f"{f'{size:,}':>20}" for size in sizes)
           + f"{'wall':>9}{'cpu':>9}{'cpu max':>9}  verdict")
    for name in OPERATIONS:
        cells = []
        for result in results:
            wall = result["operations"][name]["summary"].get("p99_ms")
            cpu = result["operations"][name]["cpu_summary"].get("p99_ms")
            cells.append(f"{wall:.3f} / {cpu:.3f}" if wall is not None else "-")
        verdict = verdicts[name]
        report(f"{name:<12}" + "".join(f"{cell:>20}" for cell in cells) + _ratio(verdict["p99_ratio"])
               + _ratio(verdict["cpu_p99_ratio"]) + _ratio(verdict["cpu_max_ratio"])
               + f"  {'PASS' if verdict['pass'] else 'FAIL'}")
    for name in OPERATIONS:
        growth = verdicts[name]["cpu_max_ratio"]
        if verdicts[name]["pass"] and _suspect(verdicts[name]):
            report(f"note: {name} passes on its p99, but its slowest call grew {growth:.0f}x (CPU time): a step "
                   "that grows with the blocks held but comes rarer than 1 call in 100 at the largest size")


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress("matplotlib is not installed: no plot")
        return False
    sizes = [result["blocks"] for result in results]
    figure, (p99_axes, max_axes) = plt.subplots(1, 2, figsize=(13, 5))
    for axes, summary, figure_name, label in (
            (p99_axes, "summary", "p99_ms", "p99 loop time per operation, wall (ms)"),
            (max_axes, "cpu_summary", "max_ms", "slowest call, CPU time (ms)")):
        for name in OPERATIONS:
            values = [result["operations"][name][summary].get(figure_name) for result in results]
            axes.plot(sizes, values, marker="o", label=name)
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("blocks held")
        axes.set_ylabel(label)
        axes.grid(True, which="both", alpha=0.3)
    p99_axes.set_title(f"p99 (target: largest within {TARGET_RATIO}x of smallest)")
    max_axes.set_title("the slowest call (rare steps the p99 can miss)")
    p99_axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    progress(f"wrote {path.relative_to(REPO_ROOT)}")
    return True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000],
                        help="blocks held (the disk's slots), smallest first")
    parser.add_argument("--quick", action="store_true", help="a smoke run: sizes 2000 20000, fewer samples")
    parser.add_argument("--chain", type=int, default=32, help="blocks per chain of the fill")
    parser.add_argument("--put-blocks", type=int, default=16, help="blocks per timed Put")
    parser.add_argument("--get-blocks", type=int, default=16, help="blocks per timed Get (a stored chain's first)")
    parser.add_argument("--host-share", type=float, default=0.125, help="host slots per block held")
    parser.add_argument("--backlog-share", type=float, default=0.4,
                        help="host slots' share waiting for write-back (the write queue's level)")
    parser.add_argument("--tenant-share", type=float, default=0.1, help="the tenant's host quota, share of host slots")
    parser.add_argument("--write-mode", choices=WRITE_MODES, default="through",
                        help="the writer's mode while measured (through: every turn writes a round)")
    parser.add_argument("--waiters", type=int, default=4, help="MakeDurable calls waiting at once, at most")
    parser.add_argument("--samples", type=int, default=1000, help="timed calls per operation and size, at most")
    parser.add_argument("--snapshot-samples", type=int, default=20)
    parser.add_argument("--op-seconds", type=float, default=20.0, help="timed seconds per operation and size, at most")
    parser.add_argument("--size-seconds", type=float, default=240.0, help="wall seconds of measuring per size, at most")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="profile every operation at the largest size")
    parser.add_argument("--profile-seconds", type=float, default=30.0,
                        help="seconds of profiled calls per operation (long enough at 1M for a pass of the CLOCK hand)")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes = [2000, 20_000] if args.sizes == parser.get_default("sizes") else args.sizes
        args.samples, args.snapshot_samples, args.op_seconds, args.profile_seconds = 200, 5, 3.0, 3.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warn_if_busy()
    sizes = sorted(args.sizes)
    report(f"== bench_loop_time: event-loop time per request at {', '.join(f'{size:,}' for size in sizes)} "
           "blocks held ==")
    results, rig = [], None
    for blocks in sizes:
        rig = None  # the previous size's engine goes before the next is built
        rig, result = run_size(blocks, args)
        results.append(result)
    verdicts = ratios(results)
    print_tables(results, verdicts)
    overall = all(verdict["pass"] for verdict in verdicts.values())
    missed = [name for name in OPERATIONS if not verdicts[name]["pass"]]
    profiles = {}
    print_tails(results, list(OPERATIONS))
    # Profiled: what missed, and what passed with a slowest call that grew (its rare step is in the profile).
    for name in OPERATIONS if args.profile else [name for name in OPERATIONS if _suspect(verdicts[name])]:
        progress(f"profiling {name} at N={sizes[-1]:,}")
        profiles[name] = profile_operation(rig, name, args.profile_seconds)
        print_profile(name, profiles[name], sizes[-1])
    plotted = plot(results, RESULTS_DIR / "loop_time.png")
    write_result("bench_loop_time", {
        "target": {"metric": "p99 loop time per operation, largest size / smallest", "max_ratio": TARGET_RATIO},
        "pass": overall,
        "command": [sys.executable, *sys.argv],
        "settings": vars(args),
        "results": verdicts,
        "sizes": results,
        "profiles": profiles,
        "plot": "bench/results/loop_time.png" if plotted else None,
        "note": "engine calls only (the fake slot contents stand in for the I/O, untimed); one process, "
                "no gRPC; cyclic GC as in the daemon",
    })
    report(f"overall: {'PASS' if overall else 'FAIL'}" + (f" (missed: {', '.join(missed)})" if not overall else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
