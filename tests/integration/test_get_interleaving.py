"""Gets that meet on the same disk reads, and a Demote that meets a Delete,
interleaved at the service's await points.

The daemon's handlers run over a real Engine, HostArena and DiskPlane (O_DIRECT
segment files) in this process, so a test can stop one request exactly where
it yields and run another there. A chain is stored, the disk plane closed and
opened again: every block is then on disk only, as after a restart.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import pytest

from kvd.config import DiskSettings
from kvd.core.block import BlockState
from kvd.core.engine import Engine
from kvd.core.keys import DType, NamespaceSpec, chain_keys
from kvd.core.requests import CommitRequest, KeysRequest
from kvd.errors import FailedPrecondition
from kvd.planes.disk import DiskPlane
from kvd.server.get_stream import BlockSteps, LayerSteps
from kvd.server.handlers import admin as admin_handlers
from kvd.server.service import KvdService
from kvd.testing import engine_ops
from kvd.tiers.host import ArenaLayout, HostArena
from kvd.v1 import kvd_pb2

SLOT_BYTES = 8 << 10
HOST_SLOTS = 16
BLOCKS = 6
LONG_MS = 600_000
SPEC = NamespaceSpec(model_id="interleaving", num_layers=2, num_kv_heads=1, head_dim=128, block_tokens=8,
                     kv_dtype=DType.FLOAT16)


def pattern(key: bytes) -> bytes:
    return (key * (SPEC.block_bytes // len(key) + 1))[: SPEC.block_bytes]


class Node:
    """One daemon's engine, arena and disk plane, opened on a drive directory."""

    def __init__(self, directory) -> None:
        # Extents of one layer: a streamed read is a batch per layer.
        self.settings = DiskSettings(directories=[str(directory)], capacity_bytes=4 << 20, slot_bytes=SLOT_BYTES,
                                     segment_bytes=4 << 20, fsync="strict", write_mode="through",
                                     read_extent_bytes=SPEC.layer_bytes)
        self.arena = HostArena(ArenaLayout.from_capacity(HOST_SLOTS * SLOT_BYTES, SLOT_BYTES), prefault=False)

    async def open(self) -> None:
        self.plane = DiskPlane(self.settings, self.arena)
        recovery = await self.plane.open()
        self.engine = Engine(host_slot_count=HOST_SLOTS, host_slot_bytes=SLOT_BYTES,
                             disk_slot_count=self.plane.slot_count, disk_slot_bytes=SLOT_BYTES)
        await self.plane.recover(self.engine, recovery)
        self.plane.start()
        self.namespace_id = self.engine.register_namespace(SPEC).namespace_id
        await self.plane.register_namespace(self.engine, self.namespace_id)
        clock = SimpleNamespace(now_ms=lambda: 0)
        self.service = KvdService(self.engine, self.arena, clock, metrics=None, max_message_bytes=1 << 20,
                                  disk_plane=self.plane)

    async def store(self, keys: list[bytes]) -> None:
        reserved = self.engine.reserve(KeysRequest(self.namespace_id, "w", keys, LONG_MS, 0))
        for key, slot in zip(keys, reserved.slots):
            self.arena.write(slot, pattern(key))
        self.engine.commit(CommitRequest(self.namespace_id, "w", reserved.lease.lease_id, 0))
        assert not await self.plane.wait_durable(self.engine.stored(self.namespace_id, keys), 30.0)

    def request(self, client_id: str, keys: list[bytes]) -> kvd_pb2.GetRequest:
        return kvd_pb2.GetRequest(namespace_id=self.namespace_id, client_id=client_id, keys=keys, lease_ms=LONG_MS,
                                  arena_instance_id=self.arena.instance_id)

    def assert_served(self, blocks, keys: list[bytes]) -> None:
        assert [block.key for block in blocks] == keys
        for block, key in zip(blocks, keys):
            assert self.arena.read(self.engine.host_slot(block), SPEC.block_bytes) == pattern(key)


async def cold_node(tmp_path) -> tuple[Node, list[bytes]]:
    """A node whose chain of BLOCKS blocks is on its drive only (stored, then the plane reopened)."""
    keys = chain_keys(SPEC, np.arange(BLOCKS * SPEC.block_tokens))
    first = Node(tmp_path / "nvme0")
    await first.open()
    await first.store(keys)
    await first.plane.close(30.0)
    node = Node(tmp_path / "nvme0")
    await node.open()
    assert node.engine.stored(node.namespace_id, keys) and not node.engine.loading
    return node, keys


def test_a_get_that_arrives_while_a_streaming_get_holds_its_first_message_waits_for_its_reads(tmp_path):
    """GetLayers plans its loads, then yields the first message to the client.
    A Get for the same prefix that runs there finds the blocks being read and
    must wait for those reads, not take the slots before they are filled."""

    async def scenario():
        node, keys = await cold_node(tmp_path)
        stream = node.service._stream_get(node.request("streaming", keys), LayerSteps)
        first = await stream.__anext__()
        assert (first.matched, first.layers_ready) == (BLOCKS, 0)
        assert len(node.engine.loading) == BLOCKS  # the stream's reads, under way
        lease, blocks, *_ = await node.service._pinned_prefix(node.request("plain", keys), "plain")
        node.assert_served(blocks, keys)
        messages = [message async for message in stream]
        assert (messages[-1].matched, messages[-1].layers_ready) == (BLOCKS, SPEC.num_layers)
        node.engine.verify()
        await node.plane.close(30.0)

    asyncio.run(scenario())


@pytest.mark.parametrize("steps_kind, taken", [(LayerSteps, 1), (BlockSteps, 1), (BlockSteps, 3)])
def test_a_streaming_get_dropped_after_its_first_message_leaves_no_read_behind(tmp_path, monkeypatch, steps_kind,
                                                                              taken):
    """The client goes away as soon as it has the offsets (or, for GetBlocks, a few blocks in):
    the reads it started still finish and the blocks are served whole. Dropped while its reads
    run (held back here until it is gone), the stream's lease ends with them; dropped a few
    blocks in, the reads may all have landed already, and then its lease stands, as any Get's
    does, until released (or expired)."""

    async def scenario():
        node, keys = await cold_node(tmp_path)
        gone = threading.Event()
        if taken > 1:
            gone.set()
        read_batch = node.plane._read_batch

        def after_the_client_left(*args, **kwargs):  # the I/O thread
            assert gone.wait(30)
            return read_batch(*args, **kwargs)

        monkeypatch.setattr(node.plane, "_read_batch", after_the_client_left)
        stream = node.service._stream_get(node.request("gone", keys), steps_kind)
        first = await stream.__anext__()
        for _ in range(taken - 1):
            await stream.__anext__()
        await stream.aclose()
        gone.set()
        # The reads land, then the dropped Get ends (a callback, a loop turn later): only its
        # lease's pins may stand, and only when the reads had landed before it was dropped.
        settled = (0,) if taken == 1 else (0, BLOCKS)
        for _ in range(1000):
            if not node.engine.loading and node.engine.leases.pins_of("gone") in settled:
                break
            await asyncio.sleep(0.005)
        assert not node.engine.loading
        if taken > 1 and node.engine.leases.pins_of("gone"):
            assert node.engine.leases.pins_of("gone") == BLOCKS  # its lease's, nothing more
            node.engine.release("gone", [first.lease_id])
        assert node.engine.leases.pins_of("gone") == 0
        lease, blocks, *_ = await node.service._pinned_prefix(node.request("later", keys), "later")
        node.assert_served(blocks, keys)
        node.engine.verify()
        await node.plane.close(30.0)

    asyncio.run(scenario())


@pytest.mark.parametrize("streaming", [False, True], ids=["get", "get-layers"])
def test_a_get_whose_reads_finish_before_its_task_runs_settles_after_them(tmp_path, monkeypatch, streaming):
    """The I/O thread may finish a Get's reads before start_get has even returned (a loaded
    machine preempts the loop thread). The Get's task then first runs with its read job done;
    it must still settle only after the loads are finished in the engine. It once did not:
    awaiting the done job did not yield, the Get settled first, and an invariant stopped the
    daemon under load."""

    async def scenario():
        node, keys = await cold_node(tmp_path)
        submit = node.plane._io.submit

        def submit_and_finish(*args, **kwargs):
            job = submit(*args, **kwargs)
            job.result(timeout=30)  # the loop thread waits: the job is done before start_get returns
            return job

        monkeypatch.setattr(node.plane._io, "submit", submit_and_finish)
        if streaming:
            messages = [message async for message in node.service._stream_get(node.request("s", keys), LayerSteps)]
            assert (messages[-1].matched, messages[-1].layers_ready) == (BLOCKS, SPEC.num_layers)
        else:
            _, blocks, *_ = await node.service._pinned_prefix(node.request("plain", keys), "plain")
            node.assert_served(blocks, keys)
        assert not node.engine.loading
        node.engine.verify()
        await node.plane.close(30.0)

    asyncio.run(scenario())


def test_a_get_reads_each_block_whole_and_a_streaming_get_layer_by_layer(tmp_path):
    """Nobody uses a plain Get's layers before all have landed: one batch, each block one extent.
    GetLayers hands layers over as they land: a batch per group of layers (here one layer)."""

    async def scenario():
        node, keys = await cold_node(tmp_path)
        stats = node.plane.tier.stats
        before = stats.submissions
        _, blocks, *_ = await node.service._pinned_prefix(node.request("plain", keys[:3]), "plain")
        node.assert_served(blocks, keys[:3])
        assert stats.submissions - before == 1
        before = stats.submissions
        messages = [message async for message in node.service._stream_get(node.request("streaming", keys), LayerSteps)]
        # The first message (offsets), one per layer landed, then the closing one.
        assert [message.layers_ready for message in messages] == [0, *range(1, SPEC.num_layers + 1), SPEC.num_layers]
        assert stats.submissions - before == SPEC.num_layers  # the 3 blocks above are in host memory now
        node.engine.verify()
        await node.plane.close(30.0)

    asyncio.run(scenario())


def test_a_block_streaming_get_hands_over_leading_blocks_as_they_land_and_one_waiting_on_it_only_at_its_end(tmp_path):
    """GetBlocks reads each block whole, a batch per run of blocks, and says after each run how
    many leading blocks are in the arena: each of them holds its bytes when the message goes out.
    A second GetBlocks of the same prefix, arriving while the first one's reads run, has no reads
    of its own to report: it says nothing is ready until its end."""

    async def scenario():
        node, keys = await cold_node(tmp_path)
        stats = node.plane.tier.stats
        before = stats.submissions
        reading = node.service._stream_get(node.request("reading", keys), BlockSteps)
        first = await reading.__anext__()
        assert (first.matched, first.blocks_ready, len(first.offsets)) == (BLOCKS, 0, BLOCKS)
        waiting = node.service._stream_get(node.request("waiting", keys), BlockSteps)
        second = await waiting.__anext__()
        assert (second.matched, second.blocks_ready) == (BLOCKS, 0)
        ready = [0]
        async for message in reading:
            assert message.matched == BLOCKS and message.blocks_ready >= ready[-1]
            for offset, key in zip(first.offsets[ready[-1]:message.blocks_ready], keys[ready[-1]:]):
                assert node.arena.read_at(offset, SPEC.block_bytes) == pattern(key)
            ready.append(message.blocks_ready)
        assert ready == [0, *range(1, BLOCKS + 1), BLOCKS]  # one run per block: fewer blocks than BLOCK_PARTS
        assert stats.submissions - before == BLOCKS
        assert [(message.matched, message.blocks_ready) async for message in waiting] == [(BLOCKS, BLOCKS)]
        assert [(message.matched, message.blocks_ready) async for message in
                node.service._stream_get(node.request("warm", keys), BlockSteps)] == [(BLOCKS, BLOCKS)]
        node.engine.verify()
        await node.plane.close(30.0)

    asyncio.run(scenario())


def test_a_demote_skips_blocks_deleted_between_its_steps(tmp_path, monkeypatch):
    """Demote takes its candidates at once but drops them a step at a time,
    other calls running between steps. A chain deleted between two steps is
    skipped (its blocks are no candidates any more), nothing breaks, and the
    chain that was demoted comes back from the drive bit-exact."""
    monkeypatch.setattr(admin_handlers, "DEMOTE_STEP_BLOCKS", 1)  # one chain's leaf per step

    async def scenario():
        node = Node(tmp_path / "nvme0")
        await node.open()
        kept = chain_keys(SPEC, np.arange(3 * SPEC.block_tokens))
        deleted = chain_keys(SPEC, np.arange(3 * SPEC.block_tokens) + 10**6)
        await node.store(kept)
        await node.store(deleted)
        demote = asyncio.create_task(node.service._demote())
        await asyncio.sleep(0)  # the first step runs: the first candidate's chain leaves host memory
        first_step = node.engine.host.pool.resident_blocks
        assert first_step == 3
        assert node.engine.delete(node.namespace_id, deleted[:1]) == (3, 0)
        demoted, payload = await demote
        assert (demoted, payload) == (3, 3 * SPEC.block_bytes)
        assert node.engine.host.pool.resident_blocks == 0 and not node.engine.stored(node.namespace_id, deleted)
        node.engine.verify()
        lease, blocks, *_ = await node.service._pinned_prefix(node.request("reader", kept), "reader")
        node.assert_served(blocks, kept)
        node.engine.verify()
        await node.plane.close(30.0)

    asyncio.run(scenario())


@pytest.mark.parametrize("how", ["release", "expire"])
@pytest.mark.parametrize("steps_kind", [LayerSteps, BlockSteps])
def test_a_streaming_get_whose_lease_ends_while_its_reads_run_settles_cleanly(tmp_path, steps_kind, how):
    """The client Releases the stream's lease (Release and Cancel are separate RPCs), or the clock
    moves past its deadline, while the stream's reads are in flight; a second Get waits on those
    reads meanwhile. The stream then ends with FAILED_PRECONDITION naming lease_ms (nothing is
    pinned for it), the blocks it read stay good for the other Get, and no pin is left behind: the
    Get's own pins (issue 35 item 2) go when it settles. The races that made a settle after the
    lease ended break a check are reproduced in tests/unit/test_engine_disk.py; this is the path
    through the service, for both streaming kinds."""

    async def scenario():
        node, keys = await cold_node(tmp_path)
        stream = node.service._stream_get(node.request("stream", keys), steps_kind)
        first = await stream.__anext__()
        assert len(node.engine.loading) == BLOCKS  # its reads are under way
        if how == "release":
            assert node.engine.release("stream", [first.lease_id]) == 1
        else:
            node.engine.expire(LONG_MS + 1)
        waiting = asyncio.ensure_future(node.service._pinned_prefix(node.request("other", keys), "other"))
        with pytest.raises(FailedPrecondition, match="lease_ms"):
            async for _ in stream:
                pass
        lease, blocks, *_ = await waiting
        node.assert_served(blocks, keys)
        node.engine.release("other", [lease.lease_id])
        assert node.engine.leases.pins_of("stream") == 0 and not node.engine.loading
        assert node.engine.pinned_blocks == 0
        node.engine.verify()
        await node.plane.close(30.0)

    asyncio.run(scenario())


class ParkedDevicePlane:
    """The device plane's copies, parked where a GPU's run: a save until `finish` is set; a load's
    landed callback until the test calls it."""

    def __init__(self) -> None:
        self.saving = asyncio.Event()
        self.finish = asyncio.Event()
        self.landed = None

    def pool(self, client_id, pool_id, namespace_id):
        return SimpleNamespace(layout=SimpleNamespace(layers=[0] * SPEC.num_layers), ring=None)

    def renew(self, pool, now_ms) -> None:
        pass

    def check_transfer(self, pool, keys, pages, flags, base):
        return np.asarray(pages)

    async def save(self, pool, pages, offsets, engine_flag, kvd_flag, base, keys, blocks, distance) -> int:
        self.saving.set()
        await self.finish.wait()
        return base + SPEC.num_layers

    def load(self, pool, pages, keys, blocks, offsets, kvd_flag, base, on_landed, cancelled=None):
        self.landed = on_landed
        return base + SPEC.num_layers, [False] * len(blocks)


def device_node(node: Node) -> ParkedDevicePlane:
    plane = ParkedDevicePlane()
    node.service._device_plane = lambda: plane
    return plane


def test_a_save_whose_lease_expires_while_its_layers_are_copied_frees_no_slot_under_the_copy(tmp_path):
    """SaveLayers holds its reservation lease while the device copies into its slots: the lease
    expiring meanwhile (the sweeper, any request's expiry) ends it for the client, but no slot
    goes back to the pool until the copies are done; then the save is refused by name, nothing
    stored, and the slots are free again."""

    async def scenario():
        node = Node(tmp_path / "nvme0")
        await node.open()
        plane = device_node(node)
        keys = chain_keys(SPEC, np.arange(3 * SPEC.block_tokens) + 7_000)
        request = kvd_pb2.SaveLayersRequest(namespace_id=node.namespace_id, client_id="engine", pool_id=1,
                                            keys=keys, pages=[0, 1, 2], engine_flag=0, kvd_flag=1)
        saving = asyncio.ensure_future(KvdService.SaveLayers.__wrapped__(node.service, request, None))
        await plane.saving.wait()
        [lease] = list(node.engine.leases)
        slots = [node.engine.host_slot(handle.block) for handle in lease.handles]
        node.engine.expire(lease.deadline_ms)
        # Another Put now wants every free slot: it must not get the copies' slots.
        others = chain_keys(SPEC, np.arange(HOST_SLOTS * SPEC.block_tokens) + 9_000)
        other = node.engine.reserve(KeysRequest(node.namespace_id, "other", others, LONG_MS, lease.deadline_ms))
        assert not set(slots) & set(other.slots)
        assert all(handle.block.state == BlockState.WRITABLE for handle in lease.handles)
        node.engine.release("other", [other.lease.lease_id])
        plane.finish.set()
        with pytest.raises(FailedPrecondition, match="lease ran out"):
            await saving
        assert lease.ended and not node.engine.leases and node.engine.pinned_blocks == 0
        assert node.engine.lookup(node.namespace_id, keys) == []
        node.engine.verify()
        await node.plane.close(30.0)

    asyncio.run(scenario())


def test_a_load_whose_lease_expires_before_its_copies_land_keeps_its_blocks_pinned(tmp_path):
    """LoadLayers answers once its copies are issued; they read the pinned host slots until they
    land. Its lease expiring before then must leave the blocks pinned, until the copies land."""

    async def scenario():
        node = Node(tmp_path / "nvme0")
        await node.open()
        plane = device_node(node)
        keys = chain_keys(SPEC, np.arange(3 * SPEC.block_tokens) + 8_000)
        await node.store(keys)
        request = kvd_pb2.LoadLayersRequest(namespace_id=node.namespace_id, client_id="engine", pool_id=1,
                                            keys=keys, pages=[0, 1, 2], kvd_flag=1)
        response = await KvdService.LoadLayers.__wrapped__(node.service, request, None)
        assert response.matched == 3 and response.cut == kvd_pb2.GET_CUT_NONE
        [lease] = [lease for lease in node.engine.leases if lease.client_id == "engine"]
        node.engine.expire(lease.deadline_ms)
        blocks = node.engine.stored(node.namespace_id, keys)
        assert not lease.ended and all(block.ref_count > 0 for block in blocks)
        engine_ops.demote_all(node.engine)  # nothing pinned may give up its host copy
        assert all(node.engine.host_slot(block) >= 0 for block in blocks)
        plane.landed()
        assert lease.ended and node.engine.pinned_blocks == 0
        node.engine.verify()
        await node.plane.close(30.0)

    asyncio.run(scenario())
