"""Tenants, tokens, quotas and TLS through a real daemon (auth.mode = "token").

One daemon serves the tests of this module, with four tenants:

    a      token by SHA-256 in the tenants file, any model
    b      token from an environment variable, any model
    small  only SMALL_SPEC's model, a host quota of three slots
    ops    an admin, no model at all

The TLS tests and the restart test start daemons of their own.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd import arena_protocol
from kvd.client import Client, TlsConfig
from kvd.core.keys import DType, NamespaceSpec
from kvd.errors import FailedPrecondition, Unauthenticated
from kvd.testing.certs import make_certificates
from kvd.testing.daemon import run_daemon
from kvd.testing.tenants import write_tenants_file
from kvd.v1 import kvd_pb2, kvd_pb2_grpc
from tests.integration.conftest import SMALL_SPEC, random_blocks

TOKEN_A = "a-token-for-tenant-a-7c1f0e"
TOKEN_B = "b-token-for-tenant-b-93d2aa"
TOKEN_SMALL = "small-token-for-tenant-small-11"
TOKEN_OPS = "ops-token-for-the-admin-5e6f7a"
WRONG_TOKEN = "not-a-token-kvd-knows-0000"
SLOT_BYTES = 64 << 10
SMALL_QUOTA_SLOTS = 3


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def tenants_file(directory: Path) -> Path:
    return write_tenants_file(directory / "tenants.toml", {
        "a": {"token": TOKEN_A, "namespaces": ["*"]},
        "b": {"token_env": "KVD_TEST_TOKEN_B", "namespaces": ["*"]},
        "small": {"token": TOKEN_SMALL, "namespaces": [SMALL_SPEC.model_id],
                  "host_bytes": SMALL_QUOTA_SLOTS * SLOT_BYTES},
        "ops": {"token": TOKEN_OPS, "namespaces": [], "admin": True},
    })


def auth_config(directory: Path, **extra) -> dict:
    config = {
        "host": {"capacity_bytes": 16 << 20, "slot_bytes": SLOT_BYTES},
        "auth": {"mode": "token", "tenants_file": str(tenants_file(directory))},
        "log": {"level": "debug"},
    }
    for section, settings in extra.items():
        config.setdefault(section, {}).update(settings)
    return config


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kvd-auth")
    with run_daemon(directory, config=auth_config(directory), env={"KVD_TEST_TOKEN_B": TOKEN_B}) as process:
        yield process


def metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def code_of(call, *args, **kwargs) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        result = call(*args, **kwargs)
        if hasattr(result, "__next__"):
            next(result)
    return error.value.code()


def test_tenants_with_identical_specs_and_keys_never_see_each_others_blocks(daemon):
    with Client(daemon.unix_target, token=TOKEN_A) as a, Client(daemon.unix_target, token=TOKEN_B) as b:
        namespace_a, namespace_b = a.register_namespace(SMALL_SPEC), b.register_namespace(SMALL_SPEC)
        # Both know their namespace by the same id, the digest of the spec they sent.
        assert namespace_a.namespace_id == namespace_b.namespace_id == SMALL_SPEC.namespace_id()
        keys = namespace_a.keys(np.arange(4 * SMALL_SPEC.block_tokens))
        assert keys == namespace_b.keys(np.arange(4 * SMALL_SPEC.block_tokens))
        blocks_a = random_blocks(SMALL_SPEC, 4, seed=1)
        assert a.put(namespace_a, keys, blocks_a) == 4

        # b looks, reads, prefetches, snapshots and deletes under the very same keys: nothing.
        assert b.lookup(namespace_b, keys).matched == 0
        assert b.get_numpy(namespace_b, keys).shape[0] == 0
        assert b.prefetch(namespace_b, keys).matched == 0
        assert b.event_snapshot(namespace_b).keys == []
        assert b.delete(namespace_b, keys) == (0, 0)
        assert a.lookup(namespace_a, keys).matched == 4

        # b's Put of the same keys writes b's own blocks: nothing aliases.
        blocks_b = random_blocks(SMALL_SPEC, 2, seed=2)
        stub = kvd_pb2_grpc.KvdStub(grpc.insecure_channel(daemon.unix_target))
        watch_a = stub.WatchEvents(kvd_pb2.WatchEventsRequest(namespace_id=namespace_a.namespace_id),
                                   metadata=metadata(TOKEN_A))
        watching = next(watch_a)
        assert (watching.kind, watching.namespace_id) == (kvd_pb2.KV_EVENT_KIND_WATCHING, namespace_a.namespace_id)
        assert b.put(namespace_b, keys[:2], blocks_b) == 2
        assert np.array_equal(b.get_numpy(namespace_b, keys), blocks_b)
        assert np.array_equal(a.get_numpy(namespace_a, keys), blocks_a)
        assert b.event_snapshot(namespace_b).keys == keys[:2]
        assert a.event_snapshot(namespace_a).keys == keys

        # a's watch saw none of b's events: its next one is its own Delete.
        assert a.delete(namespace_a, keys[3:]) == (1, 0)
        removed = next(watch_a)
        watch_a.cancel()
        assert (removed.kind, list(removed.keys), removed.namespace_id) == (
            kvd_pb2.KV_EVENT_KIND_REMOVED, keys[3:], namespace_a.namespace_id)
        assert b.lookup(namespace_b, keys).matched == 2


def test_concurrent_calls_of_two_tenants_each_run_as_their_own_tenant(daemon):
    from concurrent.futures import ThreadPoolExecutor

    spec = NamespaceSpec(model_id="concurrent-model", num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=4,
                         kv_dtype=DType.FLOAT32)
    with Client(daemon.unix_target, token=TOKEN_A) as a, Client(daemon.unix_target, token=TOKEN_B) as b:
        namespaces = {"a": a.register_namespace(spec), "b": b.register_namespace(spec)}
        keys = namespaces["a"].keys(np.arange(5 * spec.block_tokens))
        a.put(namespaces["a"], keys, np.zeros((5, *spec.block_shape), dtype=np.float32))
        b.put(namespaces["b"], keys[:2], np.zeros((2, *spec.block_shape), dtype=np.float32))
        clients = {"a": a, "b": b}

        def look(round_number: int) -> tuple[str, int]:
            tenant = "ab"[round_number % 2]
            return tenant, clients[tenant].lookup(namespaces[tenant], keys).matched

        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(look, range(400)))
    assert {result for result in results} == {("a", 5), ("b", 2)}


def test_another_tenants_namespace_and_leases_are_not_found(daemon):
    stub = kvd_pb2_grpc.KvdStub(grpc.insecure_channel(daemon.unix_target))
    with Client(daemon.unix_target, token=TOKEN_A) as a:
        namespace = a.register_namespace(SMALL_SPEC)
        keys = namespace.keys(np.arange(2 * SMALL_SPEC.block_tokens))
        a.put(namespace, keys, random_blocks(SMALL_SPEC, 2, seed=3))
    # "small" has not registered the spec: a's namespace does not exist for it, in the same words
    # as an id nobody ever registered.
    details = []
    for namespace_id in (namespace.namespace_id, bytes(32)):
        with pytest.raises(grpc.RpcError) as error:
            stub.Lookup(kvd_pb2.LookupRequest(namespace_id=namespace_id, keys=keys), metadata=metadata(TOKEN_SMALL))
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        details.append(error.value.details().replace(namespace_id.hex()[:16], "<id>"))
    assert details[0] == details[1]
    # Nor does the daemon's own id of a's namespace (an admin sees it in Stats) work for b.
    stats = stub.Stats(kvd_pb2.StatsRequest(), metadata=metadata(TOKEN_OPS))
    (engine_id,) = [ns.namespace_id for ns in stats.namespaces if ns.tenant == "a" and ns.model_id == SMALL_SPEC.model_id]
    assert engine_id != namespace.namespace_id
    get = kvd_pb2.GetRequest(namespace_id=engine_id, client_id="c", keys=keys)
    for method, request in ((stub.Get, kvd_pb2.GetRequest(namespace_id=engine_id, client_id="c", keys=keys,
                                                          inline=True)),
                            (stub.GetLayers, get), (stub.GetBlocks, get),
                            (stub.Delete, kvd_pb2.DeleteRequest(namespace_id=engine_id, keys=keys))):
        assert code_of(method, request, metadata=metadata(TOKEN_B)) == grpc.StatusCode.NOT_FOUND
    # A lease of a's client "engine-0" is no lease of b's client "engine-0".
    got = stub.Get(kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, client_id="engine-0", keys=keys),
                   metadata=metadata(TOKEN_A))
    assert got.matched == 2 and got.lease_id
    for call, request in ((stub.Release, kvd_pb2.ReleaseRequest(client_id="engine-0", lease_ids=[got.lease_id])),
                          (stub.Renew, kvd_pb2.RenewRequest(client_id="engine-0", lease_id=got.lease_id))):
        assert code_of(call, request, metadata=metadata(TOKEN_B)) == grpc.StatusCode.NOT_FOUND
    released = stub.Release(kvd_pb2.ReleaseRequest(client_id="engine-0", lease_ids=[got.lease_id]),
                            metadata=metadata(TOKEN_A))
    assert released.released == 1


def test_an_empty_client_id_is_refused_with_tokens_as_without(daemon):
    """The tenant's scope must not turn a missing client_id into a valid one
    (found by the fuzzers with tenants: a Release with no client_id was OK)."""
    stub = kvd_pb2_grpc.KvdStub(grpc.insecure_channel(daemon.unix_target))
    with Client(daemon.unix_target, token=TOKEN_A) as a:
        namespace = a.register_namespace(SMALL_SPEC)
        keys = namespace.keys(np.arange(900_000, 900_000 + SMALL_SPEC.block_tokens))
    for call, request in (
            (stub.Release, kvd_pb2.ReleaseRequest(lease_ids=[1])),
            (stub.Renew, kvd_pb2.RenewRequest(lease_id=1)),
            (stub.Reserve, kvd_pb2.ReserveRequest(namespace_id=namespace.namespace_id, keys=keys)),
            (stub.Get, kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, keys=keys))):
        with pytest.raises(grpc.RpcError) as error:
            call(request, metadata=metadata(TOKEN_A))
        assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (type(request).__name__, error.value.details())
        assert "client_id" in error.value.details()
    # An inline Get needs no client_id.
    got = stub.Get(kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, keys=keys, inline=True),
                   metadata=metadata(TOKEN_A))
    assert got.matched == 0


def test_calls_without_a_token_kvd_knows_are_unauthenticated_and_health_needs_none(daemon):
    channel = grpc.insecure_channel(daemon.unix_target)
    stub = kvd_pb2_grpc.KvdStub(channel)
    lookup = kvd_pb2.LookupRequest(namespace_id=SMALL_SPEC.namespace_id(), keys=[bytes(32)])
    for call_metadata in (None, metadata(WRONG_TOKEN), (("authorization", TOKEN_A),), (("authorization", "Bearer"),)):
        for call, request in ((stub.Lookup, lookup), (stub.ArenaInfo, kvd_pb2.ArenaInfoRequest()),
                              (stub.Stats, kvd_pb2.StatsRequest()),
                              (stub.WatchEvents, kvd_pb2.WatchEventsRequest(namespace_id=bytes(32)))):
            with pytest.raises(grpc.RpcError) as error:
                result = call(request, metadata=call_metadata)
                if hasattr(result, "__next__"):
                    next(result)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert WRONG_TOKEN not in error.value.details() and TOKEN_A not in error.value.details()
    with Client(daemon.unix_target, token=WRONG_TOKEN) as client, pytest.raises(grpc.RpcError) as error:
        client.register_namespace(SMALL_SPEC)
    assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="kvd.v1.Kvd"))
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    samples = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    # No token, or not a bearer one: 3 x 4 calls; an unknown token: 4 calls and the client's.
    assert 'kvd_auth_failures_total{reason="missing_token"} 12.0' in samples
    assert 'kvd_auth_failures_total{reason="unknown_token"} 5.0' in samples


def test_stats_and_demote_are_for_admins_only(daemon):
    stub = kvd_pb2_grpc.KvdStub(grpc.insecure_channel(daemon.unix_target))
    for token in (TOKEN_A, TOKEN_SMALL):
        assert code_of(stub.Stats, kvd_pb2.StatsRequest(), metadata=metadata(token)) == grpc.StatusCode.PERMISSION_DENIED
        assert code_of(stub.Demote, kvd_pb2.DemoteRequest(), metadata=metadata(token)) == grpc.StatusCode.PERMISSION_DENIED
    stats = stub.Stats(kvd_pb2.StatsRequest(include_metrics=True), metadata=metadata(TOKEN_OPS))
    assert {"a", "b"} <= {namespace.tenant for namespace in stats.namespaces}
    token_file = daemon.state_dir.parent / "ops.token"
    token_file.write_text(TOKEN_OPS + "\n")
    status = [sys.executable, "-m", "kvd", "status", "--state-dir", str(daemon.state_dir)]
    shown = subprocess.run([*status, "--token-file", str(token_file)], capture_output=True, text=True, check=True)
    assert "tenant" in shown.stdout and SMALL_SPEC.model_id in shown.stdout
    refused = subprocess.run(status, capture_output=True, text=True, env={**os.environ, "KVD_TOKEN": TOKEN_A},
                             check=False)
    assert refused.returncode == 1 and "PERMISSION_DENIED" in refused.stderr


def test_a_tenant_registers_only_the_models_it_may_use(daemon):
    other = NamespaceSpec(model_id="another-model", num_layers=4, num_kv_heads=2, head_dim=16, block_tokens=16,
                          kv_dtype=DType.FLOAT32)
    with Client(daemon.unix_target, token=TOKEN_SMALL) as small, Client(daemon.unix_target, token=TOKEN_OPS) as ops:
        for client in (small, ops):
            with pytest.raises(grpc.RpcError) as error:
                client.register_namespace(other)
            assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert small.register_namespace(SMALL_SPEC).namespace_id == SMALL_SPEC.namespace_id()


def test_a_put_past_the_host_quota_is_resource_exhausted_and_changes_nothing(daemon):
    stub = kvd_pb2_grpc.KvdStub(grpc.insecure_channel(daemon.unix_target))
    with Client(daemon.unix_target, token=TOKEN_SMALL) as small:
        namespace = small.register_namespace(SMALL_SPEC)
        tokens = np.arange(100, 100 + 4 * SMALL_SPEC.block_tokens)
        keys = namespace.keys(tokens)
        with pytest.raises(grpc.RpcError) as error:  # more than the whole quota at once
            small.put(namespace, keys, random_blocks(SMALL_SPEC, 4, seed=4))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "tenant 'small' is over its host quota" in error.value.details()
        assert small.lookup(namespace, keys).matched == 0
        blocks = random_blocks(SMALL_SPEC, 3, seed=5)
        assert small.put(namespace, keys[:3], blocks) == 3
        # Pinned by a lease, none of its blocks can make room: refused, nothing changes.
        lease = stub.Get(kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, client_id="pin", keys=keys[:3]),
                         metadata=metadata(TOKEN_SMALL))
        other_keys = namespace.keys(np.arange(900, 900 + SMALL_SPEC.block_tokens))
        with pytest.raises(grpc.RpcError) as error:
            small.put(namespace, other_keys, random_blocks(SMALL_SPEC, 1, seed=6))
        assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (small.lookup(namespace, keys).matched, small.lookup(namespace, other_keys).matched) == (3, 0)
        assert np.array_equal(small.get_numpy(namespace, keys), blocks)
        stub.Release(kvd_pb2.ReleaseRequest(client_id="pin", lease_ids=[lease.lease_id]),
                     metadata=metadata(TOKEN_SMALL))
        # Unpinned, its own least recently used block makes room.
        assert small.put(namespace, other_keys, random_blocks(SMALL_SPEC, 1, seed=6)) == 1
        assert (small.lookup(namespace, keys).matched, small.lookup(namespace, other_keys).matched) == (2, 1)
    samples = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    assert f'kvd_tenant_used_bytes{{tenant="small",tier="host"}} {3.0 * SLOT_BYTES}' in samples
    assert 'kvd_tenant_quota_refusals_total{tenant="small",tier="host"} 2.0' in samples
    assert 'kvd_tenant_quota_evictions_total{tenant="small",tier="host"} 1.0' in samples


def test_the_sockets_are_owner_only(daemon):
    for path in (daemon.endpoints["unix_socket"], daemon.arena_socket):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_the_arena_socket_hands_a_tenant_its_own_file_and_refuses_others(daemon):
    path = Path(daemon.arena_socket)
    for token in (None, WRONG_TOKEN):
        with pytest.raises(Unauthenticated):
            arena_protocol.receive_arena(path, token, "")
    with pytest.raises(FailedPrecondition, match="restarted"):
        arena_protocol.receive_arena(path, TOKEN_A, "an-instance-long-gone")
    fd_a, reply = arena_protocol.receive_arena(path, TOKEN_A, "")
    fd_b, _ = arena_protocol.receive_arena(path, TOKEN_B, "")
    try:
        assert os.fstat(fd_a).st_size == reply["arena_bytes"] == 16 << 20
        # Two files, not two descriptors of one.
        assert os.fstat(fd_a).st_ino != os.fstat(fd_b).st_ino
        # Sealed: a client can neither shrink the file under the daemon nor grow it.
        for size in (0, 32 << 20):
            with pytest.raises(PermissionError):
                os.ftruncate(fd_a, size)
    finally:
        os.close(fd_a)
        os.close(fd_b)
    # A request that is not the protocol gets a precise refusal, and the daemon goes on.
    import socket

    with socket.socket(socket.AF_UNIX) as raw:
        raw.connect(str(path))
        raw.sendall(b"GET / HTTP/1.0\n")
        assert b'"code":"INVALID_ARGUMENT"' in raw.recv(4096)
    with Client(daemon.unix_target, token=TOKEN_A) as a:
        assert a.uses_shared_memory


def test_shared_memory_slots_that_change_tenant_never_show_the_new_tenants_bytes(tmp_path):
    """Tenants a and b fill one small arena in turn through shared memory,
    so every slot moves between them; each client's mapping only ever holds
    its own tenant's blocks, and zeros where the other's are."""
    slots = 16
    config = auth_config(tmp_path, host={"capacity_bytes": slots * SLOT_BYTES})
    with run_daemon(tmp_path, config=config, env={"KVD_TEST_TOKEN_B": TOKEN_B}) as process, \
            Client(process.unix_target, token=TOKEN_A, use_shared_memory=True) as a, \
            Client(process.unix_target, token=TOKEN_B, use_shared_memory=True) as b:
        clients = {"a": a, "b": b}
        assert a.uses_shared_memory and b.uses_shared_memory
        namespaces = {name: client.register_namespace(SMALL_SPEC) for name, client in clients.items()}
        width = SMALL_SPEC.block_bytes
        stored: dict[str, set[bytes]] = {"a": set(), "b": set()}
        for round_number in range(6):
            writer = "ab"[round_number % 2]
            keys = namespaces[writer].keys(np.arange(slots * SMALL_SPEC.block_tokens) + 10_000 * round_number)
            blocks = random_blocks(SMALL_SPEC, slots, seed=round_number)
            assert clients[writer].put(namespaces[writer], keys, blocks) == slots
            stored[writer].update(blocks.view(np.uint8).reshape(slots, width)[row].tobytes() for row in range(slots))
            # The writer's blocks (those the watermarks left) read back bit-exact.
            found = clients[writer].get_numpy(namespaces[writer], keys)
            assert found.shape[0] > slots // 2 and np.array_equal(found, blocks[: found.shape[0]])
            for name, client in clients.items():
                other = stored["b" if name == "a" else "a"]
                rows = client.session.arena.slots[:, :width]
                assert not any(rows[row].tobytes() in other for row in range(slots)), (round_number, name)
            # The reader who lost its slots sees zeros where they were.
            loser = "b" if writer == "a" else "a"
            if round_number:
                assert not clients[loser].session.arena.slots[:, :width][
                    [row for row in range(slots) if clients[writer].session.arena.slots[row, :width].any()]
                ].any()
        samples = urllib.request.urlopen(process.metrics_url, timeout=10).read().decode()
        changes = next(float(line.split()[1]) for line in samples.splitlines()
                       if line.startswith("kvd_arena_slot_tenant_changes_total "))
        assert changes >= 5 * slots * 0.8  # every round but the first moved (nearly) the whole arena
        assert "kvd_arena_handouts_total 2.0" in samples


def test_no_token_ever_reaches_the_log(daemon):
    # Last in the module: every test above has sent good and bad tokens.
    log = daemon.log()
    assert "kvd ready" in log and '"auth_mode": "token"' in log
    for secret in (TOKEN_A, TOKEN_B, TOKEN_SMALL, TOKEN_OPS, WRONG_TOKEN, sha(TOKEN_A), sha(TOKEN_OPS)):
        assert secret not in log


# ----------------------------------------------------------------------
# TLS, mutual TLS, the socket's group


def test_tls_on_tcp_and_plaintext_is_refused(tmp_path):
    certs = make_certificates(tmp_path / "certs")
    config = {"server": {"tls_cert_file": str(certs.server_cert), "tls_key_file": str(certs.server_key),
                         "unix_socket_group": str(os.getgid())},
              "host": {"capacity_bytes": 4 << 20, "slot_bytes": SLOT_BYTES}}
    with run_daemon(tmp_path / "d", config=config) as daemon:
        tls = TlsConfig(ca_file=str(certs.ca))
        with Client(daemon.tcp_target, tls=tls, use_shared_memory=False) as client:
            namespace = client.register_namespace(SMALL_SPEC)
            keys = namespace.keys(np.arange(2 * SMALL_SPEC.block_tokens))
            blocks = random_blocks(SMALL_SPEC, 2, seed=7)
            assert client.put(namespace, keys, blocks) == 2
            assert np.array_equal(client.get_numpy(namespace, keys), blocks)
        with Client(daemon.tcp_target, timeout_s=5) as plaintext, pytest.raises(grpc.RpcError) as error:
            plaintext.register_namespace(SMALL_SPEC)
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        # The unix socket stays plaintext, now for the group too.
        with Client(daemon.unix_target) as local:
            assert local.lookup(local.register_namespace(SMALL_SPEC), keys).matched == 2
        mode = os.stat(daemon.endpoints["unix_socket"])
        assert (stat.S_IMODE(mode.st_mode), mode.st_gid) == (0o660, os.getgid())
        # `kvd health`, the exec probe for a TLS port: over the socket, and over TLS.
        health = [sys.executable, "-m", "kvd", "health"]
        for arguments in (["--state-dir", str(daemon.state_dir)],
                          ["--target", daemon.tcp_target, "--tls-ca-file", str(certs.ca)]):
            probe = subprocess.run([*health, *arguments], capture_output=True, text=True, check=True)
            assert probe.stdout.strip() == "SERVING"


def test_mutual_tls_refuses_a_client_without_a_certificate_of_its_ca(tmp_path):
    certs = make_certificates(tmp_path / "certs")
    config = {"server": {"tls_cert_file": str(certs.server_cert), "tls_key_file": str(certs.server_key),
                         "tls_client_ca_file": str(certs.ca)},
              "host": {"capacity_bytes": 4 << 20, "slot_bytes": SLOT_BYTES}}
    with run_daemon(tmp_path / "d", config=config) as daemon:
        for tls in (TlsConfig(ca_file=str(certs.ca)),
                    TlsConfig(ca_file=str(certs.ca), cert_file=str(certs.stranger_cert), key_file=str(certs.stranger_key))):
            with Client(daemon.tcp_target, tls=tls, timeout_s=5) as client, pytest.raises(grpc.RpcError) as error:
                client.register_namespace(SMALL_SPEC)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        tls = TlsConfig(ca_file=str(certs.ca), cert_file=str(certs.client_cert), key_file=str(certs.client_key))
        with Client(daemon.tcp_target, tls=tls) as client:
            assert client.register_namespace(SMALL_SPEC).namespace_id == SMALL_SPEC.namespace_id()


# ----------------------------------------------------------------------
# Restart: a tenant's blocks on disk come back for that tenant only

DISK_SPEC = NamespaceSpec(model_id=SMALL_SPEC.model_id, num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16,
                          kv_dtype=DType.FLOAT32)


def test_after_a_restart_a_tenants_disk_blocks_come_back_for_it_alone(tmp_path):
    disk = {"directories": [str(tmp_path / "nvme0")], "capacity_bytes": 4 << 20, "slot_bytes": SLOT_BYTES,
            "segment_bytes": 2 << 20}
    config = auth_config(tmp_path, disk=disk)
    env = {"KVD_TEST_TOKEN_B": TOKEN_B}
    blocks = np.random.default_rng(8).standard_normal((3, *DISK_SPEC.block_shape), dtype=np.float32)
    with run_daemon(tmp_path / "d", config=config, env=env) as daemon, Client(daemon.unix_target, token=TOKEN_A) as a:
        namespace = a.register_namespace(DISK_SPEC)
        keys = namespace.keys(np.arange(3 * DISK_SPEC.block_tokens))
        assert a.put(namespace, keys, blocks, durable=True) == 3
    with run_daemon(tmp_path / "d", config=config, env=env) as daemon:
        stub = kvd_pb2_grpc.KvdStub(grpc.insecure_channel(daemon.unix_target))
        stats = stub.Stats(kvd_pb2.StatsRequest(), metadata=metadata(TOKEN_OPS))
        assert [(ns.tenant, ns.blocks) for ns in stats.namespaces] == [("a", 3)]
        # Recovered for a, under the id a knows, even before a registers again ...
        lookup = kvd_pb2.LookupRequest(namespace_id=DISK_SPEC.namespace_id(), keys=keys)
        assert stub.Lookup(lookup, metadata=metadata(TOKEN_A)).matched == 3
        # ... and for nobody else, identical spec or not.
        assert code_of(stub.Lookup, lookup, metadata=metadata(TOKEN_B)) == grpc.StatusCode.NOT_FOUND
        with Client(daemon.unix_target, token=TOKEN_B) as b:
            assert b.lookup(b.register_namespace(DISK_SPEC), keys).matched == 0
        with Client(daemon.unix_target, token=TOKEN_A) as a:
            namespace = a.register_namespace(DISK_SPEC)
            assert np.array_equal(a.get_numpy(namespace, keys), blocks)
        samples = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
        assert f'kvd_tenant_used_bytes{{tenant="a",tier="disk"}} {3.0 * SLOT_BYTES}' in samples


def test_sighup_rotates_tokens_and_refuses_other_changes(tmp_path):
    """Token rotation without a restart: after SIGHUP the new token works and
    the old one is unauthenticated. A file that changes more than tokens (a
    quota here) is refused whole, with an error in the log, and the tokens
    in use stay."""
    import signal
    import time

    new_token_a = "a-rotated-token-for-tenant-a-2f4d"
    directory = tmp_path / "d"
    directory.mkdir()

    def lookup_code(target: str, token: str) -> grpc.StatusCode:
        stub = kvd_pb2_grpc.KvdStub(grpc.insecure_channel(target))
        try:
            stub.ArenaInfo(kvd_pb2.ArenaInfoRequest(), metadata=metadata(token), timeout=10)
        except grpc.RpcError as error:
            return error.code()
        return grpc.StatusCode.OK

    def wait_for(target: str, token: str, code: grpc.StatusCode) -> None:
        deadline = time.monotonic() + 10
        while lookup_code(target, token) != code:
            assert time.monotonic() < deadline, f"{token[:8]}... never got {code}"
            time.sleep(0.05)

    with run_daemon(directory, config=auth_config(directory), env={"KVD_TEST_TOKEN_B": TOKEN_B}) as daemon:
        path = directory / "tenants.toml"
        assert lookup_code(daemon.unix_target, TOKEN_A) == grpc.StatusCode.OK
        original = path.read_text()
        # A quota change too: refused, the old tokens go on working.
        path.write_text(original.replace(sha(TOKEN_A), sha(new_token_a)).replace(
            f"host_bytes = {SMALL_QUOTA_SLOTS * SLOT_BYTES}", f"host_bytes = {2 * SMALL_QUOTA_SLOTS * SLOT_BYTES}"))
        daemon.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while "tenants file not reloaded" not in daemon.log():
            assert time.monotonic() < deadline, "the refusal was not logged"
            time.sleep(0.05)
        assert lookup_code(daemon.unix_target, TOKEN_A) == grpc.StatusCode.OK
        assert lookup_code(daemon.unix_target, new_token_a) == grpc.StatusCode.UNAUTHENTICATED
        # Only the token: taken.
        path.write_text(original.replace(sha(TOKEN_A), sha(new_token_a)))
        daemon.process.send_signal(signal.SIGHUP)
        wait_for(daemon.unix_target, new_token_a, grpc.StatusCode.OK)
        assert lookup_code(daemon.unix_target, TOKEN_A) == grpc.StatusCode.UNAUTHENTICATED
        assert lookup_code(daemon.unix_target, TOKEN_B) == grpc.StatusCode.OK  # other tenants untouched
        assert new_token_a not in daemon.log() and TOKEN_A not in daemon.log()
