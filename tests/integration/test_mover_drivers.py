"""One mover, one Get, two drivers: the daemon and the simulator end in the same tier state.

The same scenario (chains Put into a small host tier with write-back, so
rounds run, blocks are demoted and evicted, disk slots are reused, a
Delete, then Gets of chains partly on disk only: unary, layer-wise and
block-wise) runs through the daemon's real disk plane and Get handlers
(kvd.server: a real DiskTier on O_DIRECT files, the I/O thread, the async
writer) and through the simulator's modelled drive (kvd.sim), each driving
the shared mover (kvd.core.mover) and the shared Get (kvd.core.get_life).
After every step, once both are quiet, every block's copies (tier and
slot) and the disk tier's free and quarantined slots must be identical,
and each Get must serve as many blocks on both: the rules of when and in
what order bytes move live in one place.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np

from kvd.config import DiskSettings
from kvd.core.engine import Engine, TierId
from kvd.core.keys import chain_keys
from kvd.planes.disk import DiskPlane
from kvd.server.get_stream import BlockSteps, LayerSteps
from kvd.server.service import KvdService
from kvd.sim.clients import Flow
from kvd.sim.config import SimConfig
from kvd.sim.simulator import Simulator
from kvd.v1 import kvd_pb2
from kvd.tiers.host import ArenaLayout, HostArena
from kvd.core.requests import CommitRequest, KeysRequest

HOST_SLOTS = 12
SLOT_BYTES = 8 << 10
LONG_MS = 60_000
SIM = SimConfig(requests=1, host_blocks=HOST_SLOTS, disk_blocks=(4 << 20) // SLOT_BYTES, block_tokens=8,
                num_layers=2, num_kv_heads=1, head_dim=128, write_mode="back", write_batch_blocks=4,
                write_chunk_blocks=2)
# (first token, blocks) of each chain Put; the third shares the first's prefix.
CHAINS = [(0, 5), (1000, 4), (0, 7), (2000, 6), (3000, 3), (1000, 6), (4000, 8)]
# Gets after them, each through one of the daemon's Get paths (the simulator has one):
# stored chains whose blocks are now partly or wholly on disk only.
GETS = [((0, 7), "unary"), ((1000, 6), "layers"), ((3000, 3), "blocks"), ((4000, 5), "layers"), ((0, 3), "blocks")]


def chain(spec, first: int, blocks: int) -> list[bytes]:
    return chain_keys(spec, np.arange(first, first + blocks * spec.block_tokens))


def tier_state(engine: Engine, namespace_id: bytes) -> dict:
    state = engine.namespace(namespace_id)
    blocks = {block.key: (block.state.name, [(tier.name, slot) for tier, slot in engine.tiers.copies(block)])
              for block in state.index}
    disk = engine.disk.pool
    return {"blocks": blocks, "free": sorted(disk.free_slots), "quarantine": sorted(disk.quarantine),
            "host_free": sorted(engine.host.pool.free_slots)}


class SimSide:
    def __init__(self) -> None:
        self.sim = Simulator(SIM)
        self.world = self.sim.world
        self.engine = self.sim.engine
        self.spec = self.world.specs[0]
        self.namespace_id = self.world.namespace_ids[0]

    def put(self, keys: list[bytes]) -> None:
        now_ms = self.world.timeline.clock.now_ms()
        reserved = self.engine.reserve(KeysRequest(self.namespace_id, "w", keys, LONG_MS, now_ms))
        self.world.contents.fill(keys, reserved.slots)
        if reserved.lease is not None:
            self.engine.commit(CommitRequest(self.namespace_id, "w", reserved.lease.lease_id, now_ms))

    def delete(self, keys: list[bytes]) -> None:
        self.engine.delete(self.namespace_id, keys)

    def get(self, first: int, blocks: int) -> int:
        """A request for the chain, through the simulator's own Get (its read lease released
        once it is served, as a client does); how many blocks it served."""
        now_us = self.world.timeline.now_us
        request = SimpleNamespace(prompt=np.arange(first, first + blocks * self.spec.block_tokens),
                                  reply=np.zeros(0, dtype=np.int64), client_crashes=False, arrival_us=now_us,
                                  tenant=0)
        flow = Flow(request, 0, chain(self.spec, first, blocks), f"get-{first}")
        flow.starved_deadline_us = now_us + SIM.starved_get_wait_ms * 1000
        self.sim.clients.begin_get(flow, final=False)
        self.settle()
        return flow.hit_blocks

    def settle(self) -> None:
        """Run the modelled drive until nothing is left to do."""
        sim = self.sim
        timeline = self.world.timeline
        sim.pump_devices()
        while timeline:
            sim.handle(*timeline.pop())
        self.world.mover.reclaim()
        sim.check_invariants()


class DaemonSide:
    def __init__(self, tmp_path) -> None:
        self.settings = DiskSettings(directories=[str(tmp_path / "nvme0")], capacity_bytes=4 << 20,
                                     slot_bytes=SLOT_BYTES, segment_bytes=4 << 20, fsync="none", write_mode="back",
                                     write_batch_blocks=SIM.write_batch_blocks,
                                     write_chunk_blocks=SIM.write_chunk_blocks, io_schedule=SIM.io_schedule)
        self.arena = HostArena(ArenaLayout.from_capacity(HOST_SLOTS * SLOT_BYTES, SLOT_BYTES), prefault=False)
        self.spec = SIM.namespace_spec(0)

    async def open(self) -> None:
        self.plane = DiskPlane(self.settings, self.arena)
        recovery = await self.plane.open()
        assert self.plane.slot_count == SIM.disk_blocks
        self.engine = Engine(host_slot_count=HOST_SLOTS, host_slot_bytes=SLOT_BYTES,
                             disk_slot_count=self.plane.slot_count, disk_slot_bytes=SLOT_BYTES,
                             high_watermark=SIM.high_watermark, low_watermark=SIM.low_watermark)
        await self.plane.recover(self.engine, recovery)
        self.plane.start()
        self.namespace_id = self.engine.register_namespace(self.spec).namespace_id
        await self.plane.register_namespace(self.engine, self.namespace_id)
        self.service = KvdService(self.engine, self.arena, SimpleNamespace(now_ms=lambda: 0), metrics=None,
                                  max_message_bytes=1 << 20, disk_plane=self.plane)

    async def get(self, first: int, blocks: int, path: str) -> int:
        """A Get of the chain through one of the service's paths, its bytes checked, its lease
        released; then the rest reserved (nothing: all stored), as the simulator's request does."""
        keys = chain(self.spec, first, blocks)
        request = kvd_pb2.GetRequest(namespace_id=self.namespace_id, client_id="r", keys=keys, lease_ms=LONG_MS,
                                     arena_instance_id=self.arena.instance_id)
        if path == "unary":
            pinned = await self.service._pinned_prefix(request, "r")
            lease, served = pinned.lease, pinned.blocks
            lease_id, offsets = (lease.lease_id if lease else 0), self.service._offsets(lease, pinned.offsets)
        else:
            messages = [message async for message in
                        self.service._stream_get(request, LayerSteps if path == "layers" else BlockSteps)]
            served, lease_id, offsets = messages[-1].matched, messages[0].lease_id, messages[0].offsets
            served = offsets[:served]
        for key, offset in zip(keys, offsets[:len(served)]):
            assert self.arena.read_at(offset, self.spec.block_bytes) == key * (self.spec.block_bytes // len(key))
        self.put(keys, "r")  # the rest, computed and stored, while the prefix is still held
        if lease_id:
            self.engine.release("r", [lease_id])
        return len(served)

    def put(self, keys: list[bytes], client_id: str = "w") -> None:
        reserved = self.engine.reserve(KeysRequest(self.namespace_id, client_id, keys, LONG_MS, 0))
        for key, slot in zip(keys, reserved.slots):
            if slot >= 0:
                self.arena.write(slot, key * (self.spec.block_bytes // len(key)))
        if reserved.lease is not None:
            self.engine.commit(CommitRequest(self.namespace_id, client_id, reserved.lease.lease_id, 0))

    async def delete(self, keys: list[bytes]) -> None:
        self.engine.delete(self.namespace_id, keys)
        await self.plane.journal_deletions()

    async def settle(self) -> None:
        """Wake the writer until it has nothing left to do: wait for each round in flight to
        end (an event), then look again (the deadline only catches a writer that hangs)."""
        mover, loop = self.plane.mover, asyncio.get_running_loop()
        deadline = loop.time() + 120
        while (mover.round is not None or not self.plane.writes_idle.is_set()
               or (mover.should_write() and self.engine.write_queue)):
            assert loop.time() < deadline, "the disk writer never went quiet"
            self.plane.wake()
            if self.plane.writes_idle.is_set():
                await asyncio.sleep(0.002)  # its next turn starts the round
            else:
                await asyncio.wait_for(self.plane.writes_idle.wait(), max(0.0, deadline - loop.time()))
        mover.reclaim()
        self.engine.verify()


def test_the_daemon_and_the_simulator_move_the_same_blocks_to_the_same_slots(tmp_path):
    simulated = SimSide()
    daemon = DaemonSide(tmp_path)
    assert daemon.spec == simulated.spec

    async def scenario() -> list[str]:
        await daemon.open()
        steps = []
        try:
            for first, blocks in CHAINS:
                keys = chain(daemon.spec, first, blocks)
                simulated.put(keys)
                daemon.put(keys)
                simulated.settle()
                await daemon.settle()
                steps.append(f"put {first}+{blocks}")
                assert tier_state(daemon.engine, daemon.namespace_id) == \
                    tier_state(simulated.engine, simulated.namespace_id), steps
            victim = chain(daemon.spec, 2000, 2)[-1:]
            simulated.delete(victim)
            await daemon.delete(victim)
            simulated.settle()
            await daemon.settle()
            steps.append("delete")
            assert tier_state(daemon.engine, daemon.namespace_id) == \
                tier_state(simulated.engine, simulated.namespace_id), steps
            for (first, blocks), path in GETS:
                before = sum(daemon.engine.tier_of(block) != TierId.HOST
                             for block in daemon.engine.stored(daemon.namespace_id, chain(daemon.spec, first, blocks)))
                served = await daemon.get(first, blocks, path)
                assert simulated.get(first, blocks) == served, steps
                await daemon.settle()
                steps.append(f"get {first}+{blocks} ({path}): {served} served, {before} from disk")
                assert tier_state(daemon.engine, daemon.namespace_id) == \
                    tier_state(simulated.engine, simulated.namespace_id), steps
            return steps
        finally:
            await daemon.plane.close(1.0)

    try:
        steps = asyncio.run(scenario())
    finally:
        daemon.arena.close()
    assert len(steps) == len(CHAINS) + 1 + len(GETS)
    # The Gets read from disk: they exercised the Get's reads, not only host hits.
    assert sum(int(step.split(", ")[1].split()[0]) for step in steps if step.startswith("get")) > 0, steps
    # The scenario exercised what it is for: rounds ran, blocks were demoted and evicted.
    engine = simulated.engine
    assert simulated.world.mover.rounds >= 3 and engine.disk.counters.written > HOST_SLOTS
    assert engine.host.counters.demotions + engine.host.counters.evictions > 0
