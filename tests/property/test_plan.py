"""kvd.planner.plan and kvd.planner.profile: the plan around the search (SLO with deposits, the
decode window, pause) and the profile's feedback."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.planner.distance import NONE
from kvd.planner.latency import Batch, gpu_bytes, step_latency
from kvd.planner.plan import Request, decode_window, plan
from kvd.planner.profile import StepProfile
from kvd.planner.search import branch_and_bound

requests_st = st.lists(st.builds(Request, st.integers(1, 200), st.floats(1.0, 40.0), st.integers(0, 64),
                                 st.integers(0, 5)), min_size=1, max_size=5)


@given(requests=requests_st, compute=st.lists(st.floats(0.1, 5.0), min_size=2, max_size=8),
       bandwidth=st.floats(1.0, 100.0), share=st.floats(0.2, 1.1), window=st.integers(1, 64))
@settings(max_examples=300, deadline=None)
def test_a_plan_fits_keeps_someone_running_and_pauses_only_when_it_must(requests, compute, bandwidth, share,
                                                                       window):
    budget = int(sum(r.kv_bytes for r in requests) * len(compute) * share)
    result = plan(requests, compute, bandwidth, budget, max_window=window)
    running = [r for r in range(len(requests)) if r not in result.paused]
    assert running, "a lone request is never paused"
    assert all(result.distances[r] == NONE for r in result.paused)
    if not result.fits:
        assert len(running) == 1 and result.latency_s == float("inf")
        return
    batch = Batch(tuple(compute), tuple(requests[r].kv_bytes for r in running), bandwidth)
    distances = [result.distances[r] for r in running]
    assert result.gpu_bytes == gpu_bytes(batch, distances) <= budget
    assert abs(step_latency(batch, distances) - result.latency_s) <= 1e-12 * result.latency_s
    if result.meets_slo:
        assert all(result.latency_s <= requests[r].allowed_step_s(window) for r in running)
    if len(result.paused) == 1:
        # Paused for a reason: with it back nothing fits, or (when the rest now meet their SLOs) some
        # SLO breaks; a plan that misses SLOs paused for memory only.
        back = sorted([*running, *result.paused])
        found = branch_and_bound(Batch(tuple(compute), tuple(requests[r].kv_bytes for r in back), bandwidth), budget)
        if result.meets_slo:
            assert found is None or any(found.latency_s > requests[r].allowed_step_s(window) for r in back)
        else:
            assert found is None
    # The window: the kept KV still fits after window_steps more tokens per running request.
    grown = Batch(tuple(compute), tuple(requests[r].kv_bytes + result.window_steps * requests[r].token_bytes
                                        for r in running), bandwidth)
    assert result.window_steps == 1 or gpu_bytes(grown, distances) <= budget
    assert 1 <= result.window_steps <= window


def test_the_largest_kv_weighted_by_its_deposit_pauses_first():
    compute = (1.0,) * 4
    # Three requests that cannot all fit even fully offloaded; b has the most KV, c the most deposit.
    requests = [Request(100, 10.0, 0), Request(300, 10.0, 0), Request(250, 10.0, 64)]
    budget = int(0.9 * 650 * 3)  # below what all three take at the most frugal distance (650 * 3)
    result = plan(requests, compute, 1e6, budget, max_window=64)
    # c scores 250 * 2 = 500 > b's 300
    assert result.paused == (2,) and result.fits and result.meets_slo


def test_under_slo_pressure_requests_pause_only_where_that_lets_the_rest_meet_theirs():
    compute = (1.0,) * 4
    # 1 s per token while a step computes 4 s: pausing cannot help, so every request runs, late.
    hopeless = plan([Request(10, 1.0), Request(20, 1.0), Request(30, 1.0)], compute, 1e6, 10**9)
    assert hopeless.paused == () and hopeless.fits and not hopeless.meets_slo and hopeless.latency_s == 4.0
    # 5 s per token: all three fit only with offloads whose fetches (10 s a layer) stall the step;
    # without the largest the other two fit on the GPU and take 4 s.
    requests = [Request(10, 5.0), Request(20, 5.0), Request(10**7, 5.0)]
    budget = 4 * (10 + 20) + 3 * 10**7
    helped = plan(requests, compute, 1e6, budget)
    assert helped.paused == (2,) and helped.meets_slo and helped.distances == (-1, -1, -1)


def test_the_window_is_the_steps_until_the_kept_kv_outgrows_the_budget():
    batch = Batch((1.0,) * 4, (10, 10), 1e6)
    requests = [Request(10, 10.0, token_bytes=1), Request(10, 10.0, token_bytes=2)]
    # All on the GPU: each step adds 4 * (1 + 2) = 12 bytes; 30 bytes of headroom last 2 steps.
    assert decode_window(requests, [NONE, NONE], batch, 30, 64) == 2
    # Offloading every other layer of the first: it keeps 2 layers + 1 of prefetch room: 3 + 8 = 11.
    assert decode_window(requests, [1, NONE], batch, 33, 64) == 3
    assert decode_window(requests, [NONE, NONE], batch, 10**6, 64) == 64
    assert decode_window(requests, [NONE, NONE], batch, 0, 64) == 1


def test_the_profile_follows_what_the_engine_reports_and_asks_for_a_new_plan_on_mismatch():
    profile = StepProfile(layers=2, base_s=1e-3, per_token_s=1e-7, bandwidth_bps=10e9, alpha=0.5)
    assert profile.compute_s(10_000) == pytest.approx((2e-3, 2e-3))
    # The engine's steps take 1.5x the model; each report is against the latest prediction.
    replans = [profile.observe(sum(profile.compute_s(10_000)), 6e-3, moved_bytes=10**9, transfer_s=0.2)
               for _ in range(40)]
    assert replans[0] and not replans[-1] and profile.compute_scale == pytest.approx(1.5, rel=1e-4)
    assert profile.bandwidth_bps == pytest.approx(5e9, rel=1e-4)
    assert profile.compute_s(10_000) == pytest.approx((3e-3, 3e-3), rel=1e-4)
    assert not profile.observe(6e-3, 6.3e-3)  # within 10%
    with pytest.raises(ValueError):
        profile.observe(0.0, 1.0)
    with pytest.raises(ValueError):
        StepProfile(layers=0, base_s=1e-3, per_token_s=0, bandwidth_bps=1e9)
