"""Two nodes, two vLLMs: a prefix computed beside node A is loaded by the vLLM beside node B (issue 37).

Real components: etcd, two kvd daemons in two network namespaces joined by veths (NIXL with
UCX over TCP, so the bytes really cross the veth), a vLLM process beside each daemon (its
connector on the daemon's unix socket). vLLM A serves a prompt and stores its blocks in A;
vLLM B serves the same prefix with another suffix: its connector's Lookup counts A's blocks
(TIER_REMOTE), the load fetches them under B's own blocks, and B answers exactly as vLLM
alone does; the same with B's KV tensors registered with kvd (transfer = "daemon"), kvd copying
the fetched blocks in itself. Then A is SIGKILLed between B's Lookup and its load: the blocks are reported,
vLLM recomputes them, the answer is still exact, and A holds no pins after its restart.
"""

from __future__ import annotations

import os

import pytest

from kvd.client import Client
from kvd.core.keys import chain_keys
from kvd.testing import tiny_llama
from kvd.testing.daemon import start_daemon
from kvd.testing.etcd import EtcdServer
from kvd.testing.netns import Network
from tests.cluster.test_cluster_lookup import wait_matches
from tests.cluster.test_daemon_cluster import cluster_config, wait_metric
from tests.cluster.test_netns import UCX_OVER_TCP, veth_received
from tests.cluster.test_remote_fetch import failed_fetches, fetched
from tests.engines.test_vllm_connector import (BLOCK, KVD_CONFIG, LOGPROB_TOLERANCE, PREFIX_TOKENS, VllmRun,
                                               namespace_spec, prompts, run_vllm, same_answer)

pytestmark = pytest.mark.slow

SHARED = PREFIX_TOKENS // BLOCK


def node_config(etcd: EtcdServer, name: str) -> dict:
    config = cluster_config(etcd, name, "/kvd-vllm-cluster/")
    config["cluster"].update(fetch_timeout_s=5.0, rpc_timeout_s=2.0)
    config["host"] = KVD_CONFIG["host"]
    config["device"] = KVD_CONFIG["device"]  # for vLLM B's transfer = "daemon"
    return config


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama.build(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    """etcd and daemons a and b, each on its own 'host' (a network namespace on a bridge)."""
    if os.geteuid() != 0:
        pytest.fail("network namespaces need root (CI runs as root)")
    work = tmp_path_factory.mktemp("nodes")
    with Network(2) as net:
        etcd = EtcdServer(host=net.gateway).start()
        started = []
        try:
            for index, name in enumerate("ab"):
                started.append(start_daemon(work / name, node_config(etcd, name), UCX_OVER_TCP, net.hosts[index]))
            for daemon in started:
                wait_metric(daemon, "kvd_cluster_members", 2)
            yield net, etcd, work, started
        finally:
            for daemon in started:
                daemon.stop()
            etcd.close()


@pytest.fixture(scope="module")
def alone(engine_python, model, tmp_path_factory) -> VllmRun:
    """vLLM without kvd on prompts B, D and C (the answers to match), started at once, in the background."""
    return VllmRun(engine_python, model, tmp_path_factory.mktemp("alone"),
                   [prompts()["B"], prompts()["D"], prompts()["C"]])


@pytest.fixture(scope="module")
def stored_on_a(engine_python, model, nodes, alone, tmp_path_factory) -> dict:
    """vLLM A beside daemon a serves prompts A, D and C: their blocks are stored in a."""
    a = nodes[3][0]
    batch = [prompts()["A"], prompts()["D"], prompts()["C"]]
    report = run_vllm(engine_python, model, tmp_path_factory.mktemp("A"), batch, target=a.unix_target)
    assert report["connector"]["totals"]["saved_blocks"] == sum(len(prompt) // BLOCK for prompt in batch)
    return report


def test_a_prefix_computed_on_one_node_is_loaded_by_vllm_on_another(engine_python, model, nodes, alone, stored_on_a,
                                                                     tmp_path):
    net, _, _, (a, b) = nodes
    spec = namespace_spec()
    keys = chain_keys(spec, prompts()["B"])[:SHARED]
    with Client(b.unix_target) as client:
        namespace = client.register_namespace(spec)
        wait_matches(client, namespace, keys, {"a": SHARED})
        assert client.lookup(namespace, keys, include_remote=True).tiers == [4] * SHARED
    sent_before = veth_received(net, 0)

    loaded = run_vllm(engine_python, model, tmp_path / "B", [prompts()["B"]], target=b.unix_target)
    result, totals = loaded["results"][0], loaded["connector"]["totals"]
    assert same_answer(result, alone.report()["results"][0]) <= LOGPROB_TOLERANCE
    # vLLM did not compute the prefix: kvd on b fetched it from a, over the veth, and loaded it.
    assert result["cached_tokens"] == SHARED * BLOCK
    assert totals["loaded_blocks"] == SHARED and totals["load_errors"] == 0 and totals["async_loads"] == 1
    assert totals["loaded_tokens"] == SHARED * BLOCK and totals["recomputed_tokens"] == 0
    assert fetched(b, "nixl", peer="a") == SHARED and failed_fetches(b) == 0
    assert veth_received(net, 0) - sent_before >= SHARED * spec.block_bytes
    assert a.metric("kvd_lease_pinned_blocks") == 0


def test_with_transfer_daemon_the_daemon_fetches_the_prefix_and_copies_it_into_vllms_tensors(
        engine_python, model, nodes, alone, stored_on_a, tmp_path):
    """vLLM B with transfer = "daemon" (its KV tensors registered with b's device plane): b fetches
    prompt C's blocks from a and copies them into vLLM's tensors itself; the answer is exact."""
    _, _, _, (a, b) = nodes
    prompt = prompts()["C"]  # b holds none of it
    spec = namespace_spec()
    keys = chain_keys(spec, prompt)
    with Client(b.unix_target) as client:
        wait_matches(client, client.register_namespace(spec), keys, {"a": len(keys)})
    fetched_before = fetched(b, "nixl", peer="a")

    report = run_vllm(engine_python, model, tmp_path / "B", [prompt], target=b.unix_target, transfer="daemon")
    result, totals = report["results"][0], report["connector"]["totals"]
    assert same_answer(result, alone.report()["results"][2]) <= LOGPROB_TOLERANCE
    assert result["cached_tokens"] == len(keys) * BLOCK
    assert totals["loaded_blocks"] == len(keys) and totals["load_errors"] == 0
    assert fetched(b, "nixl", peer="a") - fetched_before == len(keys)
    assert b.metric_samples("kvd_device_blocks_total")['kvd_device_blocks_total{op="load"}'] == len(keys)
    assert a.metric("kvd_lease_pinned_blocks") == 0


def test_a_holder_killed_between_lookup_and_load_costs_a_recompute_not_a_wrong_answer(
        engine_python, model, nodes, alone, stored_on_a, tmp_path):
    net, etcd, work, daemons = nodes
    a, b = daemons
    prompt = prompts()["D"]  # a chain of its own: b holds none of it
    spec = namespace_spec()
    keys = chain_keys(spec, prompt)
    with Client(b.unix_target) as client:
        wait_matches(client, client.register_namespace(spec), keys, {"a": len(keys)})
    fetched_before = fetched(b, "nixl") + fetched(b, "grpc")

    report = run_vllm(engine_python, model, tmp_path / "B", [prompt], target=b.unix_target, hooks="kill",
                      env={"KVD_TEST_DAEMON_PID": str(a.pid)})
    result, totals = report["results"][0], report["connector"]["totals"]
    assert result["fired"] == ["kill"]
    assert same_answer(result, alone.report()["results"][1]) <= LOGPROB_TOLERANCE
    assert totals["loaded_blocks"] == 0 and totals["load_errors"] == len(keys)
    assert totals["recomputed_tokens"] == len(keys) * BLOCK
    assert fetched(b, "nixl") + fetched(b, "grpc") == fetched_before  # nothing of this chain arrived
    # a comes back on its drive-less state: empty, nothing pinned for anyone.
    a.process.wait()
    daemons[0] = start_daemon(work / "a", node_config(etcd, "a"), UCX_OVER_TCP, net.hosts[0])
    wait_metric(daemons[0], "kvd_cluster_members", 2, timeout_s=30)
    assert daemons[0].metric("kvd_lease_pinned_blocks") == 0
    with Client(daemons[0].unix_target) as client:
        assert client.lookup(client.register_namespace(spec), keys).matched == 0
