"""ClusterLookup across real daemons: the directory follows Puts, Deletes, namespaces and crashes."""

from __future__ import annotations

import math
import signal
import time

import grpc
import numpy as np
import pytest

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec
from kvd.testing.daemon import run_daemon, start_daemon
from kvd.v1 import kvd_pb2, kvd_pb2_grpc
from tests.cluster.test_daemon_cluster import SECRET, TTL_S, cluster_config, wait_metric
from tests.integration.conftest import SMALL_SPEC, random_blocks

OTHER_SPEC = NamespaceSpec(model_id="other-model", num_layers=4, num_kv_heads=2, head_dim=16, block_tokens=16,
                           kv_dtype=DType.FLOAT32)


def matches(client: Client, namespace, keys) -> dict[str, int]:
    return {n.node: n.matched for n in client.cluster_lookup(namespace, keys).nodes}


def wait_matches(client: Client, namespace, keys, expected: dict[str, int], timeout_s: float = 15.0) -> float:
    started = time.monotonic()
    while (seen := matches(client, namespace, keys)) != expected:
        assert time.monotonic() - started < timeout_s, f"saw {seen}, expected {expected}"
        time.sleep(0.05)
    return time.monotonic() - started


def test_cluster_lookup_follows_puts_deletes_and_a_crash(tmp_path, etcd):
    prefix = "/kvd-lookup-1/"
    with run_daemon(tmp_path / "b", cluster_config(etcd, "b", prefix)) as b, \
            run_daemon(tmp_path / "c", cluster_config(etcd, "c", prefix)) as c:
        a = start_daemon(tmp_path / "a", cluster_config(etcd, "a", prefix))
        try:
            for daemon in (a, b, c):
                wait_metric(daemon, "kvd_cluster_members", 3)
            with Client(a.unix_target) as ca, Client(b.unix_target) as cb, Client(c.unix_target) as cc:
                ns_a, ns_b, ns_c = (client.register_namespace(SMALL_SPEC) for client in (ca, cb, cc))
                keys = ns_a.keys(np.arange(300 * 16) + 7)
                blocks = random_blocks(SMALL_SPEC, 300, seed=4)
                assert ca.put(ns_a, keys, blocks) == 300
                assert cb.put(ns_b, keys[:50], blocks[:50]) == 50
                wait_matches(cc, ns_c, keys, {"a": 300, "b": 50})
                # Lookup can count what peers hold, as TIER_REMOTE.
                result = cb.lookup(ns_b, keys, include_remote=True)
                assert result.matched == 300 and result.tiers == [2] * 50 + [4] * 250
                assert cb.lookup(ns_b, keys).matched == 50
                # ... also for keys that continue a parent stored here (what an engine holding a
                # local prefix asks), and "where there is a cluster" asks too.
                result = cb.lookup(ns_b, keys[30:], parent_key=keys[29], include_remote=None)
                assert result.matched == 270 and result.tiers == [2] * 20 + [4] * 250
                assert cb.session.in_cluster is True
                assert cb.lookup(ns_b, keys[50:], parent_key=keys[49], include_remote=True).tiers == [4] * 250
                # A parent not stored here (b holds 50): nothing of a peer can continue it here.
                assert cb.lookup(ns_b, keys[61:], parent_key=keys[60], include_remote=True).matched == 0
                answer = ca.cluster_lookup(ns_a, keys)
                assert [(n.node, n.matched, n.local) for n in answer.nodes] == [("a", 300, True), ("b", 50, False)]
                assert answer.segments >= 2 and answer.segments_unanswered == 0
                assert answer.nodes[1].address == b.tcp_target.removeprefix("ipv4:").removeprefix("dns:")
                # A shorter query, and one that goes past what anyone holds.
                assert matches(cc, ns_c, keys[:20]) == {"a": 20, "b": 20}
                longer = ns_a.keys(np.arange(320 * 16) + 7)
                assert matches(cc, ns_c, longer) == {"a": 300, "b": 50}
                # The same keys in another namespace are not these blocks.
                other = cc.register_namespace(OTHER_SPEC)
                assert matches(cc, other, keys) == {}
                # A Delete on a shortens its match everywhere.
                ca.delete(ns_a, keys[120:])
                wait_matches(cc, ns_c, keys, {"a": 120, "b": 50})
            a.process.send_signal(signal.SIGKILL)
            a.process.wait()
            with Client(c.unix_target) as cc:
                ns_c = cc.register_namespace(SMALL_SPEC)
                took = wait_matches(cc, ns_c, keys, {"b": 50}, timeout_s=TTL_S + 10)
                assert took <= TTL_S + 3.0, f"a crashed holder left the lookups after {took:.1f} s"
        finally:
            a.stop()


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_dead_directory_replica_is_answered_for_by_the_other(tmp_path, etcd, replicas):
    """b dies but its member key lives on (a long lease): with one replica per segment, b's
    segments go unanswered until the lease ends; with two, the lookup asks the other one."""
    prefix = f"/kvd-lookup-replicas-{replicas}/"

    def config(name: str, ttl_s: int = TTL_S) -> dict:
        values = cluster_config(etcd, name, prefix)
        values["cluster"].update(directory_replicas=replicas, segment_blocks=16, lease_ttl_s=ttl_s)
        return values

    with run_daemon(tmp_path / "a", config("a")) as a, run_daemon(tmp_path / "c", config("c")) as c:
        b = start_daemon(tmp_path / "b", config("b", ttl_s=60))
        try:
            for daemon in (a, b, c):
                wait_metric(daemon, "kvd_cluster_members", 3)
            with Client(a.unix_target) as ca, Client(c.unix_target) as cc:
                ns_a, ns_c = ca.register_namespace(SMALL_SPEC), cc.register_namespace(SMALL_SPEC)
                keys = ns_a.keys(np.arange(300 * 16) + 17)
                assert ca.put(ns_a, keys, random_blocks(SMALL_SPEC, 300, seed=8)) == 300
                wait_matches(cc, ns_c, keys, {"a": 300})
                b.process.send_signal(signal.SIGKILL)
                b.process.wait()
                answer = cc.cluster_lookup(ns_c, keys)
                assert answer.segments >= 10
                if replicas == 1:
                    # b owned some of the segments: the match stops at the first of them.
                    assert answer.segments_unanswered > 0
                    assert [n.matched for n in answer.nodes] < [300]
                else:
                    assert answer.segments_unanswered == 0
                    assert [(n.node, n.matched) for n in answer.nodes] == [("a", 300)]
                assert c.metric("kvd_cluster_members") == 3  # b is still a member all along
        finally:
            b.stop()


def test_cluster_rpcs_refuse_bad_calls(tmp_path, etcd):
    with run_daemon(tmp_path / "a", cluster_config(etcd, "a", "/kvd-lookup-2/")) as a, \
            run_daemon(tmp_path / "solo") as solo:
        wait_metric(a, "kvd_cluster_members", 1)
        with Client(a.unix_target) as client, Client(solo.unix_target) as solo_client:
            namespace = client.register_namespace(SMALL_SPEC)
            keys = namespace.keys(np.arange(4 * 16))
            with pytest.raises(grpc.RpcError) as caught:
                solo_client.cluster_lookup(solo_client.register_namespace(SMALL_SPEC), keys)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            solo_namespace = solo_client.register_namespace(SMALL_SPEC)
            with pytest.raises(grpc.RpcError) as caught:
                solo_client.lookup(solo_namespace, keys, include_remote=True)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "not in a cluster" in caught.value.details()
            # "Where there is a cluster": a daemon outside one is asked once, then never again.
            assert solo_client.put(solo_namespace, keys, random_blocks(SMALL_SPEC, 4, seed=1)) == 4
            assert solo_client.lookup(solo_namespace, keys, include_remote=None).tiers == [2] * 4
            assert solo_client.session.in_cluster is False
            assert solo_client.lookup(solo_namespace, keys, include_remote=None).matched == 4
        with grpc.insecure_channel(a.tcp_target) as channel:
            kvd = kvd_pb2_grpc.KvdStub(channel)
            for packed, words in ((b"", "non-empty"), (b"x" * 33, "33 bytes")):
                with pytest.raises(grpc.RpcError) as caught:
                    kvd.ClusterLookup(kvd_pb2.ClusterLookupRequest(namespace_id=namespace.namespace_id,
                                                                   packed_keys=packed))
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in caught.value.details()
            cluster = kvd_pb2_grpc.ClusterStub(channel)
            query = kvd_pb2.DirectoryQueryRequest(segments=[b"k" * 32])
            for metadata in ((), (("x-kvd-cluster-secret", "wrong-secret-wrong-secret"),)):
                with pytest.raises(grpc.RpcError) as caught:
                    cluster.DirectoryQuery(query, metadata=metadata)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            good = (("x-kvd-cluster-secret", SECRET),)
            assert list(cluster.DirectoryQuery(query, metadata=good).segments[0].holder_counts) == []
            with pytest.raises(grpc.RpcError) as caught:
                cluster.DirectoryQuery(kvd_pb2.DirectoryQueryRequest(segments=[b"k" * 31]), metadata=good)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            # PriceBlocks: the credential first, then whole keys; a namespace never seen holds nothing.
            price = kvd_pb2.PriceBlocksRequest(namespace_id=namespace.namespace_id, packed_keys=b"".join(keys))
            with pytest.raises(grpc.RpcError) as caught:
                cluster.PriceBlocks(price)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as caught:
                cluster.PriceBlocks(kvd_pb2.PriceBlocksRequest(packed_keys=b"k" * 31), metadata=good)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "31 bytes" in caught.value.details()
            unknown = kvd_pb2.PriceBlocksRequest(namespace_id=b"n" * 16, packed_keys=b"".join(keys))
            assert cluster.PriceBlocks(unknown, metadata=good).matched == 0
            # Only a live member, under its current incarnation, may write entries.
            update = kvd_pb2.DirectoryUpdateRequest(node="intruder", incarnation=1, stored_keys=b"k" * 32)
            with pytest.raises(grpc.RpcError) as caught:
                cluster.DirectoryUpdate(update, metadata=good)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            update = kvd_pb2.DirectoryUpdateRequest(node="a", incarnation=1, stored_keys=b"k" * 32)
            with pytest.raises(grpc.RpcError) as caught:
                cluster.DirectoryUpdate(update, metadata=good)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_a_holder_restarted_with_its_disk_tier_is_found_and_fetched_from_again(tmp_path, etcd):
    prefix = "/kvd-lookup-3/"
    disk = {"directories": [str(tmp_path / "a-nvme")], "capacity_bytes": 64 << 20, "slot_bytes": 64 << 10,
            "segment_bytes": 16 << 20, "fsync": "strict"}
    a_config = {**cluster_config(etcd, "a", prefix), "disk": disk}
    with run_daemon(tmp_path / "c", cluster_config(etcd, "c", prefix)) as c:
        a = start_daemon(tmp_path / "a", a_config)
        try:
            with Client(a.unix_target) as ca:
                ns_a = ca.register_namespace(SMALL_SPEC)
                keys = ns_a.keys(np.arange(80 * 16) + 5)
                blocks = random_blocks(SMALL_SPEC, 80, seed=9)
                assert ca.put(ns_a, keys, blocks, durable=True) == 80
            with Client(c.unix_target) as cc:
                ns_c = cc.register_namespace(SMALL_SPEC)
                wait_matches(cc, ns_c, keys, {"a": 80})
                a.process.send_signal(signal.SIGKILL)
                a.process.wait()
                wait_matches(cc, ns_c, keys, {}, timeout_s=TTL_S + 10)
                a = start_daemon(tmp_path / "a", a_config)
                # Recovered from its disk, published again under the new incarnation.
                wait_matches(cc, ns_c, keys, {"a": 80}, timeout_s=15)
                # Priced by a itself (PriceBlocks): on its disk, so not free (NaN: no read measured yet).
                priced = {node.node: node for node in cc.cluster_lookup(ns_c, keys, load_times=True).nodes}
                assert priced["a"].matched == 80 and not priced["a"].load_s <= 0.0
                got = cc.get_numpy(ns_c, keys)
                assert np.array_equal(got, blocks)
                # c holds them now, in host memory: free here. a read them, so it knows its drive's rate;
                # with its copies back on disk only, it prices them at that rate.
                with Client(a.unix_target) as ca:
                    assert ca.demote().blocks_demoted >= 80
                priced = {node.node: node for node in cc.cluster_lookup(ns_c, keys, load_times=True).nodes}
                assert priced["c"].local and priced["c"].matched == 80 and priced["c"].load_s == 0.0
                assert priced["a"].matched == 80 and 0.0 < priced["a"].load_s < 60.0
                assert math.isnan(cc.cluster_lookup(ns_c, keys).nodes[0].load_s)  # not asked for
        finally:
            a.stop()
