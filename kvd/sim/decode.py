"""Decode-phase simulation: kvd's placement planner against the baselines of OrbitFlow's evaluation.

    python -m kvd.sim.decode [--rates 1,2,3,4] [--slo-scales 1.2,1.5,2] [--requests 300]
                             [--seeds 3] [--json F] [--plot F.png]

The system: one GPU whose KV budget cannot hold every running request's KV at once, a host-to-GPU
link, and a model of L layers whose per-layer decode compute grows with the batch's context
(base_s + per_token_s x tokens, OrbitFlow's Fig. 2b). Requests arrive as a Poisson process with
ShareGPT-like prompt and output lengths (log-normal, clipped) and join the batch after a prefill
(continuous batching, at most max_batch running). Each decode step, a policy places every running
request's KV: layers kept on the GPU, layers fetched from host memory during the step (the latency
model of kvd.planner.latency, one FIFO link), or the request is paused for the step. What a step
really takes is the same model under the real compute (jittered per step) and the real link (a
share of its nominal bandwidth, drawn per step): only kvd's planner learns them, from its step
reports (kvd.planner.profile).

Policies (OrbitFlow's baselines):
- deepspeed: every layer on the host, each fetched one layer ahead (DeepSpeed-Inference);
- flexgen: one uniform offload distance chosen offline for a full batch of median requests;
- flexgen+: the uniform distance re-chosen whenever the batch changes (or outgrows the budget);
- heuristic: the largest requests offloaded step by step until the batch fits;
- kvd: kvd.planner.plan per request, re-planned at the end of its decode window, when the batch
  changes and when a step report misses the prediction; with the token deposit on or off.
Every policy pauses the largest requests when even its most frugal placement does not fit.

Reported per arrival rate and SLO scale (the TPOT SLO is the scale times a full batch's step with
everything on the GPU): TPOT SLO attainment (requests whose mean time per output token met it), TBT
attainment (tokens that came within the SLO of the previous one), P95/P99 TBT, throughput, each the
mean over `--seeds` workloads, with the least and most TPOT attainment among them: the planner's
pauses for the SLO make a run tip between regimes on small differences, so one workload says little.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from kvd.invariants import check
from kvd.planner.distance import distance_options
from kvd.planner.latency import Batch, fetch_latency, gpu_bytes
from kvd.planner.plan import Request as PlanRequest
from kvd.planner.plan import plan
from kvd.planner.profile import StepProfile
from kvd.planner.search import DEFAULT_MAX_NODES, native_step_latency


@dataclass(frozen=True)
class Setup:
    layers: int = 32
    token_bytes: int = 4096          # one token's K and V in one layer (Llama-3-8B, bf16)
    budget_bytes: int = 1 << 30      # the GPU's bytes for KV
    bandwidth_bps: float = 25e9      # nominal host-to-GPU link
    base_s: float = 150e-6           # per-layer decode compute: base_s + per_token_s x batch tokens
    per_token_s: float = 5e-9
    prefill_s_per_token: float = 20e-6
    max_batch: int = 32
    jitter: float = 0.05             # real compute = modelled x lognormal(0, jitter), per step
    link_low: float = 0.8            # the real link gives a uniform share in [link_low, 1] per step
    prompt_median: int = 600
    output_median: int = 250
    max_window: int = 32

    def compute_s(self, tokens: int) -> float:
        return self.base_s + self.per_token_s * tokens

    def reference_step_s(self) -> float:
        """A batch of 16 median requests, every layer on the GPU: the unit of the SLO scale."""
        return self.layers * self.compute_s(16 * (self.prompt_median + self.output_median // 2))


@dataclass
class Req:
    rid: int
    arrival: float
    prompt: int
    output: int
    produced: int = 0
    first: float = math.nan
    last: float = math.nan
    tbts: list[float] = field(default_factory=list)

    @property
    def context(self) -> int:
        return self.prompt + self.produced

    def kv(self, setup: Setup) -> int:
        return self.context * setup.token_bytes


def workload(setup: Setup, rate: float, count: int, seed: int) -> list[Req]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, count))
    prompts = np.clip(rng.lognormal(math.log(setup.prompt_median), 0.9, count), 32, 8192).astype(int)
    outputs = np.clip(rng.lognormal(math.log(setup.output_median), 0.8, count), 8, 2048).astype(int)
    return [Req(i, float(a), int(p), int(o)) for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]


# ---------------------------------------------------------------------------------------------
# Policies: place(running, now) -> (distances per request or fetches, paused ids)


def fits(setup: Setup, sizes: Sequence[int], distances: Sequence[int]) -> bool:
    batch = Batch((1.0,) * setup.layers, tuple(sizes), 1.0)
    return gpu_bytes(batch, distances) <= setup.budget_bytes


def pause_until_fits(setup: Setup, running: list[Req], choose) -> tuple[dict[int, int], set[int]]:
    """choose(requests) -> distances or None; pauses the largest request until something fits."""
    active = sorted(running, key=lambda r: -r.kv(setup))
    paused: set[int] = set()
    while active:
        distances = choose(active)
        if distances is not None:
            return {r.rid: d for r, d in zip(active, distances)}, paused
        paused.add(active.pop(0).rid)
    return {}, paused


class Uniform:
    """flexgen (fixed distance) and flexgen+ (re-chosen per batch)."""

    def __init__(self, setup: Setup, adaptive: bool) -> None:
        self.setup, self.adaptive = setup, adaptive
        self.options = distance_options(setup.layers)
        full = [setup.token_bytes * (setup.prompt_median + setup.output_median // 2)] * setup.max_batch
        fixed = self._least_offload(full)
        self.fixed = self.options[-1] if fixed is None else fixed  # a full batch fits nowhere: the most offloaded
        self.name = "flexgen+" if adaptive else "flexgen"

    def _least_offload(self, sizes: Sequence[int]) -> int | None:
        for distance in self.options:
            if fits(self.setup, sizes, [distance] * len(sizes)):
                return distance
        return None

    def place(self, running: list[Req], now: float):
        def choose(active):
            sizes = [r.kv(self.setup) for r in active]
            distance = self._least_offload(sizes) if self.adaptive else self.fixed
            if distance is None or not fits(self.setup, sizes, [distance] * len(sizes)):
                return None
            return [distance] * len(active)

        return pause_until_fits(self.setup, running, choose)


class Heuristic:
    """Offload the largest request one step further until the batch fits."""

    name = "heuristic"

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        self.options = distance_options(setup.layers)

    def place(self, running: list[Req], now: float):
        layers, last = self.setup.layers, len(self.options) - 1
        # GPU bytes per byte of one layer at each option (what kvd.planner.latency.gpu_bytes counts)
        kept = [gpu_bytes(Batch((1.0,) * layers, (1,), 1.0), [d]) for d in self.options]

        def choose(active):
            sizes = [r.kv(self.setup) for r in active]
            level = [0] * len(active)
            taken = sum(size * kept[0] for size in sizes)
            by_size = sorted(range(len(active)), key=lambda i: -sizes[i])
            while taken > self.setup.budget_bytes:
                movable = next((i for i in by_size if level[i] < last), None)
                if movable is None:
                    return None
                taken += sizes[movable] * (kept[level[movable] + 1] - kept[level[movable]])
                level[movable] += 1
            return [self.options[i] for i in level]

        return pause_until_fits(self.setup, running, choose)


class DeepSpeed:
    """Every layer on the host, each fetched one layer ahead; two layers per request on the GPU."""

    name = "deepspeed"

    def __init__(self, setup: Setup) -> None:
        self.setup = setup

    def place(self, running: list[Req], now: float):
        def choose(active):
            taken = sum(2 * r.kv(self.setup) for r in active)
            return [None] * len(active) if taken <= self.setup.budget_bytes else None

        return pause_until_fits(self.setup, running, choose)


class Planner:
    """kvd.planner: plans per request, re-planned on window end, batch change and mismatch."""

    def __init__(self, setup: Setup, slo_s: float, deposit: bool) -> None:
        self.setup, self.slo_s, self.deposit = setup, slo_s, deposit
        self.profile = StepProfile(setup.layers, setup.base_s, setup.per_token_s, setup.bandwidth_bps)
        self.name = "kvd" if deposit else "kvd (no deposit)"
        self.current: tuple[dict[int, int], set[int]] | None = None
        self.members: frozenset[int] = frozenset()
        self.steps_left = 0
        self.replan = True
        self.predicted = 0.0
        self.plans = 0
        self.offloading_plans = 0  # plans that keep some layer on the host

    def _deposit(self, request: Req, now: float) -> int:
        if not self.deposit or math.isnan(request.first):
            return 0
        return max(0, int(request.produced - 1 - (now - request.first) / self.slo_s))

    def place(self, running: list[Req], now: float):
        members = frozenset(r.rid for r in running)
        if self.replan or members != self.members or self.steps_left <= 0:
            self._plan(running, now)
            self.members = members
        self.steps_left -= 1
        return self.current

    def _plan(self, running: list[Req], now: float) -> None:
        setup = self.setup
        requests = [PlanRequest(r.kv(setup), self.slo_s, self._deposit(r, now), setup.token_bytes) for r in running]
        compute = self.profile.compute_s(sum(r.context for r in running))
        result = plan(requests, compute, self.profile.bandwidth_bps, setup.budget_bytes,
                      max_window=setup.max_window, max_nodes=DEFAULT_MAX_NODES)
        paused = {running[i].rid for i in result.paused}
        if not result.fits:
            paused = {r.rid for r in running}
        self.current = ({r.rid: d for r, d in zip(running, result.distances) if r.rid not in paused}, paused)
        self.steps_left = result.window_steps
        self.replan = False
        self.plans += 1
        self.offloading_plans += any(d != -1 for d in self.current[0].values())

    def observe(self, predicted: float, observed: float) -> None:
        if predicted > 0:
            self.replan = self.profile.observe(predicted, observed) or self.replan


# ---------------------------------------------------------------------------------------------
# The simulation


def step_time(setup: Setup, active: list[Req], distances: dict[int, int | None], compute_each: float,
              bandwidth: float) -> float:
    compute = (compute_each,) * setup.layers
    if distances[active[0].rid] is None:
        # deepspeed: every request asks for layer j when layer j - 1 starts; fetches asked together
        # for one layer reach the link back to back, so the batch moves as one request.
        batch = Batch(compute, (sum(r.kv(setup) for r in active),), bandwidth)
        return fetch_latency(batch, [(max(1, j - 1), j, 0) for j in range(1, setup.layers + 1)])
    batch = Batch(compute, tuple(r.kv(setup) for r in active), bandwidth)
    check(fits(setup, batch.kv_bytes, [distances[r.rid] for r in active]), "{} is over the GPU budget",
          sorted(distances.items()))
    return native_step_latency(batch, [distances[r.rid] for r in active])


def simulate(setup: Setup, requests: list[Req], policy, seed: int) -> list[Req]:
    """Runs every request to its last token under `policy`; returns them with their token times."""
    rng = np.random.default_rng(seed + 7919)
    pending = sorted(requests, key=lambda r: r.arrival)
    running: list[Req] = []
    done: list[Req] = []
    now = 0.0
    while len(done) < len(requests):
        while pending and pending[0].arrival <= now and len(running) < setup.max_batch:
            admitted = pending.pop(0)
            now += admitted.prompt * setup.prefill_s_per_token  # the batch waits for the prefill
            admitted.first = admitted.last = now
            admitted.produced = 1
            running.append(admitted)
        if not running:
            now = pending[0].arrival
            continue
        distances, paused = policy.place(running, now)
        active = [r for r in running if r.rid not in paused]
        if not active:
            raise RuntimeError(f"{policy.name} paused every request: one alone does not fit the GPU budget")
        tokens = sum(r.context for r in active)
        modelled = setup.compute_s(tokens)
        real = modelled * float(rng.lognormal(0.0, setup.jitter))
        bandwidth = setup.bandwidth_bps * float(rng.uniform(setup.link_low, 1.0))
        took = step_time(setup, active, distances, real, bandwidth)
        if isinstance(policy, Planner):
            predicted = step_time(setup, active, distances, policy.profile.compute_s(tokens)[0],
                                  policy.profile.bandwidth_bps)
            policy.observe(predicted, took)
        now += took
        for request in active:
            request.tbts.append(now - request.last)
            request.last = now
            request.produced += 1
        finished = [r for r in active if r.produced >= r.output]
        for request in finished:
            running.remove(request)
            done.append(request)
    return done


def summarize(done: list[Req], slo_s: float) -> dict:
    tbts = np.concatenate([np.asarray(r.tbts) for r in done if r.tbts]) if done else np.zeros(1)
    tpots = [np.mean(r.tbts) for r in done if r.tbts]
    span = max(r.last for r in done) - min(r.arrival for r in done)
    return {"tpot_attainment": float(np.mean([t <= slo_s for t in tpots])),
            "tbt_attainment": float(np.mean(tbts <= slo_s)),
            "p95_tbt_ms": float(np.percentile(tbts, 95) * 1e3), "p99_tbt_ms": float(np.percentile(tbts, 99) * 1e3),
            "throughput_tok_s": float(sum(r.produced for r in done) / span)}


def baselines(setup: Setup) -> list:
    return [DeepSpeed(setup), Uniform(setup, adaptive=False), Uniform(setup, adaptive=True), Heuristic(setup)]


def policies(setup: Setup, slo_s: float) -> list:
    return [*baselines(setup), Planner(setup, slo_s, deposit=False), Planner(setup, slo_s, deposit=True)]


def run(setup: Setup, rates: Sequence[float], scales: Sequence[float], count: int, seed: int,
        progress=lambda message: None, seeds: int = 1) -> list[dict]:
    """One row per (rate, SLO scale, policy), averaged over `seeds` workloads (seed, seed + 1, ...),
    with the spread of TPOT attainment across them. The baselines do not look at the SLO: each runs
    once per rate and workload, judged against every scale; kvd's planner runs per scale."""
    runs: dict[tuple[float, float, str], list[dict]] = {}
    for rate in rates:
        for workload_seed in range(seed, seed + seeds):
            for scale, name, done in _runs_at(setup, rate, scales, count, workload_seed, progress):
                for judged in (scales if scale is None else (scale,)):
                    slo_s = judged * setup.reference_step_s()
                    runs.setdefault((rate, judged, name), []).append(summarize(done, slo_s))
    rows = [{"rate": rate, "slo_scale": scale, "policy": name, **_mean(summaries)}
            for (rate, scale, name), summaries in runs.items()]
    order = {name: i for i, name in enumerate(policy.name for policy in policies(setup, 1.0))}
    return sorted(rows, key=lambda row: (row["rate"], row["slo_scale"], order[row["policy"]]))


def _runs_at(setup: Setup, rate: float, scales: Sequence[float], count: int, seed: int, progress):
    """(scale or None for every scale, policy name, finished requests) of one workload."""
    for policy in baselines(setup):
        yield None, policy.name, simulate(setup, workload(setup, rate, count, seed), policy, seed)
        progress(f"rate {rate}/s, seed {seed}: {policy.name} done")
    for scale in scales:
        for policy in policies(setup, scale * setup.reference_step_s())[4:]:
            yield scale, policy.name, simulate(setup, workload(setup, rate, count, seed), policy, seed)
            progress(f"rate {rate}/s, SLO x{scale}, seed {seed}: {policy.name} done")


def _mean(summaries: list[dict]) -> dict:
    """The summaries' means, and TPOT attainment's least and most across them."""
    attained = [summary["tpot_attainment"] for summary in summaries]
    return {**{key: float(np.mean([summary[key] for summary in summaries])) for key in summaries[0]},
            "tpot_attainment_min": min(attained), "tpot_attainment_max": max(attained), "runs": len(summaries)}


def print_table(rows: list[dict], out=sys.stdout) -> None:
    header = (f"{'rate/s':>6} {'SLO x':>6} {'policy':<17} {'TPOT att.':>9} {'(least-most)':>13} {'TBT att.':>9} "
              f"{'P95 TBT':>9} {'P99 TBT':>9} {'tok/s':>8}")
    print(header, file=out)
    for row in rows:
        spread = f"{row['tpot_attainment_min']:.0%}-{row['tpot_attainment_max']:.0%}"
        print(f"{row['rate']:>6g} {row['slo_scale']:>6g} {row['policy']:<17} {row['tpot_attainment']:>9.1%} "
              f"{spread:>13} {row['tbt_attainment']:>9.1%} {row['p95_tbt_ms']:>7.1f}ms {row['p99_tbt_ms']:>7.1f}ms "
              f"{row['throughput_tok_s']:>8.0f}", file=out)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scales = sorted({row["slo_scale"] for row in rows})
    names = list(dict.fromkeys(row["policy"] for row in rows))
    figure, axes = plt.subplots(2, len(scales), figsize=(5 * len(scales), 8), squeeze=False)
    for column, scale in enumerate(scales):
        for name in names:
            mine = [row for row in rows if row["policy"] == name and row["slo_scale"] == scale]
            rates = [row["rate"] for row in mine]
            line, = axes[0][column].plot(rates, [row["tpot_attainment"] * 100 for row in mine], marker="o",
                                         label=name)
            if any(row.get("runs", 1) > 1 for row in mine):  # the least and most of the workloads, shaded
                axes[0][column].fill_between(rates, [row["tpot_attainment_min"] * 100 for row in mine],
                                             [row["tpot_attainment_max"] * 100 for row in mine],
                                             color=line.get_color(), alpha=0.12)
            axes[1][column].plot(rates, [row["p99_tbt_ms"] for row in mine], marker="o", label=name)
        axes[0][column].set_title(f"TPOT SLO = {scale}x a full batch's step")
        axes[0][column].set_ylabel("TPOT SLO attainment (%), mean; shaded: least to most")
        axes[1][column].set_ylabel("P99 TBT (ms)")
        axes[1][column].set_xlabel("arrival rate (requests/s)")
    axes[0][0].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="1,2,3,4", help="arrival rates, requests per second")
    parser.add_argument("--slo-scales", default="1.2,1.5,2", help="TPOT SLOs in units of a full batch's step")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=1, help="workloads per point (seed, seed + 1, ...), averaged")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--plot", help="write attainment and P99 TBT against the rate here (PNG)")
    args = parser.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",")]
    scales = [float(x) for x in args.slo_scales.split(",")]
    setup = Setup()
    if args.seeds < 1:
        parser.error(f"--seeds must be 1 or more, got {args.seeds}")
    rows = run(setup, rates, scales, args.requests, args.seed,
               progress=lambda message: print(message, file=sys.stderr, flush=True), seeds=args.seeds)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"setup": setup.__dict__, "requests": args.requests, "seed": args.seed, "seeds": args.seeds,
                       "rows": rows}, out,
                      indent=1)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
