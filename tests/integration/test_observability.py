"""Tier observability, pins and leases through a real daemon: what /metrics
and `kvd status` report after known requests, and what a dead client's
leases cost."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvd.client import Client
from kvd.testing.daemon import run_daemon
from kvd.v1 import kvd_pb2, kvd_pb2_grpc
from tests.integration.conftest import SMALL_SPEC, random_blocks
from tests.integration.disk_tier_helpers import HOST_SLOTS, SPEC, blocks_for, disk_config, metric_samples

ROOT = Path(__file__).parents[2]
IO_CLASSES = ("restore", "prefetch", "write", "control")


def kvd_status(target: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvd", "status", "--target", target, *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def wait_for(condition, timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


HOST_HITS, HOST_MISSES = 'kvd_tier_hits_total{tier="host"}', 'kvd_tier_misses_total{tier="host"}'
DISK_HITS, DISK_MISSES = 'kvd_tier_hits_total{tier="disk"}', 'kvd_tier_misses_total{tier="disk"}'
DISK_TO_HOST = 'kvd_tier_moves_total{source_tier="disk",target_tier="host"}'
READ_BYTES = 'kvd_disk_io_bytes_total{operation="read"}'
RESTORE_JOBS = 'kvd_disk_job_run_seconds_count{class="restore"}'


@pytest.fixture
def disk_daemon(tmp_path):
    # Write-through: every block gets its disk copy at once, so host copies
    # can always be demoted to make room and the Gets below are served whole.
    with run_daemon(tmp_path / "d", config=disk_config(tmp_path, write_mode="through")) as daemon:
        yield daemon


def push_to_disk(client: Client, daemon, namespace) -> tuple[list[bytes], np.ndarray]:
    """12 blocks stored, then pushed out of host memory by other blocks: on disk only."""
    keys = namespace.keys(np.arange(12 * 16))
    blocks = blocks_for(12, seed=1)
    assert client.put(namespace, keys, blocks, durable=True) == 12
    for round_ in range(2):
        other = namespace.keys(np.arange(HOST_SLOTS * 16) + 10**6 * (round_ + 1))
        client.put(namespace, other, blocks_for(HOST_SLOTS, seed=10 + round_))
    wait_for(lambda: metric_samples(daemon.metrics_url)["kvd_disk_write_queue"] == 0, what="the write backlog")
    assert set(client.lookup(namespace, keys).tiers) == {kvd_pb2.TIER_DISK}
    return keys, blocks


def test_a_get_of_disk_only_blocks_is_counted_by_tier_with_its_moves_and_io(disk_daemon):
    daemon = disk_daemon
    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys, blocks = push_to_disk(client, daemon, namespace)
        unknown = namespace.keys(np.arange(14 * 16))[12:]  # 2 more blocks of the chain, never stored
        before = metric_samples(daemon.metrics_url)
        assert np.array_equal(client.get_numpy(namespace, keys + unknown), blocks)
        after = metric_samples(daemon.metrics_url)
        # 12 page faults served from disk, 2 keys stored nowhere.
        assert delta(after, before, HOST_HITS) == 0
        assert delta(after, before, HOST_MISSES) == 14
        assert delta(after, before, DISK_HITS) == 12
        assert delta(after, before, DISK_MISSES) == 2
        assert delta(after, before, DISK_TO_HOST) == 12
        assert delta(after, before, READ_BYTES) >= 12 * SPEC.block_bytes
        assert delta(after, before, RESTORE_JOBS) >= 1
        assert after['kvd_disk_job_run_seconds_sum{class="restore"}'] > 0
        # The same Get again: served from host memory.
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)
        again = metric_samples(daemon.metrics_url)
        assert delta(again, after, HOST_HITS) == 12 and delta(again, after, DISK_HITS) == 0
        assert delta(again, after, READ_BYTES) == 0
    # Per tier and per namespace agree.
    label = namespace.namespace_id.hex()[:16]
    assert again[HOST_HITS] + again[DISK_HITS] == again[f'kvd_get_blocks_total{{namespace="{label}",result="hit"}}']
    assert again[HOST_MISSES] == again[DISK_HITS] + again[DISK_MISSES]
    # Every I/O class has a queue gauge and histograms, idle now.
    for io_class in IO_CLASSES:
        assert again[f'kvd_disk_queue_jobs{{class="{io_class}"}}'] == 0
        assert f'kvd_disk_job_wait_seconds_count{{class="{io_class}"}}' in again
    written = again['kvd_tier_moves_total{source_tier="host",target_tier="disk"}']
    assert again['kvd_disk_io_bytes_total{operation="write"}'] == written * SPEC.block_bytes >= 12 * SPEC.block_bytes
    # Evictions: every on-demand host eviction has a reason; the first 12
    # blocks were written before they were evicted (their Put waited).
    host_reasons = {name: value for name, value in again.items()
                    if name.startswith('kvd_tier_evicted_blocks_total{reason=') and 'tier="host"' in name}
    demoted = sum(value for name, value in host_reasons.items() if 'reason="demoted' in name)
    assert demoted >= 12
    assert again['kvd_tier_evicted_blocks_total{reason="not_admitted",tier="host"}'] == 0
    on_demand = sum(value for name, value in host_reasons.items() if "demoted_background" not in name)
    assert on_demand == again['kvd_tier_evictions_total{tier="host"}'] > 0


def test_status_shows_tiers_disk_io_pins_and_events_with_the_daemon_numbers(disk_daemon):
    daemon = disk_daemon
    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys, _ = push_to_disk(client, daemon, namespace)
        client.get_numpy(namespace, keys)
        # Quiet now: status and a scrape see the same numbers.
        samples = metric_samples(daemon.metrics_url)
        result = kvd_status(daemon.unix_target, "--json")
        text = kvd_status(daemon.tcp_target).stdout
    assert result.returncode == 0, result.stderr
    status = json.loads(result.stdout)
    tiers = {tier["tier"]: tier for tier in status["tiers"]}
    for tier in ("host", "disk"):
        assert tiers[tier]["hits"] == samples[f'kvd_tier_hits_total{{tier="{tier}"}}']
        assert tiers[tier]["misses"] == samples[f'kvd_tier_misses_total{{tier="{tier}"}}']
    assert tiers["disk"]["hits"] >= 12
    assert tiers["host"]["evicted"]["demoted"] == samples['kvd_tier_evicted_blocks_total{reason="demoted",tier="host"}']
    moves = {(move["source_tier"], move["target_tier"]): move["blocks"] for move in status["moves"]}
    assert moves[("disk", "host")] == samples[DISK_TO_HOST] >= 12
    disk_io = status["disk_io"]
    assert disk_io["read_bytes"] == samples[READ_BYTES] > 0
    assert disk_io["write_backlog_blocks"] == 0
    classes = {entry["class"]: entry for entry in disk_io["classes"]}
    assert set(classes) == set(IO_CLASSES)
    assert classes["restore"]["jobs"] == samples[RESTORE_JOBS] >= 1
    assert classes["restore"]["run_p50_s"] > 0 and classes["prefetch"]["run_p50_s"] is None
    assert status["pins"] == {"pinned_blocks": 0, "clients": 0, "client_max_blocks": 0, "cap_blocks": 65536,
                              "cap_rejections": 0}
    assert status["events"]["published"]["stored"] >= 3
    # The table, readably.
    lines = text.splitlines()
    host_row = next(line for line in lines if line.startswith("host "))
    assert f" {tiers['host']['hits']} " in host_row and f" {tiers['host']['misses']} " in host_row
    assert any(line.startswith("evicted   host: demoted ") for line in lines)
    assert f"disk -> host {moves[('disk', 'host')]}" in text
    assert any(line.startswith("disk I/O  read ") for line in lines)
    restore_row = next(line for line in lines if line.split()[:1] == ["restore"])
    assert restore_row.split()[1:3] == ["0", str(classes["restore"]["jobs"])]
    assert "pins      0 blocks pinned through leases by 0 clients" in text
    assert any(line.startswith("events    subscribers 0; published ") for line in lines)
    if "kvd_prefetch_used_total" in samples:
        assert any(line.startswith("prefetch  ") for line in lines)


def test_evictions_without_a_disk_are_drops(tmp_path):
    config = {"host": {"capacity_bytes": 8 * (64 << 10), "slot_bytes": 64 << 10}}
    with run_daemon(tmp_path, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SMALL_SPEC)
        for chain in range(3):  # 12 blocks in 8 slots
            keys = namespace.keys(np.arange(4 * 16) + 10_000 * chain)
            assert client.put(namespace, keys, random_blocks(SMALL_SPEC, 4, seed=chain)) == 4
        samples = metric_samples(daemon.metrics_url)
    assert samples['kvd_tier_evictions_total{tier="host"}'] == 4
    assert samples['kvd_tier_evicted_blocks_total{reason="dropped",tier="host"}'] == 4
    assert samples['kvd_tier_evicted_blocks_total{reason="demoted",tier="host"}'] == 0
    assert not any('tier="disk"' in name or "kvd_disk_" in name for name in samples)


def test_the_pin_cap_refuses_a_client_and_changes_nothing(tmp_path):
    config = {"host": {"capacity_bytes": 16 * (64 << 10), "slot_bytes": 64 << 10},
              "leases": {"max_pins_per_client": 4}}
    with run_daemon(tmp_path, config=config) as daemon, Client(daemon.unix_target) as client, \
            grpc.insecure_channel(daemon.unix_target) as channel:
        stub = kvd_pb2_grpc.KvdStub(channel)
        namespace = client.register_namespace(SMALL_SPEC)
        keys = namespace.keys(np.arange(7 * 16))
        blocks = random_blocks(SMALL_SPEC, 7, seed=3)
        assert client.put(namespace, keys[:4], blocks[:4]) == 4
        assert client.put(namespace, keys, blocks) == 3  # 3 new blocks + their pinned parent: 4
        holder = stub.Get(kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, client_id="holder", keys=keys[:4]))
        assert holder.matched == 4
        stats_before, samples_before = client.stats(), metric_samples(daemon.metrics_url)
        for call, request in (
            (stub.Get, kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, client_id="holder", keys=keys[:1])),
            (stub.Reserve, kvd_pb2.ReserveRequest(namespace_id=namespace.namespace_id, client_id="holder",
                                                  keys=namespace.keys(np.arange(16) + 99_000))),
        ):
            with pytest.raises(grpc.RpcError) as raised:
                call(request)
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "client 'holder' pins 4 blocks" in raised.value.details()
            assert "cap of 4 blocks per client (leases.max_pins_per_client)" in raised.value.details()
        stats_after, samples_after = client.stats(), metric_samples(daemon.metrics_url)
        # Nothing changed but the count of refusals (and the RPC metrics).
        assert stats_after.leases == stats_before.leases == 1
        assert stats_after.tiers == stats_before.tiers and stats_after.namespaces == stats_before.namespaces
        changed = {name for name in samples_after if samples_after[name] != samples_before.get(name)
                   and not name.startswith("kvd_rpc")}
        assert changed == {"kvd_lease_pin_cap_rejections_total"}
        assert samples_after["kvd_lease_pin_cap_rejections_total"] == 2
        # The cap is per client.
        other = stub.Get(kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, client_id="other", keys=keys[:3]))
        samples = metric_samples(daemon.metrics_url)
        assert (samples["kvd_lease_clients"], samples["kvd_lease_pinned_blocks"],
                samples["kvd_lease_client_pinned_blocks_max"], samples["kvd_lease_client_pin_cap_blocks"]) == (2, 7, 4, 4)
        stub.Release(kvd_pb2.ReleaseRequest(client_id="holder", lease_ids=[holder.lease_id]))
        stub.Release(kvd_pb2.ReleaseRequest(client_id="other", lease_ids=[other.lease_id]))
        samples = metric_samples(daemon.metrics_url)
        assert (samples["kvd_lease_clients"], samples["kvd_lease_pinned_blocks"]) == (0, 0)


def test_a_killed_client_pins_until_its_leases_expire_then_its_blocks_are_evictable(tmp_path):
    """Leases are not tied to a connection (client ids are the clients' own
    names): a SIGKILLed client's pins last until its leases' deadlines, and
    then its blocks can be evicted like any others."""
    config = {"host": {"capacity_bytes": 8 * (64 << 10), "slot_bytes": 64 << 10},
              "leases": {"default_ms": 3000, "sweep_interval_ms": 50}}
    with run_daemon(tmp_path, config=config) as daemon:
        script = textwrap.dedent(f"""
            import os, signal, numpy as np, grpc
            from kvd.client import Client
            from kvd.v1 import kvd_pb2, kvd_pb2_grpc
            from tests.integration.conftest import SMALL_SPEC, random_blocks
            client = Client({daemon.unix_target!r})
            ns = client.register_namespace(SMALL_SPEC)
            keys = ns.keys(np.arange(8 * 16))
            client.put(ns, keys, random_blocks(SMALL_SPEC, 8, seed=0))
            stub = kvd_pb2_grpc.KvdStub(grpc.insecure_channel({daemon.unix_target!r}))
            stub.Get(kvd_pb2.GetRequest(namespace_id=ns.namespace_id, client_id="doomed", keys=keys))
            print("pinned", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert "pinned" in result.stdout, result.stderr
        assert result.returncode == -signal.SIGKILL
        with Client(daemon.unix_target) as client:
            namespace = client.register_namespace(SMALL_SPEC)
            samples = metric_samples(daemon.metrics_url)
            assert (samples["kvd_lease_clients"], samples["kvd_lease_pinned_blocks"], samples["kvd_leases"]) == (1, 8, 1)
            fresh = namespace.keys(np.arange(4 * 16) + 50_000)
            fresh_blocks = random_blocks(SMALL_SPEC, 4, seed=1)
            # The whole host tier is pinned by the dead client: nothing can go.
            with pytest.raises(grpc.RpcError) as raised:
                client.put(namespace, fresh, fresh_blocks)
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "host tier is full" in raised.value.details()
            assert client.stats().leases == 1, "the lease expired before the test could see it pinned"
            wait_for(lambda: client.stats().leases == 0, what="the dead client's lease to expire")
            samples = metric_samples(daemon.metrics_url)
            assert samples["kvd_leases_expired_total"] == 1
            assert (samples["kvd_lease_clients"], samples["kvd_lease_pinned_blocks"]) == (0, 0)
            assert samples['kvd_tier_pinned_blocks{tier="host"}'] == 0
            # Its blocks are evicted like any others now, leaves first.
            assert client.put(namespace, fresh, fresh_blocks) == 4
            old = namespace.keys(np.arange(8 * 16))
            assert client.lookup(namespace, old).matched == 4
            assert metric_samples(daemon.metrics_url)['kvd_tier_evictions_total{tier="host"}'] == 4
