"""The disk tier through a real daemon: write-through, restore, restart, corruption,
write modes and watermarks.

Also through a real daemon: test_disk_tier_arena.py (layers streamed from disk, reads
and writes in place in the arena) and test_disk_tier_faults.py (drive faults, drives
of another layout or of zero segments); shared pieces in
tests/integration/disk_tier_helpers.py."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from kvd.client import Client
from kvd.testing.daemon import run_daemon, start_daemon
from kvd.v1 import kvd_pb2
from tests.integration.disk_tier_helpers import (HOST_SLOTS, SPEC, blocks_for, disk_config, log_records, metric_samples,
    stored_with_a_corrupt_block, wait_until)


@pytest.mark.parametrize("schedule", ["slack", "fifo"])
def test_blocks_evicted_from_host_come_back_from_disk(tmp_path, schedule):
    config = disk_config(tmp_path, io_schedule=schedule, write_chunk_blocks=3)
    with run_daemon(tmp_path / "d", config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        first = namespace.keys(np.arange(12 * 16))
        first_blocks = blocks_for(12, seed=1)
        assert client.put(namespace, first, first_blocks, durable=True) == 12
        # Twice the host tier's size of other blocks push the first ones out.
        # Durable, so that no write round still pins them when the Get comes:
        # a pinned block is no candidate for demotion, and the watermark
        # demotion after the Get would then take the blocks it just read.
        for round_ in range(2):
            keys = namespace.keys(np.arange(HOST_SLOTS * 16) + 10**6 * (round_ + 1))
            client.put(namespace, keys, blocks_for(HOST_SLOTS, seed=10 + round_), durable=True)
        lookup = client.lookup(namespace, first)
        assert lookup.matched == 12
        assert set(lookup.tiers) == {kvd_pb2.TIER_DISK}
        assert np.array_equal(client.get_numpy(namespace, first), first_blocks)
        # Now in the host tier again.
        assert set(client.lookup(namespace, first).tiers) == {kvd_pb2.TIER_HOST}
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_tier_moves_total{source_tier="disk",target_tier="host"}'] >= 12
        assert samples['kvd_disk_failures_total{operation="load"}'] == 0


def test_admission_filter_spares_the_disk_but_not_durable_puts(tmp_path):
    """disk.admission_min_hits = 3: blocks Put once are dropped from host
    memory unwritten (and counted); an ACK_DURABLE Put is written anyway."""
    config = disk_config(tmp_path, admission_min_hits=3)
    config["host"]["policy"] = "s3fifo"
    with run_daemon(tmp_path / "d", config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        kept = namespace.keys(np.arange(6 * 16))
        kept_blocks = blocks_for(6, seed=4)
        assert client.put(namespace, kept, kept_blocks, durable=True) == 6
        for round_ in range(2):
            keys = namespace.keys(np.arange(HOST_SLOTS * 16) + 10**6 * (round_ + 1))
            client.put(namespace, keys, blocks_for(HOST_SLOTS, seed=20 + round_))
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_tier_moves_total{source_tier="host",target_tier="disk"}'] == 6
        assert samples["kvd_disk_admission_rejected_total"] >= HOST_SLOTS
        assert client.lookup(namespace, kept).matched == 6
        assert np.array_equal(client.get_numpy(namespace, kept), kept_blocks)


def test_durable_blocks_survive_a_restart_and_kill(tmp_path):
    directory = tmp_path / "d"
    config = disk_config(tmp_path)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(12 * 16))
        blocks = blocks_for(12, seed=2)
        assert client.put(namespace, keys, blocks, durable=True) == 12
    # A clean restart, then a SIGKILL, then another start: nothing durable is lost.
    for stop in (signal.SIGTERM, signal.SIGKILL):
        daemon = start_daemon(directory, config=config)
        try:
            with Client(daemon.unix_target) as client:
                namespace = client.register_namespace(SPEC)
                lookup = client.lookup(namespace, keys)
                assert lookup.matched == 12 and set(lookup.tiers) == {kvd_pb2.TIER_DISK}
                assert np.array_equal(client.get_numpy(namespace, keys), blocks)
        finally:
            daemon.stop(stop)


def test_a_corrupted_block_is_never_served(tmp_path):
    directory, config, keys, blocks = stored_with_a_corrupt_block(tmp_path, seed=3)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        result = client.get(namespace, keys)
        # Blocks 0..2 are good; block 3 is corrupt, so it and all after it are misses, and the
        # client is told it was damage, not a miss.
        assert result.blocks.shape[0] == 3 and result.corrupt and result.cut == kvd_pb2.GET_CUT_CORRUPT
        assert np.array_equal(result.blocks, blocks[:3])
        assert client.lookup(namespace, keys).matched == 3
        again = client.get(namespace, keys)  # dropped now: from here on, a plain miss
        assert again.blocks.shape[0] == 3 and again.cut == kvd_pb2.GET_CUT_NONE
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_disk_failures_total{operation="load"}'] == 1
        # Damage is never silent: counted per namespace, and logged with where it was.
        assert samples[f'kvd_disk_corrupt_blocks_total{{namespace="{namespace.namespace_id.hex()[:16]}"}}'] == 1
        [line] = [record for record in log_records(daemon) if "failed its checksum" in record.get("msg", "")]
        assert line["key"] == keys[3].hex()[:16] and line["namespace"] == namespace.namespace_id.hex()[:16]
        assert {"drive", "slot"} <= set(line)
        # What was lost can be put again, and is then served.
        assert client.put(namespace, keys, blocks, durable=True) == 6  # the 3 left and the 3 put again: all durable
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)


def test_a_get_from_disk_streams_its_blocks_out_and_a_corrupt_one_is_still_a_miss(tmp_path):
    """A large shared-memory Get goes over GetBlocks (here every Get: streamed_get_min_bytes=0).
    The daemon reads the blocks whole and says, run by run, how many leading blocks have landed;
    block 3 is corrupt, so `matched` drops to 3 when its run is checked and never grows again.
    get_numpy of both clients copies what has landed as it goes and ends with the exact prefix."""
    import asyncio

    from kvd.client import AsyncClient

    directory, config, keys, blocks = stored_with_a_corrupt_block(tmp_path, seed=21)
    with (run_daemon(directory, config=config) as daemon,
          Client(daemon.unix_target, streamed_get_min_bytes=0) as client):
        namespace = client.register_namespace(SPEC)
        request = kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, client_id="raw", keys=keys,
                                     arena_instance_id=client.arena_info().instance_id)
        messages = list(client._stub.GetBlocks(request, timeout=30))
        # Offsets first, one message per block (fewer blocks than runs), the closing one.
        assert [(message.matched, message.blocks_ready) for message in messages] == [
            (6, 0), (6, 1), (6, 2), (6, 3), (3, 3), (3, 3), (3, 3), (3, 3)]
        # The closing message says why: damage.
        assert [message.cut for message in messages] == [kvd_pb2.GET_CUT_NONE] * 7 + [kvd_pb2.GET_CUT_CORRUPT]
        assert len(messages[0].offsets) == 6 and not any(message.offsets for message in messages[1:])
        client._stub.Release(kvd_pb2.ReleaseRequest(client_id="raw", lease_ids=[messages[0].lease_id]), timeout=30)
        client.demote()
        got = client.get_numpy(namespace, keys)
        np.testing.assert_array_equal(got, blocks[:3])
        assert metric_samples(daemon.metrics_url)['kvd_rpc_total{code="OK",method="GetBlocks"}'] == 2

        async def in_async(target: str) -> np.ndarray:
            async with AsyncClient(target, streamed_get_min_bytes=0) as aio:
                await aio.demote()
                return await aio.get_numpy(await aio.register_namespace(SPEC), keys)

        np.testing.assert_array_equal(asyncio.run(in_async(daemon.unix_target)), blocks[:3])
        assert metric_samples(daemon.metrics_url)['kvd_rpc_total{code="OK",method="GetBlocks"}'] == 3
        assert client.stats().leases == 0


def test_durable_ack_without_disk_tier_is_refused(tmp_path):
    import grpc

    with run_daemon(tmp_path) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        with pytest.raises(grpc.RpcError) as raised:
            client.put(namespace, namespace.keys(np.arange(16)), blocks_for(1, 0), durable=True)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "needs a disk tier" in raised.value.details()


def test_status_shows_the_disk_tier(tmp_path):
    import subprocess
    import sys

    with run_daemon(tmp_path / "d", config=disk_config(tmp_path)) as daemon:
        result = subprocess.run([sys.executable, "-m", "kvd", "status", "--target", daemon.unix_target, "--json"],
                                capture_output=True, text=True, timeout=60, check=False)
        status = json.loads(result.stdout)
        disk = [tier for tier in status["tiers"] if tier["tier"] == "disk"]
        assert disk and disk[0]["capacity_bytes"] == 2 * (8 << 20)
    assert os.path.isdir(tmp_path / "nvme0")


@pytest.mark.parametrize("mode", ["behind", "back", "through"])
def test_write_modes(tmp_path, mode):
    """Write-behind (the default) and write-through write every block at once; write-back waits
    for host pressure, and kvd_disk_oldest_unwritten_seconds says how long its blocks have waited."""
    import time

    config = disk_config(tmp_path, write_mode=mode)
    config["host"].update(high_watermark=0.75, low_watermark=0.5)
    with run_daemon(tmp_path / "d", config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        few = namespace.keys(np.arange(4 * 16))
        client.put(namespace, few, blocks_for(4, seed=5))  # 4 of 16 host slots: no pressure

        def written() -> float:
            return metric_samples(daemon.metrics_url)['kvd_tier_moves_total{source_tier="host",target_tier="disk"}']

        oldest = lambda: daemon.metric("kvd_disk_oldest_unwritten_seconds")
        if mode != "back":
            wait_until(lambda: written() == 4)
            wait_until(lambda: oldest() == 0)  # nothing left waiting (after the writer's next turn)
        else:
            # Nothing to wait for: nothing must happen. A second of the writer's
            # 50 ms polls (a slow machine only makes a write less likely).
            time.sleep(1.0)
            assert written() == 0
            assert oldest() >= 0.9  # queued a second ago, to within the writer's turns
        # Fill the host tier: now write-back has to make room on disk too.
        more = namespace.keys(np.arange(HOST_SLOTS * 16) + 10**6)
        client.put(namespace, more, blocks_for(HOST_SLOTS, seed=6))
        wait_until(lambda: written() >= 4)


def test_watermarks_keep_puts_from_evicting_and_lose_nothing(tmp_path):
    """Write-back with the default watermarks (0.9 / 0.8 of 16 host slots):
    a stream of Puts far larger than host memory finds free slots, because
    the daemon writes back and demotes in the background; every block comes
    back bit-exact, from host memory or from disk."""
    high_watermark_blocks = int(0.9 * HOST_SLOTS)

    def reclaimed() -> None:
        """The engine's pause between requests: until the background reclaim
        has brought host memory under the high watermark (a condition, not a
        time: a slow machine only waits longer)."""
        wait_until(lambda: metric_samples(daemon.metrics_url)['kvd_tier_blocks{tier="host"}']
                   <= high_watermark_blocks)

    with run_daemon(tmp_path / "d", config=disk_config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        stored = []
        for batch in range(20):  # 40 blocks, 2.5x the host tier
            keys = namespace.keys(np.arange(2 * 16) + 10_000 * batch)
            blocks = blocks_for(2, seed=100 + batch)
            client.put(namespace, keys, blocks)
            stored.append((keys, blocks))
            reclaimed()
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_tier_evictions_total{tier="host"}'] == 0, "Puts had to evict on demand"
        assert samples["kvd_host_demotions_total"] >= 20
        for keys, blocks in stored:
            assert np.array_equal(client.get_numpy(namespace, keys), blocks)
            reclaimed()  # loads refill host memory
        assert metric_samples(daemon.metrics_url)['kvd_tier_evicted_blocks_total{reason="dropped",tier="host"}'] == 0
