"""A Get fetches what a peer holds: real daemons, real bytes, verified, nothing left pinned."""

from __future__ import annotations

import math

import signal
import threading
import time

import numpy as np
import pytest

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec
from kvd.testing.daemon import run_daemon, start_daemon
from kvd.testing.put_stream import SPEC
from kvd.testing.tenants import tenant_blocks, write_tenants_file
from tests.cluster.test_cluster_lookup import wait_matches
from tests.cluster.test_daemon_cluster import cluster_config, wait_metric
from tests.integration.conftest import SMALL_SPEC, random_blocks


def config(etcd, name: str, prefix: str, **cluster) -> dict:
    values = cluster_config(etcd, name, prefix)
    values["cluster"].update(cluster)
    values["host"] = {"capacity_bytes": 128 << 20, "slot_bytes": 1 << 20}
    return values


def fetched(daemon, transport: str, peer: str | None = None) -> float:
    """Blocks the daemon fetched over `transport` (from `peer`, or from any)."""
    samples = daemon.metric_samples("kvd_cluster_fetched_blocks_total")
    return sum(value for line, value in samples.items()
               if f'transport="{transport}"' in line and (peer is None or f'peer="{peer}"' in line))


def failed_fetches(daemon) -> float:
    return sum(daemon.metric_samples("kvd_cluster_failed_fetches_total").values())


# NIXL over shared memory (UCX copies between the processes), over TCP (the
# holder's own progress moves the bytes, as across hosts), and the gRPC stream.
@pytest.mark.parametrize("transport, env", [("nixl", {}), ("nixl", {"UCX_TLS": "tcp"}), ("grpc", {})],
                         ids=["nixl-shm", "nixl-tcp", "grpc"])
def test_a_get_fetches_the_missing_blocks_from_the_longest_holder(tmp_path, etcd, transport, env):
    prefix = f"/kvd-fetch-1-{transport}-{len(env)}/"
    with run_daemon(tmp_path / "a", config(etcd, "a", prefix, transport=transport), env) as a, \
            run_daemon(tmp_path / "b", config(etcd, "b", prefix, transport=transport), env) as b, \
            run_daemon(tmp_path / "c", config(etcd, "c", prefix, transport=transport), env) as c:
        for daemon in (a, b, c):
            wait_metric(daemon, "kvd_cluster_members", 3)
        with Client(a.unix_target) as ca, Client(b.unix_target) as cb, Client(c.unix_target) as cc:
            ns_a, ns_b, ns_c = (client.register_namespace(SMALL_SPEC) for client in (ca, cb, cc))
            keys = ns_a.keys(np.arange(400 * 16) + 11)
            blocks = random_blocks(SMALL_SPEC, 400, seed=5)
            assert ca.put(ns_a, keys, blocks) == 400
            assert cb.put(ns_b, keys[:60], blocks[:60]) == 60
            # c holds the first 10 itself.
            assert cc.put(ns_c, keys[:10], blocks[:10]) == 10
            wait_matches(cc, ns_c, keys, {"a": 400, "b": 60, "c": 10})
            # What the rest would cost to load: unknown before c has fetched anything.
            unknown = cc.lookup(ns_c, keys, include_remote=True, load_times=True)
            assert unknown.matched == 400 and unknown.load_s[9] == 0 and math.isnan(unknown.load_s[10])
            # As an engine that holds the first 10 asks: the rest, under its local parent.
            got = cc.get_numpy(ns_c, keys[10:], parent_key=keys[9])
            assert got.shape[0] == 390 and np.array_equal(got, blocks[10:])
            # Each peer as c sees it, with the way blocks from it move (what `kvd status` shows).
            peers = c.metric_samples("kvd_cluster_peer")
            way = "nixl-tcp" if transport == "nixl" else "grpc"
            assert peers == {f'kvd_cluster_peer{{peer="{name}",transport="{way}"}}': 1.0 for name in "ab"}
            # All from a, the longest holder (b holds 60).
            assert fetched(c, transport, peer="a") == fetched(c, transport) == 390 and failed_fetches(c) == 0
            assert np.array_equal(cc.get_numpy(ns_c, keys), blocks) and fetched(c, transport) == 390
            # Sealed here now: c answers for itself, and the directory learns it.
            assert cc.lookup(ns_c, keys).matched == 400
            wait_matches(ca, ns_a, keys, {"a": 400, "b": 60, "c": 400})
            # The holder pinned the blocks only while it streamed them.
            assert a.metric("kvd_lease_pinned_blocks") == 0
            # An inline Get (no shared memory) fetches too.
            with Client(b.tcp_target, use_shared_memory=False) as inline:
                ns = inline.register_namespace(SMALL_SPEC)
                assert np.array_equal(inline.get_numpy(ns, keys[:100]), blocks[:100])
            # b has fetched once: its remote blocks are priced at that fetch's rate, the local ones free.
            priced = cb.lookup(ns_b, keys, include_remote=True, load_times=True).load_s
            assert priced[99] == 0 and 0 < priced[100] < priced[-1] < math.inf


def test_a_frozen_holder_costs_a_miss_within_the_deadline(tmp_path, etcd):
    prefix = "/kvd-fetch-2/"
    with run_daemon(tmp_path / "c", config(etcd, "c", prefix, fetch_timeout_s=1.0, rpc_timeout_s=0.5)) as c:
        a = start_daemon(tmp_path / "a", config(etcd, "a", prefix, lease_ttl_s=30))
        try:
            wait_metric(c, "kvd_cluster_members", 2)
            with Client(a.unix_target) as ca, Client(c.unix_target) as cc:
                ns_a, ns_c = ca.register_namespace(SMALL_SPEC), cc.register_namespace(SMALL_SPEC)
                keys = ns_a.keys(np.arange(200 * 16) + 3)
                blocks = random_blocks(SMALL_SPEC, 200, seed=6)
                assert ca.put(ns_a, keys, blocks) == 200
                assert cc.put(ns_c, keys[:5], blocks[:5]) == 5
                wait_matches(cc, ns_c, keys, {"a": 200, "c": 5})
                # Frozen: its member key stays alive (a long TTL), but it answers nothing.
                a.process.send_signal(signal.SIGSTOP)
                started = time.monotonic()
                got = cc.get_numpy(ns_c, keys)
                took = time.monotonic() - started
                assert got.shape[0] == 5 and np.array_equal(got, blocks[:5])
                assert took < 0.5 + 1.0 + 1.5, took
        finally:
            a.process.send_signal(signal.SIGCONT)
            a.stop()


BIG_SPEC = NamespaceSpec(model_id="fetch-kill", num_layers=8, num_kv_heads=8, head_dim=128, block_tokens=16,
                         kv_dtype=DType.FLOAT16)


@pytest.mark.parametrize("transport", ["nixl", "grpc"])
def test_a_holder_killed_mid_transfer_leaves_a_verified_prefix(tmp_path, etcd, transport):
    prefix = f"/kvd-fetch-kill-{transport}/"
    big = {"capacity_bytes": 256 << 20, "slot_bytes": 512 << 10}
    c_config = {**config(etcd, "c", prefix, transport=transport, fetch_timeout_s=5.0), "host": big}
    with run_daemon(tmp_path / "c", c_config) as c:
        a = start_daemon(tmp_path / "a", {**config(etcd, "a", prefix, transport=transport), "host": big})
        try:
            wait_metric(c, "kvd_cluster_members", 2)
            with Client(a.unix_target) as ca, Client(c.unix_target) as cc:
                ns_a, ns_c = ca.register_namespace(BIG_SPEC), cc.register_namespace(BIG_SPEC)
                keys = ns_a.keys(np.arange(300 * 16) + 77)
                blocks = np.random.default_rng(3).standard_normal((300, *BIG_SPEC.block_shape)).astype(np.float16)
                assert ca.put(ns_a, keys, blocks) == 300
                wait_matches(cc, ns_c, keys, {"a": 300})

                done = threading.Event()

                def kill_once_pinned():
                    """SIGKILL the holder as soon as it pins blocks for the fetch (or give up once the Get is over)."""
                    while not done.is_set():
                        try:
                            if a.metric("kvd_lease_pinned_blocks"):
                                a.process.send_signal(signal.SIGKILL)
                                return
                        except OSError:
                            return

                killer = threading.Thread(target=kill_once_pinned, daemon=True)
                killer.start()
                started = time.monotonic()
                got = cc.get_numpy(ns_c, keys)
                took = time.monotonic() - started
                done.set()
                killer.join(timeout=30)
                # Whatever arrived before the kill is exact; nothing else is served.
                assert np.array_equal(got, blocks[:got.shape[0]])
                assert took < 1.0 + 5.0 + 5.0 + 2.0, took
                assert cc.lookup(ns_c, keys).matched == got.shape[0]
        finally:
            a.process.kill()
            a.stop()


def test_a_tenants_blocks_reach_only_that_tenant_on_another_node(tmp_path, etcd):
    """Tenants (auth.mode = "token", the same tenants file on both nodes) register the same spec and
    so name their blocks by the same keys. What tenant a stored on x is remote for a on y, and is
    fetched with a's bytes; for tenant b on y it does not exist, in a Lookup or in a Get."""
    prefix = "/kvd-fetch-tenants/"
    tenants = write_tenants_file(tmp_path / "tenants.toml", {
        "a": {"token": "token-a-" + "1" * 24, "namespaces": ["*"]},
        "b": {"token": "token-b-" + "2" * 24, "namespaces": ["*"]}})
    auth = {"auth": {"mode": "token", "tenants_file": str(tenants)}}
    with run_daemon(tmp_path / "x", {**config(etcd, "x", prefix), **auth}) as x, \
            run_daemon(tmp_path / "y", {**config(etcd, "y", prefix), **auth}) as y:
        for daemon in (x, y):
            wait_metric(daemon, "kvd_cluster_members", 2)
        with Client(x.unix_target, token="token-a-" + "1" * 24) as a_on_x, \
                Client(y.unix_target, token="token-a-" + "1" * 24) as a_on_y, \
                Client(y.unix_target, token="token-b-" + "2" * 24) as b_on_y:
            ns = a_on_x.register_namespace(SPEC)
            keys = ns.keys(np.arange(40 * SPEC.block_tokens) + 5)
            assert a_on_x.put(ns, keys, tenant_blocks("a", keys)) == 40
            ns_a, ns_b = a_on_y.register_namespace(SPEC), b_on_y.register_namespace(SPEC)
            assert ns_a.namespace_id == ns_b.namespace_id  # the same id as each tenant knows it
            deadline = time.monotonic() + 15
            while a_on_y.lookup(ns_a, keys, include_remote=True).matched < 40:
                assert time.monotonic() < deadline, "the directory never learned a's blocks"
                time.sleep(0.05)
            assert b_on_y.lookup(ns_b, keys, include_remote=True).matched == 0
            assert b_on_y.get_numpy(ns_b, keys).shape[0] == 0
            assert fetched(y, "nixl") + fetched(y, "grpc") == 0
            got = a_on_y.get_numpy(ns_a, keys)
            assert got.tobytes() == tenant_blocks("a", keys).tobytes()
            assert b_on_y.get_numpy(ns_b, keys).shape[0] == 0  # now on y, still a's alone
