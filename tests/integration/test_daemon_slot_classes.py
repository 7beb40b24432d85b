"""Slot size classes through a real daemon: models of different block
sizes share host memory (each namespace in slots of the smallest class
that holds its blocks), through shared memory and inline, through the
disk tier and a restart, and with per-tenant memory."""

from __future__ import annotations

import numpy as np

from kvd.client import Client, _ops
from kvd.core.keys import DType, NamespaceSpec
from kvd.testing.daemon import run_daemon
from kvd.v1 import kvd_pb2
from tests.integration.conftest import SMALL_SPEC, random_blocks
from tests.integration.test_auth import TOKEN_A, TOKEN_B, auth_config

PAGE = 1 << 20
# 512 KiB blocks: the 512 KiB class, two to a page.
BIG_SPEC = NamespaceSpec(model_id="classes-big", num_layers=4, num_kv_heads=8, head_dim=64, block_tokens=32,
                         kv_dtype=DType.FLOAT32)
# SMALL_SPEC's 16 KiB blocks go in the 64 KiB class (the default smallest), 16 to a page.


def chain(namespace, count: int, base: int) -> list[bytes]:
    return namespace.keys(np.arange(count * namespace.spec.block_tokens) + base)


def stored_blocks(config: dict, tmp_path) -> tuple[int, int]:
    """Fill a four-page host tier with 2 big and 40 small blocks; how many of each are stored."""
    with run_daemon(tmp_path, config=config) as process, Client(process.unix_target) as client:
        big, small = client.register_namespace(BIG_SPEC), client.register_namespace(SMALL_SPEC)
        big_keys, small_keys = chain(big, 2, 0), chain(small, 40, 0)
        big_blocks, small_blocks = random_blocks(BIG_SPEC, 2, seed=1), random_blocks(SMALL_SPEC, 40, seed=2)
        client.put(big, big_keys, big_blocks)
        client.put(small, small_keys, small_blocks)
        found_big, found_small = client.get_numpy(big, big_keys), client.get_numpy(small, small_keys)
        assert np.array_equal(found_big, big_blocks[: len(found_big)])
        assert np.array_equal(found_small, small_blocks[: len(found_small)])
        return client.lookup(big, big_keys).matched, client.lookup(small, small_keys).matched


def test_two_models_share_four_pages_that_one_slot_size_would_fill_with_four_blocks(tmp_path):
    host = {"capacity_bytes": 4 * PAGE, "slot_bytes": PAGE, "high_watermark": 1.0, "low_watermark": 0.99}
    assert stored_blocks({"host": host}, tmp_path / "classes") == (2, 40)
    one_size = stored_blocks({"host": {**host, "min_slot_bytes": PAGE}}, tmp_path / "one-size")
    assert sum(one_size) <= 4


def test_offsets_are_slots_of_the_namespace_class_and_inline_and_shared_memory_agree(tmp_path):
    config = {"host": {"capacity_bytes": 8 * PAGE, "slot_bytes": PAGE}}
    with run_daemon(tmp_path, config=config) as process, Client(process.unix_target) as shm, \
            Client(process.tcp_target, use_shared_memory=False) as inline:
        info = shm.arena_info()
        assert list(info.class_bytes) == [PAGE, PAGE // 2, PAGE // 4, PAGE // 8, PAGE // 16]
        small, big = shm.register_namespace(SMALL_SPEC), inline.register_namespace(BIG_SPEC)
        small_keys, big_keys = chain(small, 24, 100), chain(big, 3, 100)
        small_blocks, big_blocks = random_blocks(SMALL_SPEC, 24, seed=3), random_blocks(BIG_SPEC, 3, seed=4)
        assert shm.put(small, small_keys[:12], small_blocks[:12]) == 12
        assert inline.put(small, small_keys, small_blocks) == 12  # inline extends the shared-memory chain
        assert inline.put(big, big_keys, big_blocks) == 3
        assert np.array_equal(shm.get_numpy(big, big_keys), big_blocks)
        assert np.array_equal(inline.get_numpy(small, small_keys), small_blocks)
        assert np.array_equal(shm.get_numpy(small, small_keys), small_blocks)
        response = shm._stub.Get(kvd_pb2.GetRequest(namespace_id=small.namespace_id, client_id=shm.session.client_id,
                                                   keys=small_keys, arena_instance_id=info.instance_id))
        offsets = np.asarray(response.offsets)
        assert len(offsets) == 24 and not (offsets % (64 << 10)).any()
        # The small blocks are packed: 24 of them in two pages, not 24.
        assert len(set((offsets // PAGE).tolist())) == 2
        rows = shm.session.arena.rows(64 << 10)[offsets // (64 << 10), : SMALL_SPEC.block_bytes]
        assert np.array_equal(rows.view(np.float32).reshape(small_blocks.shape), small_blocks)
        shm._run(_ops.release(shm.session, [response.lease_id]))


def test_tenants_share_pages_of_small_slots_and_each_maps_only_its_own_blocks(tmp_path):
    """With tokens, each tenant's file backs only its own small slots, so a
    page holds blocks of both tenants and neither client can read the other's."""
    page = 256 << 10
    config = auth_config(tmp_path, host={"capacity_bytes": 8 * page, "slot_bytes": page})
    width = SMALL_SPEC.block_bytes
    with run_daemon(tmp_path, config=config, env={"KVD_TEST_TOKEN_B": TOKEN_B}) as process, \
            Client(process.unix_target, token=TOKEN_A) as a, Client(process.unix_target, token=TOKEN_B) as b:
        clients = {"a": a, "b": b}
        namespaces = {name: client.register_namespace(SMALL_SPEC) for name, client in clients.items()}
        written: dict[str, list[bytes]] = {"a": [], "b": []}
        for turn in range(12):  # one block at a time, in turn: the tenants' slots interleave
            name = "ab"[turn % 2]
            blocks = random_blocks(SMALL_SPEC, 1, seed=100 + turn)
            assert clients[name].put(namespaces[name], chain(namespaces[name], 1, 1000 * turn), blocks) == 1
            written[name].append(blocks.view(np.uint8).reshape(width).tobytes())
        views = {name: client.session.arena.rows(64 << 10)[:, :width] for name, client in clients.items()}
        where = {name: {row for row in range(len(views[name])) if views[name][row].tobytes() in written[name]}
                 for name in clients}
        assert all(len(rows) == 6 for rows in where.values())
        # Pages (four 64 KiB slots each) that hold blocks of both tenants.
        assert {row // 4 for row in where["a"]} & {row // 4 for row in where["b"]}
        for name, other in (("a", "b"), ("b", "a")):
            assert not views[name][sorted(where[other])].any(), name
        for turn in range(12):
            name = "ab"[turn % 2]
            found = clients[name].get_numpy(namespaces[name], chain(namespaces[name], 1, 1000 * turn))
            assert found.view(np.uint8).reshape(width).tobytes() in written[name]


def durable_after_restart(tmp_path, disk_pages: int, min_slot_bytes: int | None = None) -> tuple[int, int]:
    """Make 64 small blocks durable (8 chains, four times what host memory
    holds) on a disk of `disk_pages` pages; how many blocks of the first
    chain a Get finds before the restart (read back from disk), and of all
    of them after it. Whatever is found is bit-exact."""
    disk = {"directories": [str(tmp_path / "disk")], "capacity_bytes": disk_pages * PAGE, "slot_bytes": PAGE,
            "segment_bytes": 8 * PAGE}
    if min_slot_bytes is not None:
        disk["min_slot_bytes"] = min_slot_bytes
    config = {"host": {"capacity_bytes": PAGE, "slot_bytes": PAGE}, "disk": disk}
    chains, length = 8, 8
    blocks = random_blocks(SMALL_SPEC, chains * length, seed=9).reshape(chains, length, *SMALL_SPEC.block_shape)

    def found(client, namespace, number: int) -> int:
        got = client.get_numpy(namespace, keys[number])
        assert np.array_equal(got, blocks[number][: len(got)]), number
        return len(got)

    with run_daemon(tmp_path / "run", config=config) as process, Client(process.unix_target) as client:
        namespace = client.register_namespace(SMALL_SPEC)
        keys = [chain(namespace, length, 20_000 * number) for number in range(chains)]
        for number in range(chains):
            assert client.put(namespace, keys[number], blocks[number], durable=True) == length
        before = found(client, namespace, 0)
    with run_daemon(tmp_path / "run", config=config) as process, Client(process.unix_target) as client:
        namespace = client.register_namespace(SMALL_SPEC)
        return before, sum(found(client, namespace, number) for number in range(chains))


def test_small_blocks_go_to_disk_and_come_back_into_their_class_across_a_restart(tmp_path):
    assert durable_after_restart(tmp_path, disk_pages=64) == (8, 64)  # the daemon's default disk classes


def test_the_disk_packs_small_blocks_into_its_pages_where_one_slot_size_keeps_a_block_a_page(tmp_path):
    assert durable_after_restart(tmp_path / "classes", 8, 64 << 10)[1] == 64  # 16 to a page: 4 of the 8 pages
    assert durable_after_restart(tmp_path / "one-size", 8, PAGE)[1] <= 8
