"""What a client was told stays true across restarts: deletes stick, durable Puts are durable.

Regressions of issue 10 (found by black-box testing of 084a673):
  * a Delete answered deleted=4, yet a restart (SIGTERM or SIGKILL) brought
    the 4 blocks back: the REMOVE records waited for the next write batch;
  * a durable Put of blocks already stored (a client's retry after a
    timeout) returned 0 over shared memory without making them durable, so
    a SIGKILL then lost them;
  * a durable Put that could not store every block (a small host tier)
    returned a short count without raising.
Each runs a real daemon in another process, on real files with O_DIRECT.
"""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvd.client import Client, NotDurableError
from kvd.core.keys import DType, NamespaceSpec
from kvd.testing.daemon import run_daemon, start_daemon
from kvd.v1 import kvd_pb2

# 2 layers x 4 KiB: 8 KiB blocks, each layer one aligned extent on disk.
SPEC = NamespaceSpec(model_id="promise-model", num_layers=2, num_kv_heads=1, head_dim=32, block_tokens=16,
                     kv_dtype=DType.FLOAT32)
SLOT_BYTES = 8 << 10


def config(tmp_path: Path, *, host_slots: int = 64, write_mode: str = "back", fsync: str = "strict") -> dict:
    return {
        "host": {"capacity_bytes": host_slots * SLOT_BYTES, "slot_bytes": SLOT_BYTES},
        "disk": {
            "directories": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")],
            "capacity_bytes": 4 << 20,
            "slot_bytes": SLOT_BYTES,
            "segment_bytes": 1 << 20,
            "fsync": fsync,
            "write_mode": write_mode,
        },
    }


def blocks_for(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, *SPEC.block_shape), dtype=np.float32)


def stop(daemon, how: signal.Signals) -> None:
    code = daemon.stop(how)
    assert code == (0 if how == signal.SIGTERM else -signal.SIGKILL), daemon.log()[-3000:]


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
@pytest.mark.parametrize("fsync", ["strict", "group", "none"])
def test_a_delete_sticks_across_a_restart(tmp_path, how, fsync):
    directory = tmp_path / "d"
    settings = config(tmp_path, fsync=fsync)
    daemon = start_daemon(directory, config=settings)
    try:
        with Client(daemon.unix_target) as client:
            namespace = client.register_namespace(SPEC)
            keys = namespace.keys(np.arange(4 * 16))
            assert client.put(namespace, keys, blocks_for(4, seed=1), durable=True) == 4
            kept = namespace.keys(np.arange(4 * 16) + 10_000)
            assert client.put(namespace, kept, blocks_for(4, seed=2), durable=True) == 4
            assert client.delete(namespace, keys[:1]) == (4, 0)
            assert client.lookup(namespace, keys).matched == 0
    finally:
        stop(daemon, how)
    with run_daemon(directory, config=settings) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        assert client.lookup(namespace, keys).matched == 0
        assert client.get_numpy(namespace, keys).shape[0] == 0
        # The other chain was never deleted: it is still there, bit-exact.
        assert client.get_numpy(namespace, kept).tobytes() == blocks_for(4, seed=2).tobytes()


def test_deleted_bytes_are_overwritten_on_the_drive(tmp_path):
    """Defence in depth: a Delete also overwrites each block's first page,
    so a manifest damaged later (losing the REMOVE) could list the block
    again but never serve its bytes."""
    directory = tmp_path / "d"
    settings = config(tmp_path)
    blocks = blocks_for(2, seed=3)
    with run_daemon(directory, config=settings) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(2 * 16))
        client.put(namespace, keys, blocks, durable=True)
        pages = [block.reshape(-1).view(np.uint8)[:4096].tobytes() for block in blocks]
        segments = sorted(tmp_path.glob("nvme*/seg-*"))
        assert sum(segment.read_bytes().count(page) for segment in segments for page in pages) == 2
        assert client.delete(namespace, keys) == (2, 0)
        assert sum(segment.read_bytes().count(page) for segment in segments for page in pages) == 0


def test_a_durable_retry_of_stored_blocks_makes_them_durable(tmp_path):
    """Put without durability, then the same Put with it (a retry): over
    shared memory and inline alike, the second call waits until every
    block is on disk, and a SIGKILL then loses none."""
    directory = tmp_path / "d"
    settings = config(tmp_path, write_mode="back")
    daemon = start_daemon(directory, config=settings)
    chains = {}
    try:
        for shared in (True, False):
            with Client(daemon.unix_target, use_shared_memory=shared) as client:
                namespace = client.register_namespace(SPEC)
                keys = namespace.keys(np.arange(4 * 16) + (0 if shared else 50_000))
                blocks = blocks_for(4, seed=10 + shared)
                assert client.put(namespace, keys, blocks) == 4
                lookup = client.lookup(namespace, keys)
                assert set(lookup.tiers) == {kvd_pb2.TIER_HOST}  # write-back: not on disk yet
                assert client.put(namespace, keys, blocks, durable=True) == 4  # all 4 durable (none written anew)
                lookup = client.lookup(namespace, keys)
                assert lookup.matched == 4
                chains[shared] = (keys, blocks)
            # A longer chain over the stored one: the old part must become durable too.
            with Client(daemon.unix_target, use_shared_memory=shared) as client:
                namespace = client.register_namespace(SPEC)
                longer = namespace.keys(np.arange(6 * 16) + (100_000 if shared else 150_000))
                longer_blocks = blocks_for(6, seed=20 + shared)
                assert client.put(namespace, longer[:3], longer_blocks[:3]) == 3
                assert client.put(namespace, longer, longer_blocks, durable=True) == 6
                chains[(shared, "longer")] = (longer, longer_blocks)
    finally:
        stop(daemon, signal.SIGKILL)
    with run_daemon(directory, config=settings) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        for keys, blocks in chains.values():
            lookup = client.lookup(namespace, keys)
            assert lookup.matched == len(keys) and set(lookup.tiers) == {kvd_pb2.TIER_DISK}
            assert client.get_numpy(namespace, keys).tobytes() == blocks.tobytes()


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "inline"])
def test_a_durable_put_that_cannot_store_every_block_raises(tmp_path, shared):
    """A durable Put of 8 blocks whose 5th another client is writing (its
    reservation is open): the first 4 are made durable, and the call raises,
    saying so, instead of returning a short count the caller could ignore."""
    settings = config(tmp_path)
    directory = tmp_path / "d"
    daemon = start_daemon(directory, config=settings)
    with Client(daemon.unix_target, use_shared_memory=shared) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(8 * 16))
        blocks = blocks_for(8, seed=4)
        assert client.put(namespace, keys[:4], blocks[:4]) == 4  # host memory only (write-back)
        other = daemon_stub(daemon)
        reservation = other.Reserve(kvd_pb2.ReserveRequest(
            namespace_id=namespace.namespace_id, client_id="other-writer", parent_key=keys[3], keys=keys[4:5]))
        assert list(reservation.statuses) == [kvd_pb2.RESERVE_STATUS_RESERVED]
        with pytest.raises(NotDurableError) as raised:
            client.put(namespace, keys, blocks, durable=True)
        error = raised.value
        assert isinstance(error, grpc.RpcError)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert (error.durable, error.requested) == (4, 8)
        assert "keys[4:8]" in error.details() and "another client is writing" in error.details()
    assert_durable_after_sigkill(daemon, directory, settings, keys[:4], blocks[:4])


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "inline"])
def test_a_durable_put_with_host_memory_pinned_full_raises(tmp_path, shared):
    """Four host slots, all pinned by another client's Get: nothing can be
    stored, and a durable Put says so with RESOURCE_EXHAUSTED."""
    settings = config(tmp_path, host_slots=4)
    with run_daemon(tmp_path / "d", config=settings) as daemon, \
            Client(daemon.unix_target, use_shared_memory=shared) as client:
        namespace = client.register_namespace(SPEC)
        pinned = namespace.keys(np.arange(4 * 16) + 90_000)
        assert client.put(namespace, pinned, blocks_for(4, seed=5)) == 4
        lease = daemon_stub(daemon).Get(kvd_pb2.GetRequest(
            namespace_id=namespace.namespace_id, client_id="reader", keys=pinned, lease_ms=60_000))
        assert lease.matched == 4
        keys = namespace.keys(np.arange(8 * 16))
        with pytest.raises(NotDurableError) as raised:
            client.put(namespace, keys, blocks_for(8, seed=6), durable=True)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (raised.value.durable, raised.value.requested) == (0, 8)
        assert client.lookup(namespace, keys).matched == 0


def test_a_durable_chain_longer_than_host_memory_raises_with_what_is_durable(tmp_path):
    """Eight host slots, a durable Put of 24 blocks: the first 8 are stored
    and made durable, the call raises for the other 16, and those 8 survive
    a SIGKILL."""
    directory = tmp_path / "d"
    settings = config(tmp_path, host_slots=8)
    daemon = start_daemon(directory, config=settings)
    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(24 * 16))
        blocks = blocks_for(24, seed=7)
        with pytest.raises(NotDurableError) as raised:
            client.put(namespace, keys, blocks, durable=True)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (raised.value.durable, raised.value.requested) == (8, 24)
        assert "keys[8:24]" in raised.value.details()
    assert_durable_after_sigkill(daemon, directory, settings, keys[:8], blocks[:8])


def test_make_durable_reports_counts_in_trailing_metadata(tmp_path):
    """The RPC itself, as a client in another language would call it."""
    settings = config(tmp_path)
    directory = tmp_path / "d"
    daemon = start_daemon(directory, config=settings)
    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(6 * 16))
        blocks = blocks_for(4, seed=8)
        client.put(namespace, keys[:4], blocks)
        stub = daemon_stub(daemon)
        response = stub.MakeDurable(kvd_pb2.MakeDurableRequest(namespace_id=namespace.namespace_id, keys=keys[:4]))
        assert response.durable == 4
        with pytest.raises(grpc.RpcError) as raised:
            stub.MakeDurable(kvd_pb2.MakeDurableRequest(namespace_id=namespace.namespace_id, keys=keys))
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        assert "keys[4:6] are not stored" in raised.value.details()
        trailers = dict(raised.value.trailing_metadata())
        assert trailers == {"kvd-durable-blocks": "4", "kvd-requested-blocks": "6"}
    assert_durable_after_sigkill(daemon, directory, settings, keys[:4], blocks)


def test_a_durable_commit_that_only_aborts_waits_for_nothing(tmp_path):
    settings = config(tmp_path)
    with run_daemon(tmp_path / "d", config=settings) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(2 * 16))
        stub = daemon_stub(daemon)
        reserved = stub.Reserve(kvd_pb2.ReserveRequest(namespace_id=namespace.namespace_id, client_id="c", keys=keys))
        aborted = stub.Commit(kvd_pb2.CommitRequest(namespace_id=namespace.namespace_id, client_id="c",
                                                    lease_id=reserved.lease_id, abort_keys=keys[1:],
                                                    ack=kvd_pb2.ACK_DURABLE))
        assert (aborted.sealed, aborted.aborted, aborted.durable) == (0, 1, 0)
        sealed = stub.Commit(kvd_pb2.CommitRequest(namespace_id=namespace.namespace_id, client_id="c",
                                                   lease_id=reserved.lease_id, keys=keys[:1],
                                                   ack=kvd_pb2.ACK_DURABLE))
        assert (sealed.sealed, sealed.durable) == (1, 1)


def assert_durable_after_sigkill(daemon, directory: Path, settings: dict, keys, blocks: np.ndarray) -> None:
    """Kill the daemon with SIGKILL, start it again on the same drives: the blocks come back from disk."""
    stop(daemon, signal.SIGKILL)
    with run_daemon(directory, config=settings) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        lookup = client.lookup(namespace, keys)
        assert lookup.matched == len(keys) and set(lookup.tiers) == {kvd_pb2.TIER_DISK}
        assert client.get_numpy(namespace, keys).tobytes() == blocks.tobytes()


def daemon_stub(daemon):
    from kvd.v1 import kvd_pb2_grpc

    return kvd_pb2_grpc.KvdStub(grpc.insecure_channel(daemon.unix_target))


def test_with_its_only_drive_quarantined_the_daemon_serves_memory_and_refuses_durability(tmp_path):
    """One drive, its CURRENT garbage: the daemon starts (not exit 1 in a
    restart loop), serves from host memory, and a durable Put fails at once
    saying why, instead of waiting out its deadline."""
    from kvd.testing.damage import current_garbage

    settings = config(tmp_path)
    settings["disk"]["directories"] = settings["disk"]["directories"][:1]
    directory = tmp_path / "d"
    with run_daemon(directory, config=settings) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        client.put(namespace, namespace.keys(np.arange(32)), blocks_for(2, seed=30), durable=True)
    current_garbage(tmp_path / "nvme0")
    with run_daemon(directory, config=settings) as daemon, \
            Client(daemon.unix_target, timeout_s=120) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(32) + 5000)
        blocks = blocks_for(2, seed=31)
        assert client.put(namespace, keys, blocks) == 2
        assert client.get_numpy(namespace, keys).tobytes() == blocks.tobytes()
        more = namespace.keys(np.arange(32) + 9000)
        with pytest.raises(NotDurableError) as raised:
            client.put(namespace, more, blocks, durable=True)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no drive takes writes: drive 0: quarantined" in raised.value.details()
        assert "CURRENT" in raised.value.details()


@pytest.mark.parametrize("fsync", ["group", "none"])
def test_a_durable_ack_waits_for_a_commit_that_covers_its_blocks(tmp_path, fsync):
    """Under group (with a commit interval far longer than the test) and
    none, a durable Put starts a commit and returns after it: for blocks
    written just now, and for blocks already written but not yet synced (a
    retry). Before the fix both returned once written, with no sync at all."""
    settings = config(tmp_path, fsync=fsync, write_mode="through")
    settings["disk"]["group_commit_ms"] = 600_000
    with run_daemon(tmp_path / "d", config=settings) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        written = namespace.keys(np.arange(4 * 16))
        assert client.put(namespace, written, blocks_for(4, seed=1)) == 4  # written through, not synced
        commits, fdatasyncs = daemon.metric("kvd_disk_commits_total"), daemon.metric("kvd_disk_fdatasyncs_total")
        assert client.put(namespace, written, blocks_for(4, seed=1), durable=True) == 4
        assert daemon.metric("kvd_disk_commits_total") > commits
        assert daemon.metric("kvd_disk_fdatasyncs_total") > fdatasyncs
        commits = daemon.metric("kvd_disk_commits_total")
        fresh = namespace.keys(np.arange(4 * 16) + 10_000)
        assert client.put(namespace, fresh, blocks_for(4, seed=2), durable=True) == 4
        assert daemon.metric("kvd_disk_commits_total") > commits
