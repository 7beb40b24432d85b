"""Prefetch through a real daemon: disk blocks read into host memory ahead of the Get."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import grpc
import numpy as np
import pytest

from kvd.client import AsyncClient, Client
from kvd.testing.daemon import run_daemon
from kvd.v1 import kvd_pb2
from tests.integration.disk_tier_helpers import (
    HOST_SLOTS,
    SPEC,
    blocks_for,
    disk_config,
    metric_samples,
    stored_with_a_corrupt_block,
)

PREFETCH_BLOCKS = 'kvd_prefetch_blocks_total{result="%s"}'


def push_to_disk(client: Client, namespace, keys, rounds: int = 2, seed: int = 50) -> None:
    """Durable Puts of twice the host tier's size of other blocks: the blocks
    of `keys` (already durable) are then only on disk."""
    for round_ in range(rounds):
        other = namespace.keys(np.arange(HOST_SLOTS * 16) + 10**6 * (round_ + 1) + seed * 10**7)
        client.put(namespace, other, blocks_for(HOST_SLOTS, seed=seed + round_), durable=True)
    lookup = client.lookup(namespace, keys)
    assert lookup.matched == len(keys) and set(lookup.tiers) == {kvd_pb2.TIER_DISK}


def stored_on_disk(client: Client, count: int, seed: int):
    namespace = client.register_namespace(SPEC)
    keys = namespace.keys(np.arange(count * 16) + seed * 10**5)
    blocks = blocks_for(count, seed=seed)
    assert client.put(namespace, keys, blocks, durable=True) == count
    push_to_disk(client, namespace, keys)
    return namespace, keys, blocks


def test_prefetch_promotes_disk_blocks_and_the_get_that_follows_uses_them(tmp_path):
    with run_daemon(tmp_path / "d", config=disk_config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        namespace, keys, blocks = stored_on_disk(client, 10, seed=1)
        missing = namespace.keys(np.arange(12 * 16) + 10**5)[10:]  # two keys never stored
        result = client.prefetch(namespace, keys + missing, wait=True)
        assert (result.matched, result.queued, result.loaded, result.missing) == (10, 10, 10, 2)
        assert (result.in_host, result.loading, result.refused, result.limit) == (0, 0, 0, 0)
        assert set(client.lookup(namespace, keys).tiers) == {kvd_pb2.TIER_HOST}
        before = metric_samples(daemon.metrics_url)
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)
        after = metric_samples(daemon.metrics_url)
        # The Get read nothing from disk: the prefetch had.
        assert after['kvd_tier_moves_total{source_tier="disk",target_tier="host"}'] == \
            before['kvd_tier_moves_total{source_tier="disk",target_tier="host"}']
        assert after["kvd_prefetch_used_total"] == 10 and after["kvd_prefetch_wasted_total"] == 0
        assert after[PREFETCH_BLOCKS % "queued"] == 10 and after[PREFETCH_BLOCKS % "missing"] == 2
        assert after["kvd_prefetch_in_flight_blocks"] == 0
        # Prefetching what is in host memory now reads nothing.
        again = client.prefetch(namespace, keys)
        assert (again.in_host, again.queued) == (10, 0)
        assert client.stats().leases == 0


def test_prefetch_without_wait_returns_at_once_and_lookup_sees_the_blocks_arrive(tmp_path):
    with run_daemon(tmp_path / "d", config=disk_config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        namespace, keys, blocks = stored_on_disk(client, 8, seed=2)
        result = client.prefetch(namespace, keys)
        assert result.queued == 8 and result.loaded == 0
        deadline = time.monotonic() + 10
        while set(client.lookup(namespace, keys).tiers) != {kvd_pb2.TIER_HOST}:
            assert time.monotonic() < deadline, "prefetched blocks never reached host memory"
            time.sleep(0.02)
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)
        assert metric_samples(daemon.metrics_url)["kvd_prefetch_used_total"] == 8


def test_prefetched_blocks_evicted_before_use_count_as_wasted(tmp_path):
    with run_daemon(tmp_path / "d", config=disk_config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        namespace, keys, blocks = stored_on_disk(client, 6, seed=3)
        assert client.prefetch(namespace, keys, wait=True).loaded == 6
        push_to_disk(client, namespace, keys, seed=70)  # pushed out again, never used
        samples = metric_samples(daemon.metrics_url)
        assert samples["kvd_prefetch_wasted_total"] == 6 and samples["kvd_prefetch_used_total"] == 0
        # Still on disk, still served bit-exact (read by the Get itself now).
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)
        assert metric_samples(daemon.metrics_url)["kvd_prefetch_used_total"] == 0


def test_gets_racing_prefetches_of_the_same_blocks_get_the_right_bytes(tmp_path):
    """Prefetch (in jobs of one block, so many reads are in flight) and Get
    the same prefix at the same time, again and again: every Get is
    bit-exact, whoever read which block."""
    config = disk_config(tmp_path, prefetch_chunk_blocks=1)

    async def race(target: str) -> None:
        async with AsyncClient(target) as client:
            namespace = await client.register_namespace(SPEC)
            for round_ in range(3):
                keys = namespace.keys(np.arange(10 * 16) + 10**5 * (round_ + 1))
                blocks = blocks_for(10, seed=10 + round_)
                await client.put(namespace, keys, blocks, durable=True)
                with Client(target) as sync_client:
                    push_to_disk(sync_client, namespace, keys, seed=100 + 10 * round_)
                prefetched, got, got_tail = await asyncio.gather(
                    client.prefetch(namespace, keys),
                    client.get_numpy(namespace, keys),
                    client.get_numpy(namespace, keys[4:], parent_key=keys[3]),
                )
                assert prefetched.matched == 10
                assert np.array_equal(got, blocks)
                assert np.array_equal(got_tail, blocks[4:])

    with run_daemon(tmp_path / "d", config=config) as daemon:
        asyncio.run(race(daemon.unix_target))
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_disk_failures_total{operation="load"}'] == 0
        assert samples["kvd_prefetch_in_flight_blocks"] == 0
        # Each queued block was either used by the racing Gets or not queued.
        assert samples["kvd_prefetch_used_total"] == samples[PREFETCH_BLOCKS % "queued"]


def test_the_in_flight_bound_truncates_a_prefetch_without_an_error(tmp_path):
    config = disk_config(tmp_path, prefetch_max_blocks=4)
    with run_daemon(tmp_path / "d", config=config) as daemon, Client(daemon.unix_target) as client:
        namespace, keys, blocks = stored_on_disk(client, 10, seed=4)
        first = client.prefetch(namespace, keys, wait=True)
        assert (first.queued, first.refused, first.loaded) == (4, 6, 4)
        assert first.limit == kvd_pb2.PREFETCH_LIMIT_IN_FLIGHT
        tiers = client.lookup(namespace, keys).tiers
        assert tiers == [kvd_pb2.TIER_HOST] * 4 + [kvd_pb2.TIER_DISK] * 6
        second = client.prefetch(namespace, keys, wait=True)
        assert (second.in_host, second.queued, second.refused) == (4, 4, 2)
        third = client.prefetch(namespace, keys, wait=True)
        assert (third.in_host, third.queued, third.refused, third.limit) == (8, 2, 0, 0)
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)
        samples = metric_samples(daemon.metrics_url)
        assert samples[PREFETCH_BLOCKS % "refused"] == 8
        assert samples["kvd_prefetch_used_total"] == 10


def test_a_corrupt_block_met_by_a_prefetch_is_dropped_never_served(tmp_path):
    directory, config, keys, blocks = stored_with_a_corrupt_block(tmp_path, seed=5)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        result = client.prefetch(namespace, keys, wait=True)
        # Block 3 fails its checksum: it and the blocks chained under it are gone.
        assert (result.queued, result.loaded) == (6, 3)
        assert client.lookup(namespace, keys).matched == 3
        got = client.get_numpy(namespace, keys)
        assert np.array_equal(got, blocks[:3])
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_disk_failures_total{operation="load"}'] == 1
        assert samples["kvd_prefetch_used_total"] == 3 and samples["kvd_prefetch_wasted_total"] == 3


def test_bad_prefetch_input_gets_precise_statuses_and_no_disk_tier_is_no_error(tmp_path):
    with run_daemon(tmp_path / "d") as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(4 * 16))
        client.put(namespace, keys[:3], blocks_for(3, seed=6))
        # Without a disk tier everything stored is in host memory.
        result = client.prefetch(namespace, keys, wait=True)
        assert (result.matched, result.in_host, result.missing, result.queued) == (3, 3, 1, 0)
        cases = [
            (dataclasses.replace(namespace, namespace_id=b"\x01" * 32), keys, b"", grpc.StatusCode.NOT_FOUND,
             "not registered"),
            (dataclasses.replace(namespace, namespace_id=b"short"), keys, b"", grpc.StatusCode.INVALID_ARGUMENT,
             "namespace_id"),
            (namespace, [keys[0], b"short"], b"", grpc.StatusCode.INVALID_ARGUMENT, "keys[1]"),
            (namespace, keys, b"short", grpc.StatusCode.INVALID_ARGUMENT, "parent_key"),
        ]
        for bad_namespace, bad_keys, parent_key, code, fragment in cases:
            with pytest.raises(grpc.RpcError) as raised:
                client.prefetch(bad_namespace, bad_keys, parent_key=parent_key)
            assert raised.value.code() == code, raised.value.details()
            assert fragment in raised.value.details()
        samples = metric_samples(daemon.metrics_url)
        assert samples[PREFETCH_BLOCKS % "already_in_host"] == 3 and samples[PREFETCH_BLOCKS % "missing"] == 1
        assert samples['kvd_rpc_total{code="NOT_FOUND",method="Prefetch"}'] == 1


def test_prefetches_in_flight_at_sigterm_drain_cleanly_and_lose_nothing(tmp_path):
    directory = tmp_path / "d"
    config = disk_config(tmp_path, prefetch_chunk_blocks=1)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace, keys, blocks = stored_on_disk(client, 12, seed=8)
        assert client.prefetch(namespace, keys).queued == 12
        # run_daemon's exit sends SIGTERM now, with the reads queued or
        # running, and checks the daemon exits with 0 and leaked no handle.
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)
