#!/usr/bin/env python3
"""How long the placement planner takes, and what the pruned search space costs in step latency.

Planning time (issue 16's target: 16 requests x 32 layers in at most 1 ms at p99): `--batches`
random decode batches per budget, each planned by kvd.planner.search.branch_and_bound (native
code, called from Python as a caller would), timed one call at a time. A batch is 16 requests with
ShareGPT-like context lengths (log-normal, median 600 tokens, 64 to 8,192), Llama-3-8B-shaped KV
(bf16, 8 KV heads x 128 dims: 4 KiB per token per layer), per-layer compute that grows with the
batch's tokens (OrbitFlow's linear fit: 150 us + 5 ns per token), and a 25 GB/s host-to-GPU link.
Budgets are shares of what the batch takes with every layer on the GPU: 1.0 (all fits), 0.9, 0.75
and 0.6 (close to the most the pruned space can free, about half). Printed per budget: p50/p99/max
planning time, the p99's ratio to the 1 ms target, placements explored, and how many searches
finished (exact) within the node limit.

Pruning (`--gap-batches` small batches, 4 requests x 8 layers, exhaustive both ways): the pruned
space keeps, per count of offloaded layers, only the largest distance; the best step latency over
it against the best over every distance 1..L-1, as a ratio (1.0: pruning lost nothing).

Run: .venv/bin/python bench/bench_planner.py [--batches 500] [--gap-batches 300]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import percentile, progress, report, warn_if_busy, write_result  # noqa: E402

from kvd.planner.distance import NONE  # noqa: E402
from kvd.planner.latency import Batch, gpu_bytes, step_latency  # noqa: E402
from kvd.planner.search import DEFAULT_MAX_NODES, branch_and_bound, exhaustive  # noqa: E402

TARGET_P99_S = 1e-3
TOKEN_BYTES = 4096             # one token's K and V in one layer
LINK_BPS = 25e9
SHARES = (1.0, 0.9, 0.75, 0.6)


def decode_batch(rng: np.random.Generator, requests: int, layers: int) -> Batch:
    tokens = np.clip(rng.lognormal(np.log(600), 1.0, requests), 64, 8192).astype(int)
    per_layer_s = 150e-6 + 5e-9 * int(tokens.sum())
    compute = tuple(float(per_layer_s * factor) for factor in rng.uniform(0.9, 1.1, layers))
    return Batch(compute, tuple(int(t) * TOKEN_BYTES for t in tokens), LINK_BPS)


def all_on_gpu(batch: Batch) -> int:
    return gpu_bytes(batch, [NONE] * len(batch.kv_bytes))


def time_plans(rng: np.random.Generator, count: int, share: float, max_nodes: int, long_nodes: int,
               long_every: int) -> dict:
    """Plans `count` batches at `share` of their bytes with max_nodes; every long_every-th batch is
    also planned with long_nodes, to see what the short search left on the table."""
    seconds, explored, gaps, behind, exact, infeasible = [], [], [], [], 0, 0
    for index in range(count):
        batch = decode_batch(rng, 16, 32)
        budget = int(all_on_gpu(batch) * share)
        started = time.perf_counter()
        placement = branch_and_bound(batch, budget, max_nodes=max_nodes)
        seconds.append(time.perf_counter() - started)
        if placement is None:
            infeasible += 1
            continue
        explored.append(placement.explored)
        exact += placement.exact
        gaps.append(placement.latency_s / placement.bound_s - 1)
        if index % long_every == 0:
            longer = branch_and_bound(batch, budget, max_nodes=long_nodes)
            behind.append(placement.latency_s / longer.latency_s - 1)
    p99 = percentile(seconds, 0.99)
    return {"share": share, "batches": count, "p50_ms": percentile(seconds, 0.5) * 1e3, "p99_ms": p99 * 1e3,
            "max_ms": max(seconds) * 1e3, "p99_vs_target": p99 / TARGET_P99_S,
            "explored_p50": percentile(explored, 0.5) if explored else 0,
            "exact": exact, "infeasible": infeasible,
            "gap_to_bound_p50": percentile(gaps, 0.5) if gaps else 0.0,
            "gap_to_bound_p99": percentile(gaps, 0.99) if gaps else 0.0,
            "behind_long_search_p50": percentile(behind, 0.5) if behind else 0.0,
            "behind_long_search_max": max(behind) if behind else 0.0, "long_searches": len(behind)}


def every_distance(batch: Batch, budget: int) -> float | None:
    """The best step latency over every distance (1..L-1, and none), exhaustively."""
    options = (NONE, *range(1, batch.layers))
    best = None
    for distances in itertools.product(options, repeat=len(batch.kv_bytes)):
        if gpu_bytes(batch, distances) <= budget:
            latency = step_latency(batch, distances)
            best = latency if best is None else min(best, latency)
    return best


def pruning_gap(rng: np.random.Generator, count: int) -> dict:
    ratios = []
    for index in range(count):
        batch = decode_batch(rng, 4, 8)
        budget = int(all_on_gpu(batch) * rng.uniform(0.55, 1.0))
        pruned, full = exhaustive(batch, budget), every_distance(batch, budget)
        if pruned is not None and full is not None:
            ratios.append(pruned.latency_s / full)
        if (index + 1) % 50 == 0:
            progress(f"pruning gap: {index + 1}/{count} batches")
    lost = [r for r in ratios if r > 1 + 1e-12]
    return {"batches": len(ratios), "mean_ratio": statistics.fmean(ratios) if ratios else None,
            "max_ratio": max(ratios) if ratios else None, "batches_worse": len(lost)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=500)
    parser.add_argument("--gap-batches", type=int, default=300)
    parser.add_argument("--max-nodes", type=int, default=DEFAULT_MAX_NODES, help="the search's node limit per plan (the "
                        "daemon's default)")
    parser.add_argument("--long-nodes", type=int, default=100_000, help="the node limit of the comparison search")
    parser.add_argument("--long-every", type=int, default=10, help="compare every n-th batch with a long search")
    parser.add_argument("--seed", type=int, default=16)
    args = parser.parse_args()
    warn_if_busy()
    rng = np.random.default_rng(args.seed)
    branch_and_bound(decode_batch(rng, 16, 32), 1 << 40)  # load the native module before timing
    timing = []
    for share in SHARES:
        progress(f"planning {args.batches} batches of 16 requests x 32 layers at {share:.0%} of their bytes")
        timing.append(time_plans(rng, args.batches, share, args.max_nodes, args.long_nodes, args.long_every))
    gap = pruning_gap(rng, args.gap_batches)
    report(f"\nplanning 16 requests x 32 layers (native branch and bound, at most {args.max_nodes} placements "
           "evaluated, one call at a time):")
    report(f"  {'budget':>7} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} {'p99/1ms':>8} {'nodes':>6} {'exact':>6} "
           f"{'gap p50':>8} {'gap p99':>8} {'vs long p50':>12} {'vs long max':>12}")
    for row in timing:
        report(f"  {row['share']:>7.0%} {row['p50_ms']:>8.3f} {row['p99_ms']:>8.3f} {row['max_ms']:>8.3f} "
               f"{row['p99_vs_target']:>7.2f}x {row['explored_p50']:>6.0f} {row['exact']:>6} "
               f"{row['gap_to_bound_p50']:>8.2%} {row['gap_to_bound_p99']:>8.2%} "
               f"{row['behind_long_search_p50']:>12.2%} {row['behind_long_search_max']:>12.2%}")
    met = all(row["p99_vs_target"] <= 1.0 for row in timing)
    proven = all(row["exact"] == row["batches"] - row["infeasible"] for row in timing)
    report(f"  target p99 <= 1 ms at every budget: {'met' if met else 'MISSED'}; every answer proven best: "
           f"{'yes' if proven else 'NO'}")
    report("  gap: the answer's latency over the search's lower bound (an upper bound on how far from the best);")
    report(f"  vs long: over the answer of a {args.long_nodes}-placement search of the same batch "
           f"(every {args.long_every}th batch)")
    report(f"\npruned distances vs every distance (4 requests x 8 layers, {gap['batches']} batches): "
           f"mean {gap['mean_ratio']:.4f}x, worst {gap['max_ratio']:.4f}x the unpruned optimum's latency, "
           f"worse in {gap['batches_worse']}")
    write_result("bench_planner", {"parameters": vars(args), "target_p99_ms": TARGET_P99_S * 1e3,
                                   "planning": timing, "target_met": met, "all_exact": proven,
                                   "pruning_gap": gap})


if __name__ == "__main__":
    main()
