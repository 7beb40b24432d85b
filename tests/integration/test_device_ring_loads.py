"""A pool registered with io_ring (issue 37 item 3): disk hits are read through the pool's I/O ring
straight from the drives into the engine's pages, as the GPU-initiated path does, with no host-tier
slot taken; blocks in host memory still come by kvd's copies and the flag word. A real daemon in
another process, a disk tier on real files with O_DIRECT, the CPU device synchronous and
asynchronous; the engine publishes with the submit kernel's own host code (io_ring_publish) and
waits with the wait kernel's (RingMemory.wait). The proxy reads only what kvd granted: a forged or
replayed read fails its layer and lands nothing; the ring goes only to the pool's tenant."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvd import arena_protocol
from kvd.client import Client
from kvd.device.cpu import DELAY_ENV
from kvd.device.io_ring import READ_FIELDS, WaitState
from kvd.errors import NotFound
from kvd.testing.daemon import run_daemon
from kvd.tiers.disk.layout import SEGMENT_PREFIX, SEGMENT_SUFFIX
from kvd.v1 import kvd_pb2
from tests.integration.test_device_disk_loads import disk_config, stored_on_disk_only
from tests.integration.test_device_plane import KVD, SPEC, Engine, wait_for

WAIT_S = 30.0


@pytest.fixture(params=["synchronous", "asynchronous"])
def delay(request) -> str:
    return "5" if request.param == "asynchronous" else "0"


def ring_engine(client: Client, daemon, own_memory: bool = False) -> Engine:
    """own_memory: the pool is this process's own memory (a CPU engine's tensors), which the proxy
    writes through this process's memory file; else CPU-device memory the daemon maps."""
    return Engine(client, arena_socket=arena_protocol.socket_path_for_target(daemon.unix_target), io_ring=True,
                  own_memory=own_memory)


def ring_loads(daemon) -> dict[str, float]:
    samples = daemon.metric_samples("kvd_device_ring_loads_total")
    return {result: samples[f'kvd_device_ring_loads_total{{result="{result}"}}'] for result in ("verified", "failed")}


@pytest.mark.parametrize("own_memory", [False, True], ids=["mapped-pool", "engine-process-memory"])
def test_disk_hits_come_through_the_ring_and_host_hits_by_kvds_copies(tmp_path, delay, own_memory):
    """Six blocks, the first two back in host memory, four only on disk: kvd copies the two (flag
    word), grants the four blocks' reads of every layer, and the engine's waits end OK with the
    stored bytes in its pages. No host slot was taken for the four; the pins go when the reads are."""
    with run_daemon(tmp_path / "kvd", config=disk_config(tmp_path), env={DELAY_ENV: delay}) as daemon, \
            Client(daemon.unix_target) as client:
        engine = ring_engine(client, daemon, own_memory)
        data, keys = stored_on_disk_only(client, engine, 6, seed=3)
        assert len(client.get_numpy(engine.namespace, keys[:2])) == 2  # back in host memory
        host_blocks = daemon.metric_samples("kvd_tier_blocks")['kvd_tier_blocks{tier="host"}']
        pages = [9, 2, 30, 14, 0, 21]
        base = engine.pool.flag(KVD)
        loaded = engine.pool.load(keys, pages, KVD, base)
        assert loaded.matched == 6 and list(loaded.by_ring) == [False] * 2 + [True] * 4
        reads = engine.pool.ring_reads(loaded)
        assert reads.blocks == 4 and reads.rows.shape == (SPEC.num_layers, 4, len(READ_FIELDS))
        reads.publish()
        for layer in range(SPEC.num_layers):
            wait_for(lambda: engine.pool.flag(KVD) >= base + layer + 1)
            result = reads.wait(layer, timeout_s=WAIT_S)
            assert (result.state, result.failed) == (WaitState.OK, 0), layer
        assert engine.pool.flag(KVD) == loaded.done_value
        for page, block in zip(pages, data):
            np.testing.assert_array_equal(engine.read(page), block)
        wait_for(lambda: daemon.metric("kvd_lease_pinned_blocks") == 0)
        assert ring_loads(daemon) == {"verified": 1, "failed": 0}
        assert daemon.metric_samples("kvd_tier_blocks")['kvd_tier_blocks{tier="host"}'] == host_blocks
        assert list(client.lookup(engine.namespace, keys).tiers)[2:] == [kvd_pb2.TIER_DISK] * 4
        engine.close()


def test_a_forged_or_replayed_read_fails_its_layer_and_lands_nothing(tmp_path):
    """The engine shares the ring, so it could publish anything: a read aimed at another block's
    disk slot, or a granted read published twice, fails without I/O (its layer's wait FAILED) and
    writes nothing. The grants it never used are revoked at [device] flag_timeout_ms and the pins go."""
    with run_daemon(tmp_path / "kvd", config=disk_config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        engine = ring_engine(client, daemon)
        data, keys = stored_on_disk_only(client, engine, 4, seed=9)
        loaded = engine.pool.load(keys[:2], [5, 6], KVD, engine.pool.flag(KVD))
        reads = engine.pool.ring_reads(loaded)
        forged = reads.rows[1].copy()  # layer 1 of both blocks...
        forged[0, 1] = reads.rows[1, 1, 1]  # ...block 0's read aimed at block 1's bytes on disk
        forged[1, 3] += 4096  # block 1's read into another place of the pool
        counts = reads.counts
        for rows in (forged, reads.rows[0], reads.rows[0]):  # the forgeries, then layer 0 and its replay
            counts.ring.publish(rows, timeout_s=5)
        assert counts.ring.settle(0, 4, timeout_s=WAIT_S).ok and counts.ring.settle(1, 2, timeout_s=WAIT_S).ok
        assert (counts.ring.failed(0), counts.ring.failed(1)) == (2, 2)
        np.testing.assert_array_equal(engine.read(5)[0], data[0][0])  # layer 0's grants were good, once
        assert not engine.read(5)[1:].any() and not engine.read(7).any()
        wait_for(lambda: daemon.metric("kvd_lease_pinned_blocks") == 0)  # layers 1-3 revoked at the deadline
        assert ring_loads(daemon) == {"verified": 0, "failed": 1}
        engine.close()


def test_the_ring_goes_only_to_the_pools_tenant_and_only_with_a_disk_tier(tmp_path):
    with run_daemon(tmp_path / "kvd", config=disk_config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        engine = ring_engine(client, daemon)
        path = arena_protocol.socket_path_for_target(daemon.unix_target)
        with pytest.raises(NotFound, match="no pool of this tenant has that ring token"):
            arena_protocol.receive_arena(path, None, "", ring="0" * 32)
        engine.close()
    config = disk_config(tmp_path)
    del config["disk"]
    with run_daemon(tmp_path / "kvd-no-disk", config=config) as daemon, Client(daemon.unix_target) as client:
        with pytest.raises(grpc.RpcError) as refused:
            ring_engine(client, daemon)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "io_ring: this kvd has no disk tier" in refused.value.details()


def test_an_engine_that_never_publishes_costs_only_the_deadline(tmp_path, delay):
    """Grants nobody uses are revoked at [device] flag_timeout_ms: the pins go, the pool unregisters,
    and a daemon stopped meanwhile drains and exits 0."""
    with run_daemon(tmp_path / "kvd", config=disk_config(tmp_path), env={DELAY_ENV: delay}) as daemon:
        with Client(daemon.unix_target) as client:
            engine = ring_engine(client, daemon)
            _, keys = stored_on_disk_only(client, engine, 3, seed=4)
            assert engine.pool.ring_reads(engine.pool.load(keys, [0, 1, 2], KVD, engine.pool.flag(KVD))).blocks == 3
            assert daemon.metric("kvd_lease_pinned_blocks") == 3
            engine.close()  # waits for the load's grants: revoked at the deadline
            assert daemon.metric("kvd_lease_pinned_blocks") == 0 and ring_loads(daemon)["failed"] == 1
            engine = ring_engine(client, daemon)
            engine.pool.load(keys, [3, 4, 5], KVD, engine.pool.flag(KVD))
            assert daemon.stop() == 0


def test_a_block_damaged_on_disk_fails_its_layer_and_is_dropped_not_offered_again(tmp_path):
    """Bytes of block 1's layer 2 flipped on the drive: the proxy's CRC-32C check fails that read, the
    engine's wait for layer 2 ends FAILED and nothing lands in that page's layer. kvd then reads the
    blocks that failed through its own path, which finds the damage, counts it and drops block 1 with
    the chain under it: the next Lookup offers block 0 only."""
    with run_daemon(tmp_path / "kvd", config=disk_config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        engine = ring_engine(client, daemon)
        data, keys = stored_on_disk_only(client, engine, 3, seed=12)
        loaded = engine.pool.load(keys, [4, 5, 6], KVD, engine.pool.flag(KVD))
        reads = engine.pool.ring_reads(loaded)
        file, offset = int(reads.rows[2, 1, 0]), int(reads.rows[2, 1, 1])
        segment = sorted((tmp_path / "nvme0").glob(f"{SEGMENT_PREFIX}*{SEGMENT_SUFFIX}"))[file]
        with open(segment, "r+b") as drive:
            drive.seek(offset + 100)
            byte = drive.read(1)
            drive.seek(offset + 100)
            drive.write(bytes([byte[0] ^ 0x5A]))
        reads.publish()
        states = [reads.wait(layer, timeout_s=WAIT_S).state for layer in range(SPEC.num_layers)]
        assert states[2] is WaitState.FAILED and states[:2] == [WaitState.OK] * 2
        assert reads.settle(timeout_s=WAIT_S)
        assert not engine.read(5)[2].any()  # the damaged layer landed nowhere
        wait_for(lambda: client.lookup(engine.namespace, keys).matched == 1)
        assert sum(daemon.metric_samples("kvd_disk_corrupt_blocks_total").values()) == 1
        wait_for(lambda: daemon.metric("kvd_lease_pinned_blocks") == 0)
        assert ring_loads(daemon) == {"verified": 0, "failed": 1}
        engine.close()
