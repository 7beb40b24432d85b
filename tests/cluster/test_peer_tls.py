"""TLS between nodes: where the listeners use mutual TLS, peers call each other over it, and a node
whose certificate is not of the cluster's CA gets nothing from the others (and gives them nothing)."""

from __future__ import annotations

import numpy as np

from kvd.client import Client
from kvd.testing.certs import make_certificates
from kvd.testing.daemon import run_daemon
from tests.cluster.test_cluster_lookup import wait_matches
from tests.cluster.test_daemon_cluster import wait_metric
from tests.cluster.test_remote_fetch import config, fetched
from tests.integration.conftest import SMALL_SPEC, random_blocks


def tls_config(etcd, name: str, prefix: str, cert, key, ca, **cluster) -> dict:
    values = config(etcd, name, prefix, **cluster)
    values["server"] = {"tls_cert_file": str(cert), "tls_key_file": str(key), "tls_client_ca_file": str(ca)}
    return values


def test_nodes_with_mutual_tls_fetch_from_each_other_over_it(tmp_path, etcd):
    certs = make_certificates(tmp_path / "certs")
    prefix = "/kvd-tls-1/"
    node = (certs.node_cert, certs.node_key, certs.ca)
    # c checks its peers' certificates for the name "localhost" (they carry it) instead of 127.0.0.1.
    with run_daemon(tmp_path / "a", tls_config(etcd, "a", prefix, *node)) as a, \
            run_daemon(tmp_path / "c", tls_config(etcd, "c", prefix, *node, peer_server_name="localhost")) as c:
        for daemon in (a, c):
            wait_metric(daemon, "kvd_cluster_members", 2)
        with Client(a.unix_target) as ca, Client(c.unix_target) as cc:
            ns_a, ns_c = ca.register_namespace(SMALL_SPEC), cc.register_namespace(SMALL_SPEC)
            keys = ns_a.keys(np.arange(300 * 16) + 5)
            blocks = random_blocks(SMALL_SPEC, 300, seed=21)
            assert ca.put(ns_a, keys, blocks) == 300
            # The directory updates crossed TLS both ways (each node owns some segments).
            wait_matches(cc, ns_c, keys, {"a": 300})
            wait_matches(ca, ns_a, keys, {"a": 300})
            assert np.array_equal(cc.get_numpy(ns_c, keys), blocks)
            # NIXL would not encrypt: with TLS the blocks came over the gRPC stream.
            assert fetched(c, "grpc") == 300 and fetched(c, "nixl") == 0
            assert a.metric("kvd_lease_pinned_blocks") == 0


def test_a_node_with_a_certificate_of_another_ca_shares_nothing(tmp_path, etcd):
    certs = make_certificates(tmp_path / "certs")
    prefix = "/kvd-tls-2/"
    # s trusts the cluster's CA, but its own certificate is from another one: a refuses its
    # calls and will not call it. Both are members (etcd is not what checks the certificates).
    stranger = (certs.stranger_cert, certs.stranger_key, certs.ca)
    with run_daemon(tmp_path / "a", tls_config(etcd, "a", prefix, certs.node_cert, certs.node_key, certs.ca)) as a, \
            run_daemon(tmp_path / "s", tls_config(etcd, "s", prefix, *stranger, rpc_timeout_s=0.5,
                                                   fetch_timeout_s=1.0)) as s:
        for daemon in (a, s):
            wait_metric(daemon, "kvd_cluster_members", 2)
        with Client(a.unix_target) as ca, Client(s.unix_target) as cs:
            ns_a, ns_s = ca.register_namespace(SMALL_SPEC), cs.register_namespace(SMALL_SPEC)
            keys = ns_a.keys(np.arange(300 * 16) + 9)
            blocks = random_blocks(SMALL_SPEC, 300, seed=22)
            assert ca.put(ns_a, keys, blocks) == 300
            assert cs.put(ns_s, keys[:4], blocks[:4]) == 4
            # a's own lookup sees itself, and nothing from s (whose updates it refused).
            wait_matches(ca, ns_a, keys, {"a": 300})
            # s cannot ask a's segments' owner, and a never told s about its blocks.
            seen = cs.cluster_lookup(ns_s, keys)
            assert "a" not in {n.node for n in seen.nodes}, seen
            got = cs.get_numpy(ns_s, keys)
            assert got.shape[0] == 4 and np.array_equal(got, blocks[:4])
            assert fetched(s, "grpc") == 0 and fetched(s, "nixl") == 0
            assert a.metric("kvd_lease_pinned_blocks") == 0
