"""The device tier against a real daemon ([device] kind = "cpu", tier_bytes of four slots): blocks one
engine saved reach another engine's pool from the tier, not from host memory; the tier evicts the
least recently used; a block removed and stored again under the same key is never served from an
old copy."""

from __future__ import annotations

import mmap
import os
import urllib.request

import grpc
import numpy as np
import pytest

from kvd import arena_protocol
from kvd.client import Client
from kvd.testing.daemon import run_daemon
from kvd.v1 import kvd_pb2, kvd_pb2_grpc
from tests.integration.test_device_plane import (ENGINE, KVD, SPEC, Engine, blocks, codes_of, keys_for,
                                                 save_as_engine, wait_for)

TIER_SLOTS = 4
SLOT_BYTES = 64 << 10


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    config = {"host": {"capacity_bytes": 16 << 20, "slot_bytes": SLOT_BYTES},
              "device": {"kind": "cpu", "tier_bytes": TIER_SLOTS * SLOT_BYTES}}
    with run_daemon(tmp_path_factory.mktemp("kvd"), config=config) as process:
        yield process


@pytest.fixture
def engines(daemon):
    with Client(daemon.unix_target) as first, Client(daemon.unix_target) as second:
        a, b = Engine(first), Engine(second)
        yield first, a, b
        a.close()
        b.close()


def load(engine: Engine, keys, pages) -> kvd_pb2.LoadLayersResponse:
    response = engine.pool.load(keys, pages, KVD, engine.pool.flag(KVD))
    wait_for(lambda: engine.pool.flag(KVD) >= response.done_value)
    return response


def overwrite_host_copies(daemon, namespace, keys) -> None:
    """Scribble over the blocks' copies in the host arena (through a client's mapping of it)."""
    fd, _ = arena_protocol.receive_arena(arena_protocol.socket_path_for_target(daemon.unix_target), None, "")
    with grpc.insecure_channel(daemon.unix_target) as channel:
        stub = kvd_pb2_grpc.KvdStub(channel)
        got = stub.Get(kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, client_id="scribbler", keys=keys))
        assert got.matched == len(keys)
        with mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED) as arena:
            for offset in got.offsets:
                arena[offset:offset + SPEC.block_bytes] = b"\x7f" * SPEC.block_bytes
        stub.Release(kvd_pb2.ReleaseRequest(client_id="scribbler", lease_ids=[got.lease_id]))
    os.close(fd)


def test_a_block_one_engine_saved_reaches_another_engine_from_the_device_tier(daemon, engines):
    client, a, b = engines
    data, keys = blocks(3, seed=11), keys_for(11, 3)
    assert save_as_engine(a, keys, [0, 1, 2], data, a.pool.flag(ENGINE)).stored == 3
    assert list(client.lookup(a.namespace, keys).tiers) == [kvd_pb2.TIER_DEVICE] * 3  # Lookup sees the tier
    overwrite_host_copies(daemon, a.namespace, keys)
    loaded = load(b, keys, [5, 6, 7])
    assert loaded.matched == 3 and list(loaded.tiers) == [kvd_pb2.TIER_DEVICE] * 3
    for page, block in zip([5, 6, 7], data):
        np.testing.assert_array_equal(b.read(page), block)  # the tier's bytes: host memory was not read
    # A block stored the ordinary way is not in the tier: its load comes from host memory.
    plain, plain_key = blocks(1, seed=12), keys_for(12, 1)
    client.put(a.namespace, plain_key, plain)
    loaded = load(b, plain_key, [8])
    assert list(loaded.tiers) == [kvd_pb2.TIER_HOST]
    np.testing.assert_array_equal(b.read(8), plain[0])


def test_the_tier_keeps_the_most_recently_used_blocks(daemon, engines):
    _, a, b = engines
    first, first_keys = blocks(TIER_SLOTS, seed=21), keys_for(21, TIER_SLOTS)
    save_as_engine(a, first_keys, list(range(TIER_SLOTS)), first, a.pool.flag(ENGINE))  # fills the tier
    load(b, first_keys[:2], [10, 11])  # the first two are now the most recently used
    second, second_keys = blocks(2, seed=22), keys_for(22, 2)
    save_as_engine(a, second_keys, [20, 21], second, a.pool.flag(ENGINE))
    loaded = load(b, first_keys, list(range(24, 24 + TIER_SLOTS)))
    assert list(loaded.tiers) == [kvd_pb2.TIER_DEVICE] * 2 + [kvd_pb2.TIER_HOST] * 2
    assert list(load(b, second_keys, [28, 29]).tiers) == [kvd_pb2.TIER_DEVICE] * 2
    for page, block in zip(range(24, 30), [*first, *second]):
        np.testing.assert_array_equal(b.read(page), block)


def test_a_save_larger_than_the_tier_keeps_what_fits(daemon, engines):
    """A save's own blocks are pinned in the tier until they land: the ones past its size are not cached."""
    _, a, b = engines
    data, keys = blocks(TIER_SLOTS + 2, seed=23), keys_for(23, TIER_SLOTS + 2)
    save_as_engine(a, keys, list(range(TIER_SLOTS + 2)), data, a.pool.flag(ENGINE))
    loaded = load(b, keys, list(range(24, 30)))
    assert list(loaded.tiers) == [kvd_pb2.TIER_DEVICE] * TIER_SLOTS + [kvd_pb2.TIER_HOST] * 2
    for page, block in zip(range(24, 30), data):
        np.testing.assert_array_equal(b.read(page), block)


def test_a_block_removed_and_stored_again_is_never_served_from_its_old_copy(daemon, engines):
    client, a, b = engines
    old, keys = blocks(1, seed=31), keys_for(31, 1)
    save_as_engine(a, keys, [3], old, a.pool.flag(ENGINE))
    assert client.delete(a.namespace, keys)[0] == 1
    new = blocks(1, seed=32)
    client.put(a.namespace, keys, new)
    assert list(client.lookup(a.namespace, keys).tiers) == [kvd_pb2.TIER_HOST]  # the old copy does not count
    loaded = load(b, keys, [9])
    assert list(loaded.tiers) == [kvd_pb2.TIER_HOST]
    np.testing.assert_array_equal(b.read(9), new[0])


def test_the_device_tier_is_reported_in_the_metrics(daemon, engines):
    _, a, b = engines
    data, keys = blocks(2, seed=41), keys_for(41, 2)
    save_as_engine(a, keys, [0, 1], data, a.pool.flag(ENGINE))
    load(b, keys, [2, 3])
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    assert f"kvd_device_tier_slots {TIER_SLOTS}.0" in text
    assert "kvd_device_pools 2.0" in text
    hits = [line for line in text.splitlines() if line.startswith('kvd_device_tier_lookups_total{result="hit"}')]
    assert hits and float(hits[0].split()[-1]) >= 2


# A tier in slots of one layer page: a copy takes as many slots as the layers it keeps.
PAGE_SLOTS = 12


@pytest.fixture(scope="module")
def paged_daemon(tmp_path_factory):
    config = {"host": {"capacity_bytes": 16 << 20, "slot_bytes": SLOT_BYTES},
              "device": {"kind": "cpu", "tier_bytes": PAGE_SLOTS * SPEC.layer_bytes, "tier_slot_bytes":
                         SPEC.layer_bytes}}
    with run_daemon(tmp_path_factory.mktemp("kvd"), config=config) as process:
        yield process


@pytest.fixture
def paged_engines(paged_daemon):
    with Client(paged_daemon.unix_target) as client:
        a, b = Engine(client), Engine(client)
        yield client, a, b
        a.close()
        b.close()


def test_a_planned_save_keeps_only_the_layers_its_plan_keeps_on_the_device(paged_daemon, paged_engines):
    """offload_distance 1 keeps layers 1 and 3 of 4 (0-based 0 and 2) in the tier: twice the blocks
    fit, and a load takes the other layers from host memory (scribbled over here, so the bytes
    show where each layer came from)."""
    client, a, b = paged_engines
    count = PAGE_SLOTS // 2  # two layers each
    data, keys = blocks(count, seed=51), keys_for(51, count)
    saved = save_as_engine(a, keys, list(range(count)), data, a.pool.flag(ENGINE), offload_distance=1)
    assert saved.stored == count
    assert list(client.lookup(a.namespace, keys).tiers) == [kvd_pb2.TIER_DEVICE] * count
    overwrite_host_copies(paged_daemon, a.namespace, keys)
    loaded = load(b, keys, list(range(10, 10 + count)))
    assert list(loaded.tiers) == [kvd_pb2.TIER_DEVICE] * count
    scribbled = np.full(SPEC.block_shape[1:], np.frombuffer(b"\x7f" * 4, np.float32)[0])
    for page, block in zip(range(10, 10 + count), data):
        got = b.read(page)
        for layer in (0, 2):
            np.testing.assert_array_equal(got[layer], block[layer])  # from the tier
        for layer in (1, 3):
            np.testing.assert_array_equal(got[layer], scribbled)  # from host memory
    metrics = urllib.request.urlopen(paged_daemon.metrics_url, timeout=10).read().decode()
    assert f"kvd_device_tier_used_slots {PAGE_SLOTS}.0" in metrics
    assert f"kvd_device_tier_host_layers_total {2 * count}.0" in metrics


def test_without_a_plan_whole_blocks_take_the_tier_and_fewer_fit(paged_engines):
    _, a, b = paged_engines
    count = PAGE_SLOTS // 2
    data, keys = blocks(count, seed=52), keys_for(52, count)
    assert save_as_engine(a, keys, list(range(count)), data, a.pool.flag(ENGINE)).stored == count
    whole = PAGE_SLOTS // SPEC.num_layers
    loaded = load(b, keys, list(range(10, 10 + count)))
    assert list(loaded.tiers) == [kvd_pb2.TIER_DEVICE] * whole + [kvd_pb2.TIER_HOST] * (count - whole)
    for page, block in zip(range(10, 10 + count), data):
        np.testing.assert_array_equal(b.read(page), block)


@pytest.mark.parametrize("distance", [SPEC.num_layers, -2, 1 << 30])
def test_an_offload_distance_past_the_layers_is_refused_by_name_and_stores_nothing(paged_engines, distance):
    client, a, _ = paged_engines
    keys = keys_for(53, 1)
    code, details = codes_of(lambda: a.pool.save(keys, [0], ENGINE, KVD, a.pool.flag(ENGINE),
                                                 offload_distance=distance))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert f"offload_distance must be -1 or 0 (every layer kept) or in [1, 3] for 4 layers, got {distance}" in details
    assert client.lookup(a.namespace, keys).matched == 0
