"""Real daemons joining through a real etcd: membership converges, survives crashes and etcd restarts."""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

import numpy as np

from kvd.client import Client
from kvd.testing.daemon import run_daemon, start_daemon
from kvd.testing.etcd import EtcdServer
from tests.integration.conftest import SMALL_SPEC, random_blocks

TTL_S = 2
POLL_S = 0.05


SECRET = "test-cluster-secret-0123456789"


def cluster_config(etcd: EtcdServer, name: str, prefix: str) -> dict:
    secret = Path(tempfile.gettempdir()) / "kvd-test-cluster-secret"
    secret.write_text(SECRET + "\n")
    return {"cluster": {"etcd_endpoints": [etcd.endpoint], "node_name": name, "key_prefix": prefix,
                        "lease_ttl_s": TTL_S, "etcd_timeout_s": 1.0, "secret_file": str(secret)}}


def wait_metric(daemon, name: str, value: float, timeout_s: float = 15.0) -> float:
    """Seconds until the daemon's metric reads `value` (fails past timeout_s)."""
    started = time.monotonic()
    while daemon.metric(name) != value:
        assert time.monotonic() - started < timeout_s, f"{name} = {daemon.metric(name)}, expected {value}"
        time.sleep(POLL_S)
    return time.monotonic() - started


def round_trip(daemon, seed: int) -> None:
    """A Put and a Get through the daemon: its local tiers serve."""
    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SMALL_SPEC)
        keys = namespace.keys(np.arange(4 * 16) + seed * 1000)
        blocks = random_blocks(SMALL_SPEC, 4, seed=seed)
        assert client.put(namespace, keys, blocks) == 4
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)


def test_three_daemons_converge_and_follow_crashes_and_leaves(tmp_path, etcd):
    prefix = "/kvd-daemons-1/"
    with run_daemon(tmp_path / "a", cluster_config(etcd, "a", prefix)) as a, \
            run_daemon(tmp_path / "b", cluster_config(etcd, "b", prefix)) as b:
        c = start_daemon(tmp_path / "c", cluster_config(etcd, "c", prefix))
        try:
            for daemon in (a, b, c):
                wait_metric(daemon, "kvd_cluster_members", 3)
                wait_metric(daemon, "kvd_cluster_joined", 1)
            c.process.send_signal(signal.SIGKILL)
            c.process.wait()
            # The crashed node's lease runs out at most TTL after its last refresh.
            assert wait_metric(a, "kvd_cluster_members", 2) <= TTL_S + 1.0
            wait_metric(b, "kvd_cluster_members", 2)
        finally:
            c.stop()
        # A clean stop revokes the lease: gone from the view well inside the TTL.
        b.stop()
        assert wait_metric(a, "kvd_cluster_members", 1) < TTL_S / 2
        round_trip(a, seed=1)


def test_a_daemon_serves_through_an_etcd_outage_and_rejoins(tmp_path):
    etcd = EtcdServer().start()
    prefix = "/kvd-daemons-2/"
    try:
        with run_daemon(tmp_path / "a", cluster_config(etcd, "a", prefix)) as a, \
                run_daemon(tmp_path / "b", cluster_config(etcd, "b", prefix)) as b:
            wait_metric(a, "kvd_cluster_members", 2)
            wait_metric(a, "kvd_cluster_joined", 1)
            sessions = a.metric("kvd_cluster_etcd_sessions_total")
            etcd.stop()
            wait_metric(a, "kvd_cluster_joined", 0)
            round_trip(a, seed=2)
            assert a.metric("kvd_cluster_members") == 2
            etcd.start()
            for daemon in (a, b):
                wait_metric(daemon, "kvd_cluster_joined", 1)
            assert a.metric("kvd_cluster_etcd_sessions_total") == sessions + 1
            wait_metric(b, "kvd_cluster_members", 2)
    finally:
        etcd.close()


def test_a_daemon_starts_with_etcd_down_and_joins_when_it_comes(tmp_path):
    etcd = EtcdServer()
    try:
        with run_daemon(tmp_path / "a", cluster_config(etcd, "a", "/kvd-daemons-3/")) as a:
            assert a.metric("kvd_cluster_joined") == 0
            round_trip(a, seed=3)
            etcd.start()
            wait_metric(a, "kvd_cluster_joined", 1)
            wait_metric(a, "kvd_cluster_members", 1)
            assert a.endpoints["pid"] == a.pid
    finally:
        etcd.close()
