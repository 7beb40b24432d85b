"""PlanPlacement and ReportStep against a real daemon in another process: plans within the budget,
pauses when nothing fits, profiles that follow reported steps, and precise refusals of bad input
that leave the daemon serving."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest

from kvd.client import Client
from kvd.planner.latency import Batch, gpu_bytes, step_latency
from kvd.testing.daemon import run_daemon
from kvd.v1 import kvd_pb2

LAYERS = 8
COMPUTE = [1e-3] * LAYERS
BANDWIDTH = 1e9  # 1 MB per ms: a 1 MB layer of KV takes as long as a layer computes


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with run_daemon(tmp_path_factory.mktemp("kvd")) as daemon, Client(daemon.unix_target) as connected:
        yield connected


def refused(call, code: grpc.StatusCode, fragment: str) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    assert raised.value.code() == code and fragment in raised.value.details(), raised.value.details()


def entry(kv_mb: float, slo_ms: float = 100.0, deposit: int = 0, token_bytes: int = 1000,
          context: int = 0) -> kvd_pb2.PlanRequestEntry:
    return kvd_pb2.PlanRequestEntry(kv_bytes=int(kv_mb * 1e6), slo_s=slo_ms / 1e3, deposit_tokens=deposit,
                                    token_bytes=token_bytes, context_tokens=context)


def request(entries, budget_mb: float, **fields) -> kvd_pb2.PlanPlacementRequest:
    fields.setdefault("layer_compute_s", COMPUTE)
    fields.setdefault("bandwidth_bps", BANDWIDTH)
    return kvd_pb2.PlanPlacementRequest(requests=entries, budget_bytes=int(budget_mb * 1e6), **fields)


def total_mb(entries) -> float:
    return sum(e.kv_bytes for e in entries) * LAYERS / 1e6


def test_a_roomy_budget_keeps_everything_on_the_gpu_for_the_whole_window(client):
    entries = [entry(1), entry(2), entry(0.5)]
    answer = client.plan_placement(request(entries, total_mb(entries) + 10))
    assert list(answer.distances) == [-1, -1, -1] and not answer.paused
    assert answer.fits and answer.meets_slo and answer.exact
    assert answer.latency_s == pytest.approx(sum(COMPUTE))
    # 10 MB of headroom, 3 requests x 8 layers x 1000 bytes a step: 416 steps, capped at 64.
    assert answer.window_steps == 64


def test_a_tight_budget_offloads_within_it_and_the_prediction_is_the_model(client):
    entries = [entry(1), entry(2), entry(0.5), entry(3)]
    budget = total_mb(entries) * 0.7
    answer = client.plan_placement(request(entries, budget, max_window=8))
    assert answer.fits and not answer.paused and answer.exact
    batch = Batch(tuple(COMPUTE), tuple(e.kv_bytes for e in entries), BANDWIDTH)
    assert answer.gpu_bytes == gpu_bytes(batch, list(answer.distances)) <= budget * 1e6
    assert answer.latency_s == pytest.approx(step_latency(batch, list(answer.distances)))
    assert any(d != -1 for d in answer.distances) and answer.latency_s > sum(COMPUTE)
    assert 1 <= answer.window_steps <= 8 and answer.bound_s == pytest.approx(answer.latency_s)


def test_when_nothing_fits_the_largest_kv_weighted_by_deposit_pauses(client):
    entries = [entry(1), entry(3), entry(2.5, deposit=64)]  # 2.5 * (1 + 64/64) = 5 > 3
    answer = client.plan_placement(request(entries, total_mb(entries) * 0.45))
    assert list(answer.paused) == [2] and answer.fits and answer.distances[2] == -1
    lone = client.plan_placement(request([entry(3)], 1))  # a lone request is never paused
    assert not lone.paused and not lone.fits and not lone.meets_slo


def test_a_profile_predicts_follows_reports_and_asks_for_a_new_plan_on_mismatch(client):
    define = kvd_pb2.PlanProfile(layers=LAYERS, base_s=5e-4, per_token_s=1e-7, bandwidth_bps=BANDWIDTH, alpha=0.5)
    entries = [entry(1, context=2000), entry(1, context=3000)]
    first = client.plan_placement(request(entries, 100, layer_compute_s=[], bandwidth_bps=0, profile="llama",
                                          define=define))
    assert list(first.layer_compute_s) == pytest.approx([5e-4 + 1e-7 * 5000] * LAYERS)
    assert first.latency_s == pytest.approx(LAYERS * 1e-3)
    report = client.report_step(kvd_pb2.ReportStepRequest(profile="llama", predicted_s=first.latency_s,
                                                          observed_s=2 * first.latency_s, moved_bytes=10**6,
                                                          transfer_s=2e-3))
    assert report.replan and report.compute_scale == pytest.approx(1.5)
    assert report.bandwidth_bps == pytest.approx(0.5 * BANDWIDTH + 0.5 * 5e8)
    again = client.plan_placement(request(entries, 100, layer_compute_s=[], bandwidth_bps=0, profile="llama"))
    assert again.latency_s == pytest.approx(1.5 * first.latency_s)
    assert again.bandwidth_bps == pytest.approx(report.bandwidth_bps)
    steady = client.report_step(kvd_pb2.ReportStepRequest(profile="llama", predicted_s=again.latency_s,
                                                          observed_s=again.latency_s * 1.05))
    assert not steady.replan


@pytest.mark.parametrize("bad, fragment", [
    (lambda: request([entry(1, slo_ms=math.nan)], 10), "requests[0].slo_s"),
    (lambda: request([entry(1)], 10, layer_compute_s=[1e-3, -1.0]), "layer_compute_s[1]"),
    (lambda: request([entry(1)], 10, layer_compute_s=[1e-3] * 1025), "at most 1024 layers"),
    (lambda: request([entry(1)] * 257, 10), "at most 256 requests"),
    (lambda: request([entry(1)], 0), "budget_bytes"),
    (lambda: request([entry(1)], 10, bandwidth_bps=math.inf), "bandwidth_bps"),
    (lambda: request([entry(1)], 10, layer_compute_s=[]), "name a profile"),
    (lambda: request([entry(1)], 10, max_nodes=10**6), "max_nodes"),
    (lambda: request([entry(1)], 10, profile="p", define=kvd_pb2.PlanProfile(layers=0, base_s=1, bandwidth_bps=1)),
     "define.layers"),
    (lambda: request([entry(1)], 10, profile="p", define=kvd_pb2.PlanProfile(layers=4, base_s=1, bandwidth_bps=1,
                                                                                alpha=2)), "define.alpha"),
    (lambda: request([entry(1)], 10, define=kvd_pb2.PlanProfile(layers=4, base_s=1, bandwidth_bps=1)),
     "profile name"),
])
def test_bad_plans_are_refused_by_field_and_the_daemon_serves_on(client, bad, fragment):
    refused(lambda: client.plan_placement(bad()), grpc.StatusCode.INVALID_ARGUMENT, fragment)
    assert client.plan_placement(request([entry(1)], 100)).fits


def test_reports_for_unknown_profiles_or_bad_times_are_refused(client):
    refused(lambda: client.report_step(kvd_pb2.ReportStepRequest(profile="nobody", predicted_s=1, observed_s=1)),
            grpc.StatusCode.NOT_FOUND, "no plan profile 'nobody'")
    refused(lambda: client.plan_placement(request([entry(1)], 10, layer_compute_s=[], profile="nobody")),
            grpc.StatusCode.NOT_FOUND, "no plan profile 'nobody'")
    client.plan_placement(request([entry(1)], 100, profile="known", define=kvd_pb2.PlanProfile(
        layers=LAYERS, base_s=1e-3, bandwidth_bps=BANDWIDTH)))
    refused(lambda: client.report_step(kvd_pb2.ReportStepRequest(profile="known", predicted_s=1, observed_s=-1)),
            grpc.StatusCode.INVALID_ARGUMENT, "observed_s")
    assert np.isfinite(client.report_step(kvd_pb2.ReportStepRequest(profile="known", predicted_s=1,
                                                                    observed_s=1)).compute_scale)
