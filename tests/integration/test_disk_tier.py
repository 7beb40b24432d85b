"""The disk tier through a real daemon: write-through, restore, restart, corruption."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec
from kvd.errors import FailedPrecondition
from kvd.testing.daemon import run_daemon, start_daemon
from kvd.v1 import kvd_pb2

# 4 layers x 16 KiB: every layer is one 4 KiB-aligned extent on disk.
SPEC = NamespaceSpec(model_id="disk-model", num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16,
                     kv_dtype=DType.FLOAT32)
HOST_SLOTS = 16


def disk_config(tmp_path: Path, **disk) -> dict:
    settings = {
        "directories": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")],
        "capacity_bytes": 8 << 20,
        "slot_bytes": 64 << 10,
        "segment_bytes": 4 << 20,
        "fsync": "strict",
        "write_batch_blocks": 4,
    }
    settings.update(disk)
    return {"host": {"capacity_bytes": HOST_SLOTS * (64 << 10), "slot_bytes": 64 << 10}, "disk": settings}


def blocks_for(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, *SPEC.block_shape), dtype=np.float32)


def flip_first_layer_byte(tmp_path: Path, block: np.ndarray) -> int:
    """Flip a byte of `block`'s first layer wherever the drives under
    tmp_path hold it (found by content, as a failing drive would scramble
    it); returns how many copies were flipped."""
    needle = block.reshape(-1).view(np.uint8)[:4096].tobytes()
    flipped = 0
    for segment in sorted(set(tmp_path.glob("nvme*/**/seg-*"))):
        data = bytearray(segment.read_bytes())
        position = data.find(needle)
        if position >= 0:
            data[position + 100] ^= 0xFF
            segment.write_bytes(bytes(data))
            flipped += 1
    return flipped


def stored_with_a_corrupt_block(tmp_path: Path, seed: int) -> tuple[Path, dict, list[bytes], np.ndarray]:
    """Six blocks made durable by one daemon run, then block 3 corrupted on
    the drives while no daemon runs: (daemon directory, config, keys, blocks
    as they were Put)."""
    directory = tmp_path / "d"
    config = disk_config(tmp_path)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(6 * 16))
        blocks = blocks_for(6, seed=seed)
        client.put(namespace, keys, blocks, durable=True)
    # Flip bytes everywhere on the drives where block 3's first layer sits.
    assert flip_first_layer_byte(tmp_path, blocks[3]) == 1
    return directory, config, keys, blocks


def log_records(daemon) -> list[dict]:
    """The daemon's JSON log lines, parsed (other lines skipped)."""
    records = []
    for line in daemon.log().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def wait_until(condition, timeout_s: float = 120.0) -> None:
    """Poll a condition of the daemon (its metrics) until it holds; the
    timeout only turns a hang into a failure."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the daemon never reached the awaited state"
        time.sleep(0.02)


def metric_samples(url: str) -> dict[str, float]:
    samples = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


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


def test_layers_arrive_in_order_from_disk(tmp_path):
    """GetLayers reports each layer as it lands: one message per layer, in
    order, and the blocks end bit-exact; from the host tier it is one step."""
    directory = tmp_path / "d"
    config = disk_config(tmp_path)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(8 * 16))
        blocks = blocks_for(8, seed=4)
        client.put(namespace, keys, blocks, durable=True)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        steps = []
        final = None
        for layers_ready, got in client.get_layers(namespace, keys):
            steps.append((layers_ready, got.shape[0]))
            # Every layer reported ready is already the stored one.
            assert np.array_equal(got[:, :layers_ready], blocks[: got.shape[0], :layers_ready])
            final = got.copy()
        # After a restart the blocks come from disk: one step per layer, in order.
        assert steps == [(0, 8)] + [(layer, 8) for layer in range(1, SPEC.num_layers + 1)] + [(SPEC.num_layers, 8)]
        assert np.array_equal(final, blocks)
        # Now resident in the host tier: everything is ready at once.
        steps = [(ready, got.shape[0]) for ready, got in client.get_layers(namespace, keys)]
        assert steps == [(SPEC.num_layers, 8)]
        assert client.stats().leases == 0


def test_the_async_client_streams_layers_as_the_sync_one_does(tmp_path):
    """AsyncClient.get_layers: from disk one step per layer, in order, each reported layer already
    the stored one; a corrupt block cut with what follows; from host memory one step; the lease
    released when the iteration ends, also when it is left early."""
    import asyncio

    from kvd.client import AsyncClient

    directory, config, keys, blocks = stored_with_a_corrupt_block(tmp_path, seed=17)

    async def scenario(target: str) -> None:
        async with AsyncClient(target) as client:
            namespace = await client.register_namespace(SPEC)
            steps = []
            async for layers_ready, got in client.get_layers(namespace, keys):
                np.testing.assert_array_equal(got[:, :layers_ready], blocks[:got.shape[0], :layers_ready])
                steps.append((layers_ready, got.shape[0]))
            # Block 3 is corrupt: its first layer fails, so it and every block after it are cut there.
            assert steps == [(0, 6), (1, 3), *[(layer, 3) for layer in range(2, SPEC.num_layers + 1)],
                             (SPEC.num_layers, 3)]
            np.testing.assert_array_equal(got, blocks[:3])
            assert [(ready, got.shape[0]) async for ready, got in client.get_layers(namespace, keys)] == [
                (SPEC.num_layers, 3)]
            stream = client.get_layers(namespace, keys[:2])
            await stream.__anext__()
            await stream.aclose()  # left early: its lease is released all the same
            assert (await client.stats()).leases == 0

    with run_daemon(directory, config=config) as daemon:
        asyncio.run(scenario(daemon.unix_target))


def test_pinned_blocks_are_read_from_disk_into_the_arena_and_held_until_released(tmp_path):
    """get_pinned: a cold Get left in the arena, read-only, exact, a corrupt block a miss, the
    slots pinned (not deletable) until release, and the lease gone after it."""
    directory, config, keys, blocks = stored_with_a_corrupt_block(tmp_path, seed=9)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        with client.get_pinned(namespace, keys) as held:
            assert held.matched == 3  # block 3 is corrupt: it and what follows are misses
            for i in range(3):
                np.testing.assert_array_equal(held.block(i), blocks[i])
            with pytest.raises(ValueError):
                held.block(0)[0, 0, 0, 0, 0] = 1.0  # read-only: the daemon's stored bytes
            with pytest.raises(IndexError):
                held.block(3)
            assert client.delete(namespace, keys[:3]) == (0, 3)  # pinned: not deleted
            np.testing.assert_array_equal(held.copy_to(), blocks[:3])
            assert client.stats().leases == 1
        assert client.stats().leases == 0
        with pytest.raises(FailedPrecondition):
            held.block(0)
        assert client.delete(namespace, keys[:3]) == (3, 0)
        with client.get_pinned(namespace, []) as nothing:
            assert nothing.matched == 0
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target, use_shared_memory=False) as inline:
        with pytest.raises(FailedPrecondition, match="shared-memory arena"):
            inline.get_pinned(inline.register_namespace(SPEC), keys)


def test_reserved_slots_filled_in_place_are_stored_durably_and_a_release_stores_nothing(tmp_path):
    """reserve: the run of keys not yet stored, filled through writable views or fill(), and
    committed durable; what a restart then serves is exactly that. A released reservation stores
    nothing and pins nothing."""
    directory, config = tmp_path / "d", disk_config(tmp_path)
    blocks = blocks_for(6, seed=11)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(6 * 16))
        client.put(namespace, keys[:2], blocks[:2])  # in host memory only: reserve skips them
        with client.reserve(namespace, keys[:4]) as slots:
            assert (slots.start, slots.stop) == (2, 4)
            with pytest.raises(IndexError):
                slots.block(1)
            slots.block(2)[...] = blocks[2]
            slots.block(3)[...] = blocks[3]
            assert slots.commit(durable=True) == 2  # and keys[:2] made durable with them
            with pytest.raises(FailedPrecondition):
                slots.commit()
        with client.reserve(namespace, keys) as slots:
            assert (slots.start, slots.stop) == (4, 6)
            slots.fill(np.zeros_like(blocks))  # released below, never committed
        assert client.stats().leases == 0
        assert client.lookup(namespace, keys).matched == 4
        with client.reserve(namespace, keys) as slots:
            slots.fill(blocks)
            assert slots.commit() == 2
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        # keys[:4] were durable; keys[4:] went to disk by write-back, or are gone: never wrong bytes.
        got = client.get_numpy(namespace, keys)
        assert got.shape[0] >= 4
        np.testing.assert_array_equal(got, blocks[:got.shape[0]])


@pytest.mark.parametrize(("write_fault", "read_fault"), [("EIO", "EIO"), ("ENOSPC", "SHORT")])
def test_disk_errors_become_misses_and_the_daemon_keeps_serving(tmp_path, write_fault, read_fault):
    """A fault on every disk write, then on every disk read (injected through
    the I/O engine: EIO, a full drive, short reads): durable Puts fail
    precisely, nothing wrong is served, the host tier keeps working and the
    error metrics count what happened."""
    import grpc

    directory = tmp_path / "d"
    config = disk_config(tmp_path)
    keys_and_blocks = []
    with run_daemon(directory, config=config, env={"KVD_INJECT_IO_FAULTS": f"write:{write_fault}:100000"}) as daemon, \
            Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(4 * 16))
        blocks = blocks_for(4, seed=7)
        with pytest.raises(grpc.RpcError) as raised:
            client.put(namespace, keys, blocks, durable=True)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "keys[0:4] are not" in raised.value.details() and "the disk write failed" in raised.value.details()
        # Still in host memory, served bit-exact.
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_disk_failures_total{operation="write"}'] >= 1
        assert samples['kvd_tier_blocks{tier="disk"}'] == 0
    # A healthy run stores blocks durably ...
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(6 * 16) + 5000)
        blocks = blocks_for(6, seed=8)
        client.put(namespace, keys, blocks, durable=True)
        keys_and_blocks = (keys, blocks)
    # ... and a run whose reads all fail serves none of them, and no wrong byte.
    with run_daemon(directory, config=config, env={"KVD_INJECT_IO_FAULTS": f"read:{read_fault}:100000"}) as daemon, \
            Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys, blocks = keys_and_blocks
        assert client.lookup(namespace, keys).matched == 6
        assert client.get_numpy(namespace, keys).shape[0] == 0
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_disk_failures_total{operation="load"}'] >= 1
        # The daemon still serves new blocks from memory.
        fresh = namespace.keys(np.arange(2 * 16) + 9000)
        fresh_blocks = blocks_for(2, seed=9)
        client.put(namespace, fresh, fresh_blocks)
        assert np.array_equal(client.get_numpy(namespace, fresh), fresh_blocks)


def test_a_vanished_drive_directory_costs_only_its_blocks(tmp_path):
    """One drive's directory disappears under a running daemon (a drive
    pulled, a mount gone): durable Puts that need it fail precisely, what
    is served stays bit-exact, and a restart serves the rest from disk."""
    import shutil

    import grpc

    directory = tmp_path / "d"
    config = disk_config(tmp_path)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(6 * 16))
        blocks = blocks_for(6, seed=3)
        client.put(namespace, keys, blocks, durable=True)
        shutil.rmtree(tmp_path / "nvme1")
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)
        more = namespace.keys(np.arange(4 * 16) + 1000)
        more_blocks = blocks_for(4, seed=4)
        with pytest.raises(grpc.RpcError) as raised:
            client.put(namespace, more, more_blocks, durable=True)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert np.array_equal(client.get_numpy(namespace, more), more_blocks)  # host memory still serves
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_disk_failures_total{operation="write"}'] >= 1
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        for stored_keys, stored in ((keys, blocks), (more, more_blocks)):
            got = client.get_numpy(namespace, stored_keys)
            # Blocks on the lost drive are gone, and with them every block
            # after them in the chain; what comes back is a bit-exact prefix.
            assert got.shape[0] < stored.shape[0]
            assert np.array_equal(got, stored[: got.shape[0]])
        assert client.get_numpy(namespace, keys).shape[0] >= 1  # block 0 lives on drive 0


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


def test_a_disk_directory_of_another_layout_stops_the_daemon_with_a_clear_message(tmp_path):
    """Exit 2 (systemd's RestartPreventExitStatus), the directory and field
    named, no traceback; the drive is left as it was."""
    import subprocess
    import sys

    directory = tmp_path / "d"
    with run_daemon(directory, config=disk_config(tmp_path)):
        pass
    identity = (tmp_path / "nvme0" / "IDENTITY").read_bytes()
    config_path = tmp_path / "other.toml"
    config_path.write_text(
        f'state_dir = "{tmp_path / "state2"}"\n[server]\ntcp_address = ""\n[metrics]\naddress = ""\n'
        f'[host]\ncapacity_bytes = "4MiB"\nslot_bytes = "64KiB"\n'
        f'[disk]\ndirectories = ["{tmp_path / "nvme0"}", "{tmp_path / "nvme1"}"]\n'
        f'capacity_bytes = "8MiB"\nslot_bytes = "128KiB"\nsegment_bytes = "4MiB"\n'
    )
    result = subprocess.run([sys.executable, "-m", "kvd", "serve", "--config", str(config_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "kvd: cannot start: disk directory" in result.stderr and "slot_bytes" in result.stderr
    assert "Traceback" not in result.stderr
    assert (tmp_path / "nvme0" / "IDENTITY").read_bytes() == identity


def test_a_daemon_with_zero_segments_starts_on_written_zeros_and_serves_from_them(tmp_path):
    """disk.zero_segments through a real daemon: every segment it created is written (no unwritten
    extent left), and a durable Put survives a restart bit-exact."""
    from tests.disk.test_zero_segments import unwritten_bytes

    directory, config = tmp_path / "d", disk_config(tmp_path, zero_segments=True)
    blocks = blocks_for(4, seed=81)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        segments = sorted(tmp_path.glob("nvme*/**/seg-*"))
        assert len(segments) == 4 and all(unwritten_bytes(path) == 0 for path in segments)
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(4 * 16))
        client.put(namespace, keys, blocks, durable=True)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        np.testing.assert_array_equal(client.get_numpy(namespace, keys), blocks)


def test_the_async_client_pins_and_reserves_in_place_as_the_sync_one_does(tmp_path):
    """AsyncClient.get_pinned and reserve: a cold Get left in the arena (exact, a corrupt block a
    miss, pinned until `async with` ends), and a reservation filled in place and committed durable,
    which a restart then serves; a plain `with` is refused, since its release would never run."""
    import asyncio

    from kvd.client import AsyncClient

    directory, config, keys, blocks = stored_with_a_corrupt_block(tmp_path, seed=13)

    async def scenario(target: str) -> None:
        async with AsyncClient(target) as client:
            namespace = await client.register_namespace(SPEC)
            async with await client.get_pinned(namespace, keys) as held:
                assert held.matched == 3
                np.testing.assert_array_equal(held.copy_to(), blocks[:3])
                assert await client.delete(namespace, keys[:3]) == (0, 3)  # pinned
                assert (await client.stats()).leases == 1
            assert (await client.stats()).leases == 0
            held = await client.get_pinned(namespace, keys[:1])
            with pytest.raises(TypeError, match="async with"):
                with held:
                    pass
            await held.release()
            async with await client.reserve(namespace, keys) as slots:
                assert (slots.start, slots.stop) == (3, 6)  # block 3 was dropped as corrupt
                slots.fill(blocks)
                assert await slots.commit(durable=True) == 3
            async with await client.reserve(namespace, keys) as slots:
                assert slots.start == slots.stop  # all stored: nothing to fill
                assert await slots.commit() == 0
            assert (await client.stats()).leases == 0

    with run_daemon(directory, config=config) as daemon:
        asyncio.run(scenario(daemon.unix_target))
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        np.testing.assert_array_equal(client.get_numpy(client.register_namespace(SPEC), keys), blocks)
