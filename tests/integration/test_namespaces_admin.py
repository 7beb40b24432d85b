"""An operator finds an engine's namespace and deletes it, through real daemons: `kvd namespaces`,
`kvd delete --namespace`, Client.namespaces and Client.delete_namespace (ListNamespaces and
DeleteNamespace), with a disk tier and after a restart, and with tenants (auth.mode = "token")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import grpc
import numpy as np
import pytest

from kvd.client import AmbiguousNamespace, AsyncClient, Client
from kvd.core.keys import DType, NamespaceSpec
from kvd.errors import InvalidArgument
from kvd.testing.daemon import DaemonProcess, run_daemon
from kvd.testing.tenants import write_tenants_file
from kvd.v1 import kvd_pb2, kvd_pb2_grpc

SLOT = 64 << 10
IDENTITY = "|vllm 0.32.0|cpu CPU_ATTN/vec|kv [blocks][2, 128, 128]|cache_dtype auto"
LLAMA = NamespaceSpec(model_id="llama-3-8b", model_revision=IDENTITY, num_layers=4, num_kv_heads=2, head_dim=64,
                      block_tokens=16, kv_dtype=DType.FLOAT32)
MISTRAL = NamespaceSpec(model_id="mistral-7b", model_revision="|vllm 0.32.0|tp 2", num_layers=4, num_kv_heads=2,
                        head_dim=64, block_tokens=16, kv_dtype=DType.FLOAT32, tp_rank=1, tp_size=2)
# A model_id that is the start of LLAMA's id: "kvd delete --namespace <that>" matches both.
HEXNAME = NamespaceSpec(model_id=LLAMA.namespace_id().hex()[:8], num_layers=4, num_kv_heads=2, head_dim=64,
                        block_tokens=16, kv_dtype=DType.FLOAT32)


def disk_config(tmp_path) -> dict:
    # fsync none: a DeleteNamespace makes its removals durable whatever the policy.
    return {
        "host": {"capacity_bytes": 32 * SLOT, "slot_bytes": SLOT},
        "disk": {"directories": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")], "capacity_bytes": 8 << 20,
                 "slot_bytes": SLOT, "segment_bytes": 4 << 20, "fsync": "none"},
    }


def blocks_for(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, *LLAMA.block_shape), dtype=np.float32)


def kvd(daemon: DaemonProcess, *args: str, token: str | None = None) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "KVD_TOKEN"}
    if token is not None:
        env["KVD_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "kvd", *args, "--state-dir", str(daemon.state_dir)],
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, env=env, check=False)


def listed(daemon: DaemonProcess, **token) -> dict:
    shown = kvd(daemon, "namespaces", "--json", **token)
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)


def expected_entry(spec: NamespaceSpec, blocks: int, host: int, disk: int, hits: int, misses: int) -> dict:
    tiers = {name: {"blocks": count, "payload_bytes": count * spec.block_bytes, "used_bytes": count * SLOT}
             for name, count in (("host", host), ("disk", disk))}
    return {
        "namespace_id": spec.namespace_id().hex(), "client_namespace_id": spec.namespace_id().hex(), "tenant": "",
        "model_id": spec.model_id, "model_revision": spec.model_revision,
        "spec": {"kv_dtype": "float32", "num_layers": 4, "num_kv_heads": 2, "head_dim": 64, "block_tokens": 16,
                 "inner_layout": "token_head_dim", "kv_order": "k_then_v", "tp_rank": spec.tp_rank,
                 "tp_size": spec.tp_size, "pp_stage": 0, "pp_size": 1, "lora_id": "", "hash_scheme": "sha256-v1",
                 "salted": False},
        "block_bytes": spec.block_bytes, "blocks": blocks, "tiers": tiers, "hits": hits, "misses": misses,
        "disk_enabled": True,
    }


def hits_and_misses(client: Client) -> dict[str, tuple[int, int]]:
    """Per model_id, as Stats counts them (the same counters ListNamespaces reports)."""
    return {ns.model_id: (ns.hits, ns.misses) for ns in client.stats().namespaces}


def _store(client: Client):
    """LLAMA: 3 blocks in host memory and on disk; MISTRAL: 5 on disk only, after a Demote."""
    llama, mistral = client.register_namespace(LLAMA), client.register_namespace(MISTRAL)
    llama_keys, mistral_keys = llama.keys(np.arange(3 * 16)), mistral.keys(np.arange(5 * 16))
    assert client.put(llama, llama_keys, blocks_for(3, 1), durable=True) == 3
    assert client.put(mistral, mistral_keys, blocks_for(5, 2), durable=True) == 5
    with client.get_pinned(llama, llama_keys) as held:  # LLAMA stays in host memory through the Demote
        assert held.matched == 3
        assert client.demote().blocks_demoted == 5
    return llama, llama_keys, mistral, mistral_keys


def test_an_operator_finds_namespaces_and_deletes_them_for_good(tmp_path):
    config = disk_config(tmp_path)
    with run_daemon(tmp_path / "d", config=config, check_clean_exit=False) as daemon, \
            Client(daemon.unix_target) as client:
        llama, llama_keys, mistral, mistral_keys = _store(client)
        counted = hits_and_misses(client)
        assert listed(daemon) == {"target": daemon.unix_target, "namespaces": [
            expected_entry(LLAMA, 3, host=3, disk=3, hits=counted[LLAMA.model_id][0],
                           misses=counted[LLAMA.model_id][1]),
            expected_entry(MISTRAL, 5, host=0, disk=5, hits=counted[MISTRAL.model_id][0],
                           misses=counted[MISTRAL.model_id][1]),
        ]}
        table = kvd(daemon, "namespaces").stdout.splitlines()
        assert table[0].split()[:4] == ["namespace", "model_id", "blocks", "host"]
        assert table[2].startswith(LLAMA.namespace_id().hex()[:16]) and table[2].endswith(IDENTITY)
        assert "5 (320.0 KiB)" in table[3]

        _refusals(daemon, client)
        # By id prefix, from the command line.
        hexname = client.register_namespace(HEXNAME)
        hexname_keys = hexname.keys(np.arange(2 * 16))
        assert client.put(hexname, hexname_keys, blocks_for(2, 3), durable=True) == 2
        ambiguous = kvd(daemon, "delete", "--namespace", HEXNAME.model_id, "--yes")
        assert ambiguous.returncode == 2 and ambiguous.stderr.splitlines() == [
            f"kvd: {HEXNAME.model_id!r} matches 2 namespaces; name one by a longer id prefix (or choose a tenant):",
            # In the listing's order: by model_id (hex digits sort before "l").
            f"  {HEXNAME.namespace_id().hex()[:16]} model_id {HEXNAME.model_id!r} model_revision ''",
            f"  {LLAMA.namespace_id().hex()[:16]} model_id 'llama-3-8b' model_revision {IDENTITY!r}"]
        deleted = kvd(daemon, "delete", "--namespace", f"id:{HEXNAME.model_id}", "--yes", "--json")
        assert deleted.returncode == 0, deleted.stderr
        assert json.loads(deleted.stdout) == {"namespace_id": LLAMA.namespace_id().hex(), "tenant": "",
                                              "model_id": "llama-3-8b", "deleted": 3, "pinned": 0}
        assert client.lookup(llama, llama_keys).matched == 0
        assert client.get_numpy(llama, llama_keys).shape[0] == 0

        # By name, through the client: blocks a lease pins stay, with their ancestors.
        with client.get_pinned(mistral, mistral_keys[:2]) as held:
            assert held.matched == 2
            first = client.delete_namespace("mistral-7b")
            assert (first.namespace.namespace_id, first.deleted, first.pinned) == (MISTRAL.namespace_id(), 3, 2)
            assert client.lookup(mistral, mistral_keys).matched == 2
        second = client.delete_namespace(MISTRAL.namespace_id().hex())
        assert (second.deleted, second.pinned) == (2, 0)
        assert client.get_numpy(mistral, mistral_keys).shape[0] == 0
        # The registrations stay: an engine goes on, and misses. (Durable: a write-back still in
        # flight would pin the block, and the Delete would leave it.)
        assert client.put(mistral, mistral_keys[:1], blocks_for(1, 4), durable=True) == 1
        assert client.delete_namespace("mistral-7b").deleted == 1
        # Unclean: nothing at shutdown may be needed for the deletions to hold.
        daemon.stop(signal.SIGKILL)
    with run_daemon(tmp_path / "d", config=config) as daemon, Client(daemon.unix_target) as client:
        assert client.lookup(client.register_namespace(LLAMA), llama_keys).matched == 0
        assert client.lookup(client.register_namespace(MISTRAL), mistral_keys).matched == 0
        again = client.register_namespace(HEXNAME)
        assert np.array_equal(client.get_numpy(again, hexname_keys), blocks_for(2, 3))
        shown = {entry["model_id"]: (entry["blocks"], entry["tiers"]["disk"]["blocks"])
                 for entry in listed(daemon)["namespaces"]}
        assert shown == {"llama-3-8b": (0, 0), "mistral-7b": (0, 0), HEXNAME.model_id: (2, 2)}


def _refusals(daemon: DaemonProcess, client: Client) -> None:
    """What names no namespace, or none validly, is refused, saying why; nothing is deleted."""
    unknown = kvd(daemon, "delete", "--namespace", "gemma", "--yes")
    assert (unknown.returncode, unknown.stderr) == (
        2, "kvd: no namespace has the model_id 'gemma', among the daemon's 2 namespaces "
           "(model_ids: 'llama-3-8b', 'mistral-7b')\n")
    for asked, why in (("id:xyz12345", "'id:xyz12345' is not an id: 'xyz12345' is not hexadecimal"),
                       ("", "a namespace's name or id must not be empty")):
        refused = kvd(daemon, "delete", "--namespace", asked, "--yes")
        assert refused.returncode == 2 and why in refused.stderr
        with pytest.raises(InvalidArgument) as error:
            client.delete_namespace(asked)
        assert why in error.value.message
    unconfirmed = kvd(daemon, "delete", "--namespace", "mistral-7b")
    assert unconfirmed.returncode == 2 and "pass --yes (stdin is not a terminal to confirm on)" in unconfirmed.stderr
    stub = kvd_pb2_grpc.KvdStub(grpc.insecure_channel(daemon.unix_target))
    with pytest.raises(grpc.RpcError) as short:
        stub.DeleteNamespace(kvd_pb2.DeleteNamespaceRequest(daemon_namespace_id=b"\x01" * 5))
    assert (short.value.code(), short.value.details()) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "daemon_namespace_id must be 32 bytes (a namespace_id ListNamespaces reports), got 5")
    with pytest.raises(grpc.RpcError) as unknown_id:
        stub.DeleteNamespace(kvd_pb2.DeleteNamespaceRequest(daemon_namespace_id=bytes(32)))
    assert (unknown_id.value.code(), unknown_id.value.details()) == (
        grpc.StatusCode.NOT_FOUND, f"no namespace has the daemon id {'00' * 32} (`kvd namespaces` lists them)")
    assert [entry["blocks"] for entry in listed(daemon)["namespaces"]] == [3, 5]


# ----------------------------------------------------------------------
# Tenants

TOKENS = {"a": "a-token-namespaces-0f1e", "b": "b-token-namespaces-2d3c", "ops": "ops-token-namespaces-4b5a"}
SHARED = NamespaceSpec(model_id="shared-model", num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16,
                       kv_dtype=DType.FLOAT32)


def test_only_an_admin_lists_and_deletes_and_a_name_two_tenants_use_is_ambiguous(tmp_path):
    tenants = write_tenants_file(tmp_path / "tenants.toml", {
        "a": {"token": TOKENS["a"], "namespaces": ["*"]},
        "b": {"token": TOKENS["b"], "namespaces": ["*"]},
        "ops": {"token": TOKENS["ops"], "namespaces": [], "admin": True},
    })
    config = {"host": {"capacity_bytes": 32 * SLOT, "slot_bytes": SLOT},
              "auth": {"mode": "token", "tenants_file": str(tenants)}}
    with run_daemon(tmp_path / "d", config=config) as daemon, Client(daemon.unix_target, token=TOKENS["a"]) as a, \
            Client(daemon.unix_target, token=TOKENS["b"]) as b, \
            Client(daemon.unix_target, token=TOKENS["ops"]) as ops:
        spaces = {"a": a.register_namespace(SHARED), "b": b.register_namespace(SHARED)}
        keys = spaces["a"].keys(np.arange(2 * 16))
        for name, client in (("a", a), ("b", b)):
            assert client.put(spaces[name], keys, blocks_for(2, 5)) == 2
        daemon_ids = {info.tenant: info.namespace_id for info in ops.namespaces()}
        assert set(daemon_ids) == {"a", "b"} and SHARED.namespace_id() not in daemon_ids.values()

        # A tenant that is not an admin can neither list nor delete, its own or another's.
        stub = kvd_pb2_grpc.KvdStub(grpc.insecure_channel(daemon.unix_target))
        denied = (("authorization", f"Bearer {TOKENS['a']}"),)
        for call, request in ((stub.ListNamespaces, kvd_pb2.ListNamespacesRequest()),
                              (stub.ListNamespaces, kvd_pb2.ListNamespacesRequest(tenant="b")),
                              (stub.DeleteNamespace, kvd_pb2.DeleteNamespaceRequest(daemon_namespace_id=daemon_ids["b"])),
                              (stub.DeleteNamespace, kvd_pb2.DeleteNamespaceRequest(daemon_namespace_id=daemon_ids["a"]))):
            with pytest.raises(grpc.RpcError) as error:
                call(request, metadata=denied)
            assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "is administrative; tenant 'a' is not an admin" in error.value.details()
        with pytest.raises(grpc.RpcError) as error:
            a.delete_namespace("shared-model")
        assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
        refused = kvd(daemon, "delete", "--namespace", "shared-model", "--tenant", "b", "--yes", token=TOKENS["a"])
        assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr
        assert kvd(daemon, "namespaces", token=TOKENS["b"]).returncode == 1
        assert b.lookup(spaces["b"], keys).matched == 2

        # The admin sees both; the name, and the id their clients share, are ambiguous until a tenant is chosen.
        for asked in ("shared-model", SHARED.namespace_id().hex()[:12]):
            with pytest.raises(AmbiguousNamespace) as ambiguous:
                ops.find_namespace(asked)
            assert [candidate.tenant for candidate in ambiguous.value.candidates] == ["a", "b"]
        entries = listed(daemon, token=TOKENS["ops"])["namespaces"]
        assert [(entry["tenant"], entry["namespace_id"], entry["client_namespace_id"], entry["blocks"])
                for entry in entries] == [("a", daemon_ids["a"].hex(), SHARED.namespace_id().hex(), 2),
                                          ("b", daemon_ids["b"].hex(), SHARED.namespace_id().hex(), 2)]
        assert [info.tenant for info in ops.namespaces(tenant="b")] == ["b"]
        deleted = kvd(daemon, "delete", "--namespace", "shared-model", "--tenant", "b", "--yes", token=TOKENS["ops"])
        assert deleted.returncode == 0, deleted.stderr
        assert deleted.stdout.startswith(f"deleted 2 blocks of namespace {daemon_ids['b'].hex()[:16]} tenant 'b' ")
        assert (a.lookup(spaces["a"], keys).matched, b.lookup(spaces["b"], keys).matched) == (2, 0)

        async def through_the_async_client() -> tuple[int, int]:
            async with AsyncClient(daemon.unix_target, token=TOKENS["ops"]) as admin:
                listed_a = await admin.namespaces(tenant="a")
                done = await admin.delete_namespace(listed_a[0])
                return done.deleted, len(listed_a)

        import asyncio

        assert asyncio.run(through_the_async_client()) == (2, 1)
        assert a.lookup(spaces["a"], keys).matched == 0
