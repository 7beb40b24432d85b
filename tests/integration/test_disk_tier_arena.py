"""The disk tier through a real daemon: layers streamed from disk in order, by the
sync and the async client, and blocks read into or written from the arena in place
(pinned, reserved) (shared pieces: tests/integration/disk_tier_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.client import Client
from kvd.errors import FailedPrecondition
from kvd.testing.daemon import run_daemon
from tests.integration.disk_tier_helpers import SPEC, blocks_for, disk_config, stored_with_a_corrupt_block


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
