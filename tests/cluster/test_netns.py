"""Three daemons on three 'hosts' (network namespaces on a bridge): NIXL over TCP across veths, a cut link, a kill.

The bytes of a fetch cross real veth devices (UCX_TLS=tcp: UCX's shared
memory path would go around them), which the host side's counters show.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvd.client import Client
from kvd.testing.daemon import start_daemon
from kvd.testing.etcd import EtcdServer
from kvd.testing.netns import Network
from tests.cluster.test_cluster_lookup import matches, wait_matches
from tests.cluster.test_daemon_cluster import TTL_S, cluster_config, wait_metric
from tests.cluster.test_remote_fetch import fetched
from tests.integration.conftest import SMALL_SPEC, random_blocks

UCX_OVER_TCP = {"UCX_TLS": "tcp"}


def veth_received(net: Network, index: int) -> int:
    """Bytes the bridge side of host `index`'s veth received: what the host sent out."""
    return int(Path(f"/sys/class/net/{net.hosts[index].host_veth}/statistics/rx_bytes").read_text())


@pytest.fixture()
def network():
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root (CI runs as root)")
    with Network(3) as net:
        yield net


def test_fetches_cross_the_veths_and_cuts_and_kills_cost_only_misses(tmp_path, network):
    net = network
    etcd = EtcdServer(host=net.gateway).start()
    daemons = []
    try:
        for i, name in enumerate("abc"):
            config = cluster_config(etcd, name, "/kvd-netns/")
            config["cluster"].update(fetch_timeout_s=2.0, rpc_timeout_s=1.0)
            config["log"] = {"level": "info", "format": "json"}
            daemons.append(start_daemon(tmp_path / name, config, UCX_OVER_TCP, net.hosts[i]))
        a, b, c = daemons
        for daemon in daemons:
            wait_metric(daemon, "kvd_cluster_members", 3)
        with Client(a.unix_target) as ca, Client(c.unix_target) as cc:
            ns_a, ns_c = ca.register_namespace(SMALL_SPEC), cc.register_namespace(SMALL_SPEC)
            keys = ns_a.keys(np.arange(200 * 16) + 21)
            blocks = random_blocks(SMALL_SPEC, 200, seed=7)
            assert ca.put(ns_a, keys, blocks) == 200
            wait_matches(cc, ns_c, keys, {"a": 200})
            sent_before = veth_received(net, 0)
            got = cc.get_numpy(ns_c, keys)
            assert np.array_equal(got, blocks) and fetched(c, "nixl") == 200
            assert veth_received(net, 0) - sent_before >= blocks.nbytes
            # A second chain on a, then a's link goes down.
            keys2 = ns_a.keys(np.arange(100 * 16) + 90_000)
            assert ca.put(ns_a, keys2, random_blocks(SMALL_SPEC, 100, seed=8)) == 100
            wait_matches(cc, ns_c, keys2, {"a": 100})
            net.cut(0)
            started = time.monotonic()
            assert cc.get_numpy(ns_c, keys2).shape[0] == 0
            # Directory query (1 s), NIXL pin (2 s), then the gRPC stream (2 s) at most.
            assert time.monotonic() - started < 1.0 + 2.0 + 2.0 + 1.5
            assert wait_metric(c, "kvd_cluster_members", 2, timeout_s=TTL_S + 5) <= TTL_S + 1.5
            assert matches(cc, ns_c, keys2) == {}
            # Healed, a rejoins under a new lease and publishes its blocks again.
            net.heal(0)
            wait_metric(c, "kvd_cluster_members", 3, timeout_s=15)
            wait_matches(cc, ns_c, keys2, {"a": 100}, timeout_s=15)
            assert np.array_equal(cc.get_numpy(ns_c, keys2[:10]), random_blocks(SMALL_SPEC, 100, seed=8)[:10])
        b.process.send_signal(signal.SIGKILL)
        b.process.wait()
        assert wait_metric(c, "kvd_cluster_members", 2, timeout_s=TTL_S + 5) <= TTL_S + 1.5
        assert a.metric("kvd_lease_pinned_blocks") == 0
    finally:
        for daemon in daemons:
            daemon.stop()
        etcd.close()


def test_a_network_a_killed_run_left_on_the_same_subnet_is_cleared_first():
    """A killed run's bridge holding the subnet's gateway would take its routes: it goes first."""
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root (CI runs as root)")
    stale = Network(1)
    stale.tag = "kvdt_stale"  # a run that was killed: another tag, the same subnet as the next
    stale.bridge, stale.hosts = "kvdt_stalebr", [dataclasses.replace(stale.hosts[0], namespace="kvdt_stalen0",
                                                                     host_veth="kvdt_stalev0")]
    stale.__enter__()  # never exited, as if killed
    with Network(1, subnet=int(stale.gateway.split(".")[1])) as fresh:
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        assert "kvdt_stalebr" not in links and fresh.bridge in links
        assert "kvdt_stalen0" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        with socket.create_server((fresh.gateway, 0)) as server:  # the host reaches the gateway, not the stale one
            dial = f"import socket; socket.create_connection(('{fresh.gateway}', {server.getsockname()[1]}), 5)"
            assert subprocess.run(fresh.hosts[0].wrap([sys.executable, "-c", dial]), capture_output=True,
                                  timeout=30).returncode == 0
