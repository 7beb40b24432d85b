"""`kvd status` from a Stats response: sections, numbers, and quantiles from
histogram buckets (the daemon's own end-to-end check is in
tests/integration/test_observability.py)."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from kvd.server.convert import metric_samples
from kvd.cli.status import Samples, render_status, status_from_response
from kvd.v1 import kvd_pb2


def histogram_samples(observations: list[float], buckets: tuple[float, ...]) -> Samples:
    registry = CollectorRegistry()
    histogram = Histogram("job_seconds", "", ["class"], buckets=buckets, registry=registry)
    for value in observations:
        histogram.labels("restore").observe(value)
    return Samples((sample.name, dict(sample.labels), sample.value) for sample in metric_samples(registry))


def test_quantiles_interpolate_inside_the_bucket_as_promql_does():
    # 10 observations: 4 in (0, 1], 4 in (1, 2], 2 in (2, 4].
    samples = histogram_samples([0.5] * 4 + [1.5] * 4 + [3.0] * 2, (1.0, 2.0, 4.0))
    only = {"class": "restore"}
    assert samples.quantile("job_seconds", 0.5, only) == pytest.approx(1.25)  # rank 5: 1/4 into (1, 2]
    assert samples.quantile("job_seconds", 0.2, only) == pytest.approx(0.5)  # rank 2: half of (0, 1]
    assert samples.quantile("job_seconds", 0.9, only) == pytest.approx(3.0)  # rank 9: half of (2, 4]
    assert samples.quantile("job_seconds", 0.5, {"class": "write"}) is None  # no such series
    # Beyond the largest finite bound, its bound is all that is known.
    assert histogram_samples([9.0], (1.0, 2.0)).quantile("job_seconds", 0.99) == 2.0
    assert histogram_samples([], (1.0,)).quantile("job_seconds", 0.5) is None


def sample(name: str, value: float, **labels: str) -> kvd_pb2.MetricSample:
    return kvd_pb2.MetricSample(name=name, labels=labels, value=value)


def bucket_samples(name: str, io_class: str, counts: dict[str, float], total_s: float) -> list[kvd_pb2.MetricSample]:
    result = [sample(name + "_bucket", count, le=le, **{"class": io_class}) for le, count in counts.items()]
    return result + [sample(name + "_count", counts["+Inf"], **{"class": io_class}),
                     sample(name + "_sum", total_s, **{"class": io_class})]


def test_render_shows_every_section_with_its_numbers():
    response = kvd_pb2.StatsResponse(
        version="9.9", instance_id="abc", uptime_s=12,
        tiers=[kvd_pb2.TierStats(tier=kvd_pb2.TIER_HOST, blocks=3, bytes_used=3 << 20, payload_bytes=3 << 20,
                                 capacity_bytes=8 << 20, pinned_blocks=2, evictions=7),
               kvd_pb2.TierStats(tier=kvd_pb2.TIER_DISK, blocks=30, bytes_used=30 << 20, payload_bytes=30 << 20,
                                 capacity_bytes=64 << 20, evictions=1)],
        leases=2, leases_expired=5,
        metrics=[
            sample("kvd_tier_hits_total", 11, tier="host"), sample("kvd_tier_misses_total", 13, tier="host"),
            sample("kvd_tier_hits_total", 12, tier="disk"), sample("kvd_tier_misses_total", 1, tier="disk"),
            sample("kvd_tier_evicted_blocks_total", 6, tier="host", reason="demoted"),
            sample("kvd_tier_evicted_blocks_total", 1, tier="host", reason="dropped"),
            sample("kvd_tier_evicted_blocks_total", 1, tier="disk", reason="host_copy_kept"),
            sample("kvd_tier_moves_total", 40, source_tier="host", target_tier="disk"),
            sample("kvd_tier_moves_total", 12, source_tier="disk", target_tier="host"),
            sample("kvd_disk_queue_jobs", 3, **{"class": "restore"}),
            sample("kvd_disk_queue_jobs", 0, **{"class": "write"}),
            *bucket_samples("kvd_disk_job_run_seconds", "restore", {"0.001": 0, "0.01": 4, "+Inf": 4}, 0.02),
            *bucket_samples("kvd_disk_job_wait_seconds", "restore", {"0.001": 4, "0.01": 4, "+Inf": 4}, 0.001),
            sample("kvd_disk_io_bytes_total", 5 << 20, operation="read"),
            sample("kvd_disk_io_bytes_total", 7 << 20, operation="write"),
            sample("kvd_disk_write_queue", 9),
            sample("kvd_disk_failures_total", 2, operation="load"),
            sample("kvd_lease_pinned_blocks", 6), sample("kvd_lease_clients", 2),
            sample("kvd_lease_client_pinned_blocks_max", 4), sample("kvd_lease_client_pin_cap_blocks", 64),
            sample("kvd_lease_pin_cap_rejections_total", 3),
            sample("kvd_events_total", 4, kind="stored"), sample("kvd_event_subscribers", 1),
            sample("kvd_event_resyncs_total", 2, reason="subscriber_too_slow"),
            sample("kvd_prefetch_used_total", 3), sample("kvd_prefetch_wasted_total", 1),
            sample("kvd_cluster_peer", 1, peer="b", transport="nixl-tcp"),
            sample("kvd_cluster_peer", 1, peer="a", transport="grpc"),
            sample("kvd_cluster_fetched_blocks_total", 30, peer="b", transport="nixl"),
            sample("kvd_cluster_fetched_blocks_total", 2, peer="b", transport="grpc"),
            sample("kvd_cluster_failed_fetches_total", 1, peer="a"),
        ],
    )
    status = status_from_response("unix:///x.sock", response)
    host, disk = status["tiers"]
    assert (host["hits"], host["misses"], host["evicted"]) == (11, 13, {"demoted": 6, "dropped": 1})
    assert (disk["hits"], disk["misses"], disk["evicted"]) == (12, 1, {"host_copy_kept": 1})
    restore = status["disk_io"]["classes"][0]
    assert (restore["class"], restore["queued"], restore["jobs"]) == ("restore", 3, 4)
    assert restore["run_p50_s"] == pytest.approx(0.001 + 0.009 * 0.5)
    assert restore["run_mean_s"] == pytest.approx(0.005)
    assert status["prefetch"]["useful_ratio"] == pytest.approx(0.75)
    text = render_status(status)
    lines = text.splitlines()
    host_row = next(line for line in lines if line.startswith("host "))
    assert host_row.split() == ["host", "3", "3.0", "MiB", "3.0", "MiB", "8.0", "MiB", "37.5%", "2", "11", "13",
                                "45.8%", "7"]
    assert "evicted   host: demoted 6, dropped 1" in lines
    assert "          disk: host_copy_kept 1" in lines
    assert "moved     host -> disk 40, disk -> host 12" in lines
    assert ("disk I/O  read 5.0 MiB, written 7.0 MiB; write backlog 9 blocks; failed blocks: load 2") in lines
    restore_row = next(line for line in lines if line.strip().startswith("restore"))
    assert restore_row.split() == ["restore", "3", "4", "500", "us", "990", "us", "5.5", "ms", "9.9", "ms", "5.0", "ms"]
    assert ("pins      6 blocks pinned through leases by 2 clients; most by one client 4 (cap 64); "
            "refused by the cap 3") in lines
    assert "leases    open 2, expired 5" in lines
    assert "events    subscribers 1; published stored 4; resyncs subscriber_too_slow 2" in lines
    assert "prefetch  used_total 3, wasted_total 1; useful 75.0% (used / (used + wasted))" in lines
    assert "no namespaces registered" in lines
    assert "peer      a: over grpc; fetched 0 blocks, fetches cut short 1" in lines
    assert "          b: over nixl-tcp; fetched 32 blocks, fetches cut short 0" in lines


def test_a_daemon_without_metrics_renders_the_summary_only():
    response = kvd_pb2.StatsResponse(version="9.9", tiers=[kvd_pb2.TierStats(tier=kvd_pb2.TIER_HOST, capacity_bytes=1)])
    status = status_from_response("t", response)
    assert status["disk_io"] is None and status["pins"] is None and status["prefetch"] is None
    text = render_status(status)
    assert "disk I/O" not in text and "pins" not in text and "leases    open 0, expired 0" in text
