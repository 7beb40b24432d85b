"""The decode-phase simulation (kvd.sim.decode), the short version of `make planner-sim`: every
policy runs a pressured workload to its end within the GPU budget (checked every step), and kvd's
planner is compared with the baselines on the same requests."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvd.sim.decode import DeepSpeed, Heuristic, Setup, Uniform, policies, run, simulate, summarize, workload

SETUP = Setup()
RATE, COUNT, SEED = 6.0, 60, 3
SLO_S = 1.5 * SETUP.reference_step_s()


@pytest.fixture(scope="module")
def runs():
    """Every policy on the same pressured workload: {name: (policy, finished requests)}."""
    return {policy.name: (policy, simulate(SETUP, workload(SETUP, RATE, COUNT, SEED), policy, SEED))
            for policy in policies(SETUP, SLO_S)}


def test_every_policy_finishes_every_request_with_one_gap_per_token(runs):
    for name, (_, done) in runs.items():
        assert sorted(r.rid for r in done) == list(range(COUNT)), name
        assert all(r.produced == r.output for r in done)
        assert all(len(r.tbts) == r.produced - 1 for r in done)
        assert all(t > 0 for r in done for t in r.tbts)


def test_the_workload_presses_the_gpu_budget(runs):
    """Offloading must matter here, else the comparison says nothing: the planner offloads."""
    planner, _ = runs["kvd"]
    assert planner.plans > 10 and planner.offloading_plans > 0


def test_the_planner_attains_the_slo_more_often_than_every_baseline(runs):
    mine = {name: summarize(done, SLO_S) for name, (_, done) in runs.items()}
    for baseline in ("deepspeed", "flexgen", "flexgen+", "heuristic"):
        assert mine["kvd"]["tpot_attainment"] > mine[baseline]["tpot_attainment"], (baseline, mine)
        assert mine["kvd"]["throughput_tok_s"] > mine[baseline]["throughput_tok_s"], (baseline, mine)
    assert mine["kvd"]["p99_tbt_ms"] < mine["deepspeed"]["p99_tbt_ms"]


def test_run_judges_each_baseline_run_against_every_slo_scale():
    rows = run(SETUP, [2.0], [1.5, 3.0], 12, SEED)
    assert [(row["slo_scale"], row["policy"]) for row in rows] == [
        (scale, name) for scale in (1.5, 3.0)
        for name in ("deepspeed", "flexgen", "flexgen+", "heuristic", "kvd (no deposit)", "kvd")]
    strict = {row["policy"]: row for row in rows if row["slo_scale"] == 1.5}
    loose = {row["policy"]: row for row in rows if row["slo_scale"] == 3.0}
    assert all(loose[name]["tbt_attainment"] >= strict[name]["tbt_attainment"] for name in strict
               if not name.startswith("kvd"))


def test_a_request_too_large_for_the_gpu_stops_the_simulation_by_name():
    tiny = replace(SETUP, budget_bytes=1 << 20)
    with pytest.raises(RuntimeError, match="does not fit the GPU budget"):
        simulate(tiny, workload(tiny, RATE, 5, SEED), Heuristic(tiny), SEED)


def test_summaries_count_what_met_the_slo():
    done = simulate(SETUP, workload(SETUP, 1.0, 10, SEED), Uniform(SETUP, adaptive=True), SEED)
    generous, strict = summarize(done, 10.0), summarize(done, 1e-6)
    assert generous["tpot_attainment"] == generous["tbt_attainment"] == 1.0
    assert strict["tpot_attainment"] == strict["tbt_attainment"] == 0.0
    assert DeepSpeed(SETUP).name == "deepspeed"


def test_rows_over_several_workloads_are_the_means_of_each_with_the_spread():
    one, two = (run(SETUP, [2.0], [2.0], 12, seed) for seed in (SEED, SEED + 1))
    both = run(SETUP, [2.0], [2.0], 12, SEED, seeds=2)
    for first, second, mean in zip(one, two, both):
        assert first["policy"] == second["policy"] == mean["policy"] and mean["runs"] == 2
        for key in ("tpot_attainment", "tbt_attainment", "p99_tbt_ms", "throughput_tok_s"):
            assert mean[key] == pytest.approx((first[key] + second[key]) / 2)
        assert mean["tpot_attainment_min"] == min(first["tpot_attainment"], second["tpot_attainment"])
        assert mean["tpot_attainment_max"] == max(first["tpot_attainment"], second["tpot_attainment"])
