"""LoadLayers of blocks that are only on disk (issue 37 item 3): each layer goes to the engine's pages
as it lands from the drives and checks out, against a real daemon in another process with a disk
tier on real files and the CPU device, synchronous and asynchronous (copies and flag stores land
after they are issued, as a GPU's do). A read that fails turns the flag word FAILED, after every
copy issued has landed; the daemon keeps serving and holds no pins."""

from __future__ import annotations

import contextlib

import grpc
import numpy as np
import pytest

from kvd.client import Client
from kvd.client.device import FAILED
from kvd.device.cpu import DELAY_ENV
from kvd.io.faults import FAULTS_ENV
from kvd.testing.daemon import run_daemon
from kvd.testing.slow_drive import slowed_drive
from kvd.v1 import kvd_pb2
from tests.integration.test_device_plane import KVD, SPEC, Engine, blocks, keys_for, wait_for


def disk_config(tmp_path) -> dict:
    return {"host": {"capacity_bytes": 16 << 20, "slot_bytes": 64 << 10},
            "disk": {"directories": [str(tmp_path / "nvme0")], "capacity_bytes": 64 << 20,
                     "segment_bytes": 8 << 20, "slot_bytes": 64 << 10, "write_mode": "through"},
            "device": {"kind": "cpu", "flag_timeout_ms": 2000, "pool_lease_ms": 5000}}


@pytest.fixture(params=["synchronous", "asynchronous"])
def delay(request) -> str:
    return "5" if request.param == "asynchronous" else "0"


def stored_on_disk_only(client: Client, engine: Engine, count: int, seed: int):
    """`count` blocks put durably, then every host copy demoted: their only copy is on disk."""
    data, keys = blocks(count, seed), keys_for(seed, count)
    assert client.put(engine.namespace, keys, data, durable=True) == count
    assert client.demote().blocks_demoted >= count
    assert list(client.lookup(engine.namespace, keys).tiers) == [kvd_pb2.TIER_DISK] * count
    return data, keys


def test_a_load_from_disk_lands_layer_by_layer_with_the_stored_bytes(tmp_path, delay):
    with run_daemon(tmp_path / "kvd", config=disk_config(tmp_path), env={DELAY_ENV: delay}) as daemon, \
            Client(daemon.unix_target) as client:
        engine = Engine(client)
        data, keys = stored_on_disk_only(client, engine, 6, seed=3)
        pages = [9, 2, 30, 14, 0, 21]
        base = engine.pool.flag(KVD)
        loaded = engine.pool.load(keys, pages, KVD, base)
        assert loaded.matched == 6 and loaded.done_value == base + SPEC.num_layers
        assert bytes(loaded.tiers) == bytes([kvd_pb2.TIER_DISK] * 6)  # what the blocks were before the load
        wait_for(lambda: engine.pool.flag(KVD) >= loaded.done_value)
        assert engine.pool.flag(KVD) == loaded.done_value  # not FAILED
        for page, block in zip(pages, data):
            np.testing.assert_array_equal(engine.read(page), block)
        wait_for(lambda: daemon.metric("kvd_lease_pinned_blocks") == 0)
        assert daemon.metric_samples("kvd_device_disk_loads_total") == {
            'kvd_device_disk_loads_total{result="landed"}': 1.0, 'kvd_device_disk_loads_total{result="failed"}': 0.0}
        # By default the slots they were read through stay as their host copies.
        assert list(client.lookup(engine.namespace, keys).tiers) == [kvd_pb2.TIER_HOST] * 6
        engine.close()


def test_without_keeping_host_copies_a_load_from_disk_leaves_host_memory_as_it_was(tmp_path):
    """[device] disk_loads_keep_host_copy = false: the blocks reach the engine through host slots
    that are given back once the copies have landed; the blocks stay only on disk."""
    config = disk_config(tmp_path)
    config["device"]["disk_loads_keep_host_copy"] = False
    with run_daemon(tmp_path / "kvd", config=config) as daemon, Client(daemon.unix_target) as client:
        engine = Engine(client)
        data, keys = stored_on_disk_only(client, engine, 5, seed=11)
        resident = daemon.metric_samples("kvd_tier_blocks")['kvd_tier_blocks{tier="host"}']
        loaded = engine.pool.load(keys, [1, 3, 5, 7, 9], KVD, engine.pool.flag(KVD))
        wait_for(lambda: engine.pool.flag(KVD) >= loaded.done_value)
        assert engine.pool.flag(KVD) == loaded.done_value
        for page, block in zip([1, 3, 5, 7, 9], data):
            np.testing.assert_array_equal(engine.read(page), block)
        wait_for(lambda: list(client.lookup(engine.namespace, keys).tiers) == [kvd_pb2.TIER_DISK] * 5)
        assert daemon.metric_samples("kvd_tier_blocks")['kvd_tier_blocks{tier="host"}'] == resident
        engine.close()


def test_a_read_that_fails_turns_the_flag_failed_and_leaves_no_pins(tmp_path, delay):
    faults = {DELAY_ENV: delay, FAULTS_ENV: "read:EIO:1"}
    with run_daemon(tmp_path / "kvd", config=disk_config(tmp_path), env=faults) as daemon, \
            Client(daemon.unix_target) as client:
        engine = Engine(client)
        data, keys = stored_on_disk_only(client, engine, 4, seed=5)
        base = engine.pool.flag(KVD)
        loaded = engine.pool.load(keys, [0, 1, 2, 3], KVD, base)
        assert loaded.matched == 4  # what it found; the reads follow the answer
        wait_for(lambda: engine.pool.flag(KVD) >= FAILED)
        assert engine.pool.flag(KVD) == FAILED | loaded.done_value
        wait_for(lambda: daemon.metric("kvd_lease_pinned_blocks") == 0)
        # The block whose read failed is lost, with the chain after it; the daemon serves on.
        assert len(client.get_numpy(engine.namespace, keys)) < 4
        again = engine.pool.load(keys, [4, 5, 6, 7], KVD, engine.pool.flag(KVD) & ~FAILED)
        wait_for(lambda: engine.pool.flag(KVD) == again.done_value)
        assert daemon.metric_samples("kvd_device_disk_loads_total")['kvd_device_disk_loads_total{result="failed"}'] == 1
        engine.close()


def test_a_daemon_stopped_during_a_load_from_disk_exits_cleanly(tmp_path, delay):
    """SIGTERM right after a LoadLayers that still reads from disk: the drain waits for the reads and
    the copies (no slot goes back while a read or a copy still uses it), and kvd exits 0. The engine's
    flag ends at the load's value or FAILED, never in between."""
    with run_daemon(tmp_path / "kvd", config=disk_config(tmp_path), env={DELAY_ENV: delay}) as daemon:
        with Client(daemon.unix_target) as client:
            engine = Engine(client)
            _, keys = stored_on_disk_only(client, engine, 24, seed=7)
            base = engine.pool.flag(KVD)
            loaded = engine.pool.load(keys, list(range(24)), KVD, base)
            assert daemon.stop() == 0
            assert engine.pool.flag(KVD) in (loaded.done_value, FAILED | loaded.done_value)


@contextlib.contextmanager
def waiting_on_a_prefetch(tmp_path, seed: int):
    """A daemon whose drive reads 16 KiB a second, 8 blocks of 16 KiB on it only, and a Prefetch of
    them running (8 s): a Get of those blocks now waits for its reads. (daemon, client, engine,
    data, keys, drive)."""
    with slowed_drive(tmp_path / "drive", size_bytes=256 << 20) as drive:
        config = disk_config(tmp_path)
        config["disk"]["directories"] = [str(drive.directory)]
        with run_daemon(tmp_path / "kvd", config=config) as daemon, Client(daemon.unix_target) as client:
            drive.admit(daemon.pid)
            engine = Engine(client)
            data, keys = stored_on_disk_only(client, engine, 8, seed=seed)
            drive.throttle(read_bps=16 << 10)
            client.prefetch(engine.namespace, keys)
            yield daemon, client, engine, data, keys, drive


def test_a_load_waiting_for_another_requests_reads_is_cancelled_without_waiting_for_them(tmp_path):
    """A LoadLayers whose Get waits for reads another request started (a Prefetch of the same
    blocks) and that the engine has cancelled: kvd lets the Get go at once, issues nothing and
    marks the flag FAILED; it does not first wait for those reads."""
    with waiting_on_a_prefetch(tmp_path, seed=21) as (daemon, client, engine, data, keys, drive):
        base, cancel = engine.pool.flag(KVD) + 1, 5
        engine.pool.mark(cancel, base)  # the engine gave up on this load
        loaded = engine.pool.load(keys, list(range(8)), KVD, base, cancel_flag=cancel)
        assert loaded.matched == 0 and engine.pool.flag(KVD) == FAILED | (base + SPEC.num_layers)
        # Answered while the prefetch still reads: the last block is not in host memory yet.
        assert client.lookup(engine.namespace, keys).tiers[-1] == kvd_pb2.TIER_DISK
        assert not any(engine.read(page).any() for page in range(8))
        drive.throttle()
        wait_for(lambda: daemon.metric("kvd_lease_pinned_blocks") == 0)
        again = engine.pool.load(keys, list(range(8, 16)), KVD, base + 10, cancel_flag=cancel)
        wait_for(lambda: engine.pool.flag(KVD) == again.done_value)
        for page, block in zip(range(8, 16), data):
            np.testing.assert_array_equal(engine.read(page), block)
        engine.close()


def test_a_pool_unregistered_while_its_load_waits_gets_not_found_and_the_daemon_serves_on(tmp_path):
    """The pool's lease (5 s here) runs out while a LoadLayers waits for another request's reads
    (8 s): kvd unregisters the pool and unmaps its memory, so the load must not touch it after
    the wait. The call gets NOT_FOUND naming why; the daemon keeps serving and holds no pins."""
    with waiting_on_a_prefetch(tmp_path, seed=22) as (daemon, client, engine, data, keys, drive):
        with pytest.raises(grpc.RpcError) as refused:
            engine.pool.load(keys, list(range(8)), KVD, engine.pool.flag(KVD) + 1)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert "was unregistered while the transfer waited" in refused.value.details()
        drive.throttle()
        wait_for(lambda: daemon.metric("kvd_lease_pinned_blocks") == 0)
        assert len(client.get_numpy(engine.namespace, keys)) == 8  # the daemon serves on
        assert daemon.alive()
