"""The daemon as an operator and a co-located engine see it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.client import AsyncClient, Client
from kvd.testing.daemon import run_daemon, start_daemon
from kvd.v1 import kvd_pb2
from tests.integration.conftest import SMALL_SPEC, random_blocks


def kvd_command(*args: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvd", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)


def arena_files(pid: int) -> list[str]:
    """The memfd files a process holds open (the arena, by kvd.tiers.host's names)."""
    fds = Path(f"/proc/{pid}/fd")
    targets = []
    for fd in fds.iterdir():
        try:
            targets.append(os.readlink(fd))
        except FileNotFoundError:
            continue
    return [target for target in targets if target.startswith("/memfd:kvd-arena")]


def test_shared_memory_and_sockets_are_private(daemon):
    # The arena has no name in /dev/shm that another process could open ...
    assert not [path for path in Path("/dev/shm").glob("kvd-*") if path.stat().st_uid == os.getuid()]
    assert arena_files(daemon.pid)
    # ... only the sockets reach it, and they are the owner's alone.
    for socket_path in (Path(daemon.endpoints["unix_socket"]), Path(daemon.arena_socket)):
        assert stat.S_ISSOCK(socket_path.stat().st_mode)
        assert stat.S_IMODE(socket_path.stat().st_mode) == 0o600
    assert daemon.arena_socket == daemon.endpoints["unix_socket"] + ".arena"


def test_shared_memory_and_inline_paths_agree(daemon):
    with Client(daemon.unix_target) as shm_client, Client(daemon.tcp_target, use_shared_memory=False) as inline_client:
        assert shm_client.uses_shared_memory and not inline_client.uses_shared_memory
        namespace = shm_client.register_namespace(SMALL_SPEC)
        keys = namespace.keys(np.arange(20 * 16) + 31_000)
        blocks = random_blocks(SMALL_SPEC, 20, seed=1)
        assert shm_client.put(namespace, keys[:10], blocks[:10]) == 10
        # The inline writer extends the chain the shared-memory writer began.
        assert inline_client.put(namespace, keys, blocks) == 10
        assert np.array_equal(inline_client.get_numpy(namespace, keys), blocks)
        assert np.array_equal(shm_client.get_numpy(namespace, keys), blocks)
        out = np.zeros_like(blocks)
        shm_client.get_numpy(namespace, keys, out=out)
        assert np.array_equal(out, blocks)
        tensor = shm_client.get_tensor(namespace, keys[:4])
        assert tuple(tensor.shape) == (4, *SMALL_SPEC.block_shape)
        assert np.array_equal(tensor.numpy(), blocks[:4])
        # A longer request returns the stored prefix only.
        longer = namespace.keys(np.arange(24 * 16) + 31_000)
        assert shm_client.lookup(namespace, longer).matched == 20
        assert shm_client.get_numpy(namespace, longer).shape[0] == 20


def test_async_client(daemon):
    async def scenario():
        async with AsyncClient(daemon.unix_target) as client:
            namespace = await client.register_namespace(SMALL_SPEC)
            keys = namespace.keys(np.arange(8 * 16) + 77_000)
            blocks = random_blocks(SMALL_SPEC, 8, seed=2)
            written = await asyncio.gather(client.put(namespace, keys[:4], blocks[:4]))
            assert written == [4]
            assert await client.put(namespace, keys, blocks) == 4
            assert (await client.lookup(namespace, keys)).matched == 8
            got = await client.get_numpy(namespace, keys)
            assert np.array_equal(got, blocks)
            assert await client.delete(namespace, keys[4:5]) == (4, 0)
            assert (await client.lookup(namespace, keys)).matched == 4

    asyncio.run(scenario())


def test_dead_client_leases_expire(tmp_path):
    """A client killed between Reserve and Commit, or while holding a Get
    lease, pins nothing once its leases expire."""
    config = {"leases": {"default_ms": 300, "sweep_interval_ms": 50}}
    with run_daemon(tmp_path, config=config) as daemon:
        script = textwrap.dedent(f"""
            import os, signal, numpy as np, grpc
            from kvd.client import Client
            from kvd.v1 import kvd_pb2, kvd_pb2_grpc
            from tests.integration.conftest import SMALL_SPEC, random_blocks
            client = Client({daemon.unix_target!r})
            ns = client.register_namespace(SMALL_SPEC)
            keys = ns.keys(np.arange(6 * 16))
            client.put(ns, keys[:3], random_blocks(SMALL_SPEC, 3, seed=0))
            stub = kvd_pb2_grpc.KvdStub(grpc.insecure_channel({daemon.unix_target!r}))
            stub.Get(kvd_pb2.GetRequest(namespace_id=ns.namespace_id, client_id="doomed", keys=keys[:3]))
            stub.Reserve(kvd_pb2.ReserveRequest(namespace_id=ns.namespace_id, client_id="doomed", keys=keys))
            print("pinned", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        """)
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                                cwd=Path(__file__).parents[2])
        assert "pinned" in result.stdout, result.stderr
        assert result.returncode == -signal.SIGKILL
        with Client(daemon.unix_target) as client:
            stats = client.stats()
            assert stats.leases == 2 and stats.tiers[0].pinned_blocks == 6
            deadline = time.monotonic() + 10
            while client.stats().leases and time.monotonic() < deadline:
                time.sleep(0.05)
            stats = client.stats()
            assert stats.leases == 0 and stats.leases_expired == 2
            assert stats.tiers[0].pinned_blocks == 0
            # The unwritten reservations were aborted; the sealed prefix stays.
            assert stats.tiers[0].blocks == 3
            namespace = client.register_namespace(SMALL_SPEC)
            keys = namespace.keys(np.arange(6 * 16))
            assert client.lookup(namespace, keys).matched == 3
            assert client.put(namespace, keys, random_blocks(SMALL_SPEC, 6, seed=0)) == 3


def test_metrics_endpoint(daemon):
    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SMALL_SPEC)
        keys = namespace.keys(np.arange(4 * 16) + 123_000)
        client.put(namespace, keys, random_blocks(SMALL_SPEC, 4, seed=5))
        client.lookup(namespace, keys + namespace.keys(np.arange(16) + 1))
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    assert samples['kvd_tier_capacity_bytes{tier="host"}'] == 16 << 20
    assert samples['kvd_tier_blocks{tier="host"}'] >= 4
    blocks = samples['kvd_tier_blocks{tier="host"}']
    assert samples['kvd_tier_payload_bytes{tier="host"}'] == blocks * SMALL_SPEC.block_bytes
    assert samples['kvd_tier_used_bytes{tier="host"}'] == blocks * (64 << 10)  # whole slots
    label = namespace.namespace_id.hex()[:16]
    assert samples[f'kvd_lookup_blocks_total{{namespace="{label}",result="hit"}}'] >= 4
    assert samples[f'kvd_lookup_blocks_total{{namespace="{label}",result="miss"}}'] >= 1
    assert samples['kvd_rpc_total{code="OK",method="Reserve"}'] >= 1
    assert any(name.startswith('kvd_rpc_duration_seconds_bucket{le="0.001",method="Lookup"}') for name in samples)
    assert samples["kvd_leaked_handles_total"] == 0


def test_health_service(daemon):
    with grpc.insecure_channel(daemon.tcp_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "kvd.v1.Kvd"):
            response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING


def test_status_command(daemon):
    with Client(daemon.unix_target) as client:
        client.register_namespace(SMALL_SPEC)
    result = kvd_command("status", "--state-dir", str(daemon.state_dir))
    assert result.returncode == 0, result.stderr
    assert "host" in result.stdout and "16.0 MiB" in result.stdout
    assert "integration-model" in result.stdout
    result = kvd_command("status", "--target", daemon.tcp_target, "--json")
    status = json.loads(result.stdout)
    assert status["tiers"][0]["capacity_bytes"] == 16 << 20
    missing = kvd_command("status", "--state-dir", "/nonexistent-kvd-state")
    assert missing.returncode == 1 and "no daemon found" in missing.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--set", "host.slot_bytes=5000"], "'host.slot_bytes': must be a multiple of 4096"),
        (["--set", "host.capacity_bytes=lots"], "'host.capacity_bytes': must be a byte size"),
        (["--set", "host.colour=blue"], "'host.colour'"),
        (["--tcp-address", "nowhere"], "'server.tcp_address': must be host:port"),
        (["--set", "leases.default_ms=-1"], "'leases.default_ms': must be positive"),
    ],
)
def test_invalid_config_names_the_field(tmp_path, args, fragment):
    result = kvd_command("serve", "--state-dir", str(tmp_path), *args)
    assert result.returncode == 2
    assert fragment in result.stderr, result.stderr


def test_config_file_env_and_flags_layer(tmp_path):
    config_path = tmp_path / "kvd.toml"
    config_path.write_text('[host]\ncapacity_bytes = "256MiB"\nslot_bytes = "1MiB"\n[leases]\nmax_ms = 1000\ndefault_ms = 500\n')
    env = dict(os.environ, KVD_HOST_SLOT_BYTES="512KiB")
    result = subprocess.run(
        [sys.executable, "-m", "kvd", "config", "--config", str(config_path), "--set", "leases.max_ms=2000"],
        capture_output=True, text=True, env=env, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    effective = json.loads(result.stdout)
    assert effective["host"]["capacity_bytes"] == 256 << 20  # file
    assert effective["host"]["slot_bytes"] == 512 << 10  # environment beats file
    assert effective["leases"]["max_ms"] == 2000  # flag beats file
    assert effective["server"]["tcp_address"] == "127.0.0.1:50051"  # embedded default


def test_sigterm_drains_and_cleans_up(tmp_path):
    daemon = start_daemon(tmp_path)
    arena_socket = Path(daemon.arena_socket)
    socket_path = Path(daemon.endpoints["unix_socket"])
    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SMALL_SPEC)
        keys = namespace.keys(np.arange(4 * 16))
        client.put(namespace, keys, random_blocks(SMALL_SPEC, 4, seed=9))
        # A lease still open at shutdown is ended by the drain.
        stub_lease = client._stub.Get(kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, client_id="x", keys=keys))
        assert stub_lease.lease_id
    assert arena_socket.exists()
    assert daemon.stop(signal.SIGTERM) == 0
    assert not arena_socket.exists() and not socket_path.exists()
    log = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    messages = [entry["msg"] for entry in log]
    assert "draining" in messages and "stopped" in messages
    stopped = next(entry for entry in log if entry["msg"] == "stopped")
    assert stopped["leases_closed"] == 1


def test_a_killed_daemon_leaves_no_arena_behind_and_its_clients_keep_their_mapping(tmp_path):
    """The arena is memfd files: SIGKILL leaves nothing to clean up, and a
    client's mapping stays valid (it reads what it had) until it lets go."""
    first = start_daemon(tmp_path / "first")
    with Client(first.unix_target, timeout_s=5) as client:
        namespace = client.register_namespace(SMALL_SPEC)
        keys = namespace.keys(np.arange(4 * 16))
        blocks = random_blocks(SMALL_SPEC, 4, seed=3)
        client.put(namespace, keys, blocks)
        arena = client.session.arena
        assert arena is not None and arena.slots[: len(blocks), : blocks.shape[1]].any()
        first.stop(signal.SIGKILL)
        assert arena.slots[: len(blocks)].sum() > 0  # no SIGBUS: the memory is the client's too now
    assert not [path for path in Path("/dev/shm").glob(f"kvd-{first.pid}-*")]
    with run_daemon(tmp_path / "first") as second, Client(second.unix_target) as client:
        assert client.uses_shared_memory  # the stale sockets were replaced


def test_sigterm_under_load_finishes_or_refuses_cleanly(tmp_path):
    """Requests racing a SIGTERM either complete or are refused with
    UNAVAILABLE/CANCELLED; none gets INTERNAL, and the daemon exits 0."""
    import threading

    daemon = start_daemon(tmp_path)
    outcomes: dict[str, int] = {}
    stop = threading.Event()

    def hammer():
        with Client(daemon.tcp_target, use_shared_memory=False, timeout_s=5) as client:
            namespace = client.register_namespace(SMALL_SPEC)
            keys = namespace.keys(np.arange(32 * 16))
            blocks = random_blocks(SMALL_SPEC, 32, seed=4)
            while not stop.is_set():
                try:
                    client.put(namespace, keys, blocks)
                    assert np.array_equal(client.get_numpy(namespace, keys), blocks)
                    outcomes["ok"] = outcomes.get("ok", 0) + 1
                except grpc.RpcError as error:
                    outcomes[error.code().name] = outcomes.get(error.code().name, 0) + 1
                    if error.code() == grpc.StatusCode.UNAVAILABLE:
                        return

    thread = threading.Thread(target=hammer)
    thread.start()
    deadline = time.monotonic() + 20
    while not outcomes.get("ok") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert daemon.stop(signal.SIGTERM) == 0
    stop.set()
    thread.join(30)
    assert outcomes.get("ok", 0) > 0
    assert set(outcomes) <= {"ok", "UNAVAILABLE", "CANCELLED"}, outcomes


def test_the_arena_has_huge_pages_exactly_where_the_kernel_gives_shared_memory_any(tmp_path):
    """host.huge_pages is on by default: under shmem_enabled = advise (or
    within_size, always, force) the arena is mapped with huge pages, the
    gauge says how much; under never or deny it has none, and says 0."""
    from kvd.tiers.host import shmem_huge_page_mode

    mode = shmem_huge_page_mode()
    config = {"host": {"capacity_bytes": 64 << 20, "slot_bytes": 2 << 20}}
    with run_daemon(tmp_path, config=config) as daemon:
        huge = daemon.metric("kvd_arena_huge_page_bytes")
    if mode in ("advise", "within_size", "always", "force"):
        assert huge >= 32 << 20, (mode, huge)
    else:
        assert huge == 0, (mode, huge)


def test_huge_pages_option_starts(tmp_path):
    """huge_pages is advisory: where the kernel refuses, the daemon logs and serves."""
    with run_daemon(tmp_path, config={"host": {"huge_pages": True}}) as daemon:
        with Client(daemon.unix_target) as client:
            namespace = client.register_namespace(SMALL_SPEC)
            keys = namespace.keys(np.arange(2 * 16))
            blocks = random_blocks(SMALL_SPEC, 2, seed=8)
            client.put(namespace, keys, blocks)
            assert np.array_equal(client.get_numpy(namespace, keys), blocks)
