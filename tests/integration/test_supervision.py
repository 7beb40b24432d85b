"""No background task dies silently, and a bug never costs a stored block (issue 35, items 3 and 4).

A whole daemon runs in-process (the real Daemon, gRPC server, disk plane
on real files); one of its long-lived tasks or threads is made to raise.
Each time: the failure is logged once with its traceback, health turns
NOT_SERVING at once, the daemon stops by itself with exit status 1 (what
systemd restarts), and its shutdown still syncs and closes the disk tier
and the arena. A read job that raises (a bug, not a media error) stops the
daemon too, and the blocks it was reading are still on disk afterwards:
only a per-entry media error loses a block.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest
from grpc_health.v1 import health_pb2

from kvd.client import Client
from kvd.config import load
from kvd.core.engine import Engine
from kvd.planner.io_schedule import IoSchedule
from kvd.core.mover import Mover
from kvd.daemon.lifecycle import Daemon
from kvd.invariants import InvariantError
from kvd.planes.disk import DiskPlane
from kvd.testing.put_stream import SPEC, blocks_for
from kvd.tiers.disk.tier import DiskTier

WAIT_S = 30.0


def config(tmp_path: Path, fsync: str = "group"):
    return load(env={}, overrides={
        "state_dir": str(tmp_path / "state"), "server.tcp_address": "", "metrics.address": "127.0.0.1:0",
        "server.grace_period_s": 5.0, "host.capacity_bytes": 64 << 16, "host.slot_bytes": 64 << 10,
        "disk.directories": [str(tmp_path / "nvme0")], "disk.capacity_bytes": 8 << 20,
        "disk.slot_bytes": 64 << 10, "disk.segment_bytes": 4 << 20, "disk.fsync": fsync,
        "disk.group_commit_ms": 20, "leases.sweep_interval_ms": 20,
    })


def boom(*args, **kwargs):
    raise RuntimeError("injected failure")


async def put_some(daemon: Daemon, count: int = 4, durable: bool = True) -> list[bytes]:
    """Store a chain through a real client (in a thread: the client is synchronous)."""
    target = f"unix://{daemon.config.unix_socket_path.resolve()}"

    def put() -> list[bytes]:
        with Client(target) as client:
            namespace = client.register_namespace(SPEC)
            keys = namespace.keys(np.arange(count * SPEC.block_tokens))
            assert client.put(namespace, keys, blocks_for(keys), durable=durable) == count
            return keys

    return await asyncio.to_thread(put)


async def fails_and_stops(daemon: Daemon, trigger=None) -> tuple[object, bool]:
    """Wait for the daemon to stop by itself; (its failure, whether health said NOT_SERVING before shutdown)."""
    if trigger is not None:
        await trigger()
    await asyncio.wait_for(daemon.wait(), WAIT_S)
    await asyncio.sleep(0)  # the health task the failure started
    not_serving = daemon.health._statuses.get("") == health_pb2.HealthCheckResponse.NOT_SERVING
    tier = daemon.disk_plane.tier
    await daemon.shutdown()
    assert tier.closed and daemon.arena.slots is None, "shutdown left the disk tier or the arena open"
    return daemon.supervisor.failure, not_serving


def inject_writer(monkeypatch, daemon):
    monkeypatch.setattr(Mover, "next_round", boom)


async def async_boom(*args, **kwargs):
    raise RuntimeError("injected failure")


def inject_committer(monkeypatch, daemon):
    monkeypatch.setattr(DiskPlane, "_commit", async_boom)


def inject_sweeper(monkeypatch, daemon):
    monkeypatch.setattr(Engine, "expire", boom)


def inject_io_thread(monkeypatch, daemon):
    monkeypatch.setattr(IoSchedule, "pop", boom)


@pytest.mark.parametrize("inject, what", [
    (inject_writer, "the disk-writer task"),
    (inject_committer, "the disk-commit task"),
    (inject_sweeper, "the lease-sweeper task"),
    (inject_io_thread, "the disk I/O thread"),
], ids=["writer", "commit", "sweeper", "io-thread"])
def test_a_failed_background_task_or_thread_stops_the_daemon_loudly(tmp_path, monkeypatch, caplog, inject, what):
    async def scenario():
        daemon = Daemon(config(tmp_path))
        await daemon.start()
        await put_some(daemon)
        inject(monkeypatch, daemon)
        # The I/O thread is idle until a job comes: wake it with one.
        trigger = (lambda: daemon.disk_plane.io.run(0, lambda: None)) if inject is inject_io_thread else None
        if trigger is not None:
            async def wake():
                with pytest.raises(RuntimeError):
                    await trigger()
            return daemon, await fails_and_stops(daemon, wake)
        return daemon, await fails_and_stops(daemon)

    caplog.set_level(logging.INFO)
    daemon, (failure, not_serving) = asyncio.run(scenario())
    assert failure is not None and failure[0] == what and "injected failure" in str(failure[1])
    assert not_serving and daemon.exit_status == 1
    critical = [record for record in caplog.records if record.levelno == logging.CRITICAL]
    assert len(critical) == 1 and what in critical[0].getMessage() and critical[0].exc_info is not None


def test_a_broken_invariant_in_a_handler_answers_internal_and_stops_the_daemon(tmp_path, monkeypatch):
    import grpc

    def broken(*args, **kwargs):
        raise InvariantError("injected broken invariant")

    async def scenario():
        daemon = Daemon(config(tmp_path))
        await daemon.start()
        await put_some(daemon)
        monkeypatch.setattr(Engine, "lookup", broken)
        target = f"unix://{daemon.config.unix_socket_path.resolve()}"

        def lookup() -> grpc.StatusCode:
            with Client(target) as client:
                namespace = client.register_namespace(SPEC)
                with pytest.raises(grpc.RpcError) as raised:
                    client.lookup(namespace, namespace.keys(np.arange(SPEC.block_tokens)))
                return raised.value.code()

        code = await asyncio.to_thread(lookup)
        return code, daemon, await fails_and_stops(daemon)

    code, daemon, (failure, not_serving) = asyncio.run(scenario())
    assert code == grpc.StatusCode.INTERNAL and failure[0] == "the Lookup handler"
    assert not_serving and daemon.exit_status == 1


def test_a_read_job_that_raises_stops_the_daemon_and_loses_no_block(tmp_path, monkeypatch):
    """Before: any exception in a read job counted as every block failing,
    so a bug dropped good blocks and journalled their removal."""
    settings = config(tmp_path, fsync="strict")

    async def first_run():
        daemon = Daemon(settings)
        await daemon.start()
        keys = await put_some(daemon, count=4)
        await daemon.service._demote()  # host copies dropped: the next Get reads the disk
        monkeypatch.setattr(DiskTier, "read_blocks", boom)
        target = f"unix://{daemon.config.unix_socket_path.resolve()}"

        def get() -> None:
            with Client(target) as client:
                namespace = client.register_namespace(SPEC)
                with pytest.raises(Exception):
                    client.get_numpy(namespace, keys)

        await asyncio.to_thread(get)
        return keys, daemon, await fails_and_stops(daemon)

    keys, daemon, (failure, _) = asyncio.run(first_run())
    assert failure[0] == "a disk read job" and daemon.exit_status == 1
    monkeypatch.undo()

    async def second_run():
        daemon = Daemon(settings)
        await daemon.start()
        target = f"unix://{daemon.config.unix_socket_path.resolve()}"

        def get() -> np.ndarray:
            with Client(target) as client:
                return client.get_numpy(client.register_namespace(SPEC), keys)

        try:
            return await asyncio.to_thread(get)
        finally:
            await daemon.shutdown()

    assert asyncio.run(second_run()).tobytes() == blocks_for(keys).tobytes()
