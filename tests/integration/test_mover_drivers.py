"""One mover, two drivers: the daemon's disk plane and the simulator end in the same tier state.

The same scenario (chains Put into a small host tier with write-back, so
rounds run, blocks are demoted and evicted, disk slots are reused, and a
Delete) runs through the daemon's real disk plane (kvd.server.disk_plane:
a real DiskTier on O_DIRECT files, the I/O thread, the async writer) and
through the simulator's modelled drive (kvd.sim), each driving the shared
mover (kvd.core.mover). After every step, once both are quiet, every
block's copies (tier and slot) and the disk tier's free and quarantined
slots must be identical: the rules of when and in what order bytes move
live in one place.
"""

from __future__ import annotations

import asyncio
import heapq

import numpy as np

from kvd.config import DiskSettings
from kvd.core.engine import Engine
from kvd.core.keys import chain_keys
from kvd.server.disk_plane import DiskPlane
from kvd.sim.simulator import SimConfig, Simulator
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
        self.engine = self.sim.engine
        self.spec = self.sim.specs[0]
        self.namespace_id = self.sim.namespace_ids[0]

    def put(self, keys: list[bytes]) -> None:
        reserved = self.engine.reserve(KeysRequest(self.namespace_id, "w", keys, LONG_MS, self.sim.clock.now_ms()))
        self.sim.contents.fill(keys, reserved.slots)
        if reserved.lease is not None:
            self.engine.commit(CommitRequest(self.namespace_id, "w", reserved.lease.lease_id, self.sim.clock.now_ms()))

    def delete(self, keys: list[bytes]) -> None:
        self.engine.delete(self.namespace_id, keys)

    def settle(self) -> None:
        """Run the modelled drive until nothing is left to do."""
        sim = self.sim
        sim._pump_devices()
        while sim.events:
            time_us, _, kind, payload = heapq.heappop(sim.events)
            sim._handle(time_us, kind, payload)
        sim.mover.reclaim()
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

    def put(self, keys: list[bytes]) -> None:
        reserved = self.engine.reserve(KeysRequest(self.namespace_id, "w", keys, LONG_MS, 0))
        for key, slot in zip(keys, reserved.slots):
            if slot >= 0:
                self.arena.write(slot, key * (self.spec.block_bytes // len(key)))
        if reserved.lease is not None:
            self.engine.commit(CommitRequest(self.namespace_id, "w", reserved.lease.lease_id, 0))

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
            return steps
        finally:
            await daemon.plane.close(1.0)

    try:
        steps = asyncio.run(scenario())
    finally:
        daemon.arena.close()
    assert len(steps) == len(CHAINS) + 1
    # The scenario exercised what it is for: rounds ran, blocks were demoted and evicted.
    engine = simulated.engine
    assert simulated.sim.mover.rounds >= 3 and engine.disk.counters.written > HOST_SLOTS
    assert engine.host.counters.demotions + engine.host.counters.evictions > 0
