"""put(durable=True) under host-tier pressure: acknowledged promptly, and kept.

A tiny host tier (12 slots) and a disk writer that takes one block per batch
(one fsync each) leave committed blocks waiting in host memory for their
write, while another client's Puts keep asking for host slots. A durable
Put's blocks must not be evicted in that window: the Put would then wait
for a write that never comes and fail at its deadline. Each durable Put is
acknowledged well within its deadline, and after a SIGKILL and a restart
every acknowledged block reads back bit-exact from disk.

And a durable wait that can never succeed (the block's parent failed to
reach disk, so the block is never written) fails at once, not at the
deadline; that one drives the daemon's disk plane in-process, with an
injected write error.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import grpc
import numpy as np

from kvd.client import Client
from kvd.core.keys import chain_keys
from kvd.testing.daemon import run_daemon, start_daemon
from kvd.testing.put_stream import SPEC, blocks_for
from kvd.v1 import kvd_pb2
from kvd.core.requests import CommitRequest, KeysRequest

HOST_SLOTS = 12
SLOT_BYTES = 8 << 10
CHAIN_BLOCKS = 4
DURABLE_PUTS = 12
# Far below the server's 30 s durable wait: a Put left waiting for a block
# that was evicted fails here, fast.
PUT_TIMEOUT_S = 8.0


def config(tmp_path: Path) -> dict:
    return {
        "host": {"capacity_bytes": HOST_SLOTS * SLOT_BYTES, "slot_bytes": SLOT_BYTES},
        "disk": {
            "directories": [str(tmp_path / "nvme0")],
            "capacity_bytes": 16 << 20,
            "slot_bytes": SLOT_BYTES,
            "segment_bytes": 4 << 20,
            "fsync": "strict",
            "write_batch_blocks": 1,
        },
    }


def test_durable_puts_under_host_pressure_are_acknowledged_and_survive_a_kill(tmp_path):
    directory = tmp_path / "daemon"
    daemon = start_daemon(directory, config=config(tmp_path))
    stop = threading.Event()
    churned: list[int] = []
    refused: list[grpc.RpcError] = []
    churner = None
    try:

        def churn() -> None:
            # Non-durable Puts of fresh chains, as fast as they go: each one
            # needs host slots, so it evicts whatever the policy offers.
            with Client(daemon.unix_target) as client:
                namespace = client.register_namespace(SPEC)
                round_ = 0
                while not stop.is_set():
                    round_ += 1
                    keys = namespace.keys(np.arange(CHAIN_BLOCKS * 16) + (1 << 30) + round_ * 1000)
                    try:
                        churned.append(client.put(namespace, keys, blocks_for(keys)))
                    except grpc.RpcError as error:
                        refused.append(error)

        churner = threading.Thread(target=churn)
        churner.start()
        acked = []
        with Client(daemon.unix_target, timeout_s=PUT_TIMEOUT_S) as client:
            namespace = client.register_namespace(SPEC)
            for put in range(DURABLE_PUTS):
                keys = namespace.keys(np.arange(CHAIN_BLOCKS * 16) + put * 1000)
                # Within the client's deadline (PUT_TIMEOUT_S), or it raises.
                assert client.put(namespace, keys, blocks_for(keys), durable=True) == CHAIN_BLOCKS
                acked.append(keys)
    finally:
        stop.set()
        if churner is not None:
            churner.join(30)
        daemon.stop(signal.SIGKILL)
    # The other client really competed for the host tier meanwhile; at most
    # it found every host slot pinned for a moment.
    assert len(churned) >= DURABLE_PUTS
    assert all(error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for error in refused), refused[:3]
    with run_daemon(directory, config=config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        for keys in acked:
            lookup = client.lookup(namespace, keys)
            assert lookup.matched == CHAIN_BLOCKS and set(lookup.tiers) == {kvd_pb2.TIER_DISK}
            assert client.get_numpy(namespace, keys).tobytes() == blocks_for(keys).tobytes()


def test_a_failed_write_fails_the_wait_with_its_reason_and_a_later_wait_retries_the_parent(tmp_path):
    """The parent's disk write fails (injected EIO): its durable wait fails
    at once, saying why (never at its deadline: that would say
    DEADLINE_EXCEEDED). A later durable wait on its child writes the parent
    again first (a block is only ever on disk with its whole prefix), so a
    retry after a transient error succeeds."""
    import asyncio
    import errno
    import functools

    from kvd.config import DiskSettings
    from kvd.core.engine import Engine
    from kvd.io.engine import Op
    from kvd.planes.disk import DiskPlane
    from kvd.tiers.host import ArenaLayout, HostArena

    settings = DiskSettings(directories=[str(tmp_path / "nvme0")], capacity_bytes=4 << 20, slot_bytes=SLOT_BYTES,
                            segment_bytes=4 << 20, fsync="strict", write_mode="through", write_batch_blocks=1)
    arena = HostArena(ArenaLayout.from_capacity(HOST_SLOTS * SLOT_BYTES, SLOT_BYTES), prefault=False)

    def put(engine: Engine, namespace_id: bytes, keys: list[bytes], parent_key: bytes) -> list:
        reserved = engine.reserve(KeysRequest(namespace_id, "client", keys, 0, 0, parent_key=parent_key))
        for slot, block in zip(reserved.slots, blocks_for(keys)):
            arena.write(slot, block.tobytes())
        blocks = [handle.block for handle in reserved.lease.handles]
        engine.commit(CommitRequest(namespace_id, "client", reserved.lease.lease_id, 0))
        return blocks

    async def scenario():
        plane = DiskPlane(settings, arena)
        recovery = await plane.open()
        engine = Engine(host_slot_count=HOST_SLOTS, host_slot_bytes=SLOT_BYTES, disk_slot_count=plane.slot_count,
                        disk_slot_bytes=SLOT_BYTES)
        await plane.recover(engine, recovery)
        plane.start()
        try:
            namespace_id = engine.register_namespace(SPEC).namespace_id
            await plane.register_namespace(engine, namespace_id)
            keys = chain_keys(SPEC, np.arange(2 * 16))
            await plane._run(functools.partial(plane.tier.engine.inject_fault, Op.WRITE, errno=errno.EIO))
            parent = put(engine, namespace_id, keys[:1], b"")
            parent_failures = await plane.wait_durable(parent, 60.0)
            await plane._run(plane.tier.engine.clear_faults)
            child = put(engine, namespace_id, keys[1:], keys[0])
            child_failures = await plane.wait_durable(child, 60.0)
            engine.verify()
            return (parent_failures, child_failures, engine.disk_slot(parent[0]), engine.disk_slot(child[0]))
        finally:
            await plane.close(1.0)

    try:
        parent_failures, child_failures, parent_slot, child_slot = asyncio.run(scenario())
    finally:
        arena.close()
    assert [(failure.code, failure.reason.split(" (")[0]) for failure in parent_failures] == [
        ("UNAVAILABLE", "the disk write failed")]
    assert child_failures == []
    assert parent_slot >= 0 and child_slot >= 0
