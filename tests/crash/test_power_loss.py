"""Power loss right after every durable acknowledgement, under fsync strict and group.

The daemon's disk plane runs in-process on a disk tier whose manifests and
registries live on CrashFs and whose segment data goes through an engine
that remembers what each unsynced write replaced (kvd.testing.crashdisk).
A seeded workload stores chains (write-back under host pressure), asks for
some to be durable, and deletes others; right after each durable wait
returns, on the I/O thread, the test captures what the drives would hold
if power were lost at that moment: unsynced manifest bytes cut anywhere,
each unsynced data write kept or undone at random. Every capture is then
opened as a new tier:

* every block acknowledged durable so far is there and reads back exact;
* every block the tier lists either reads back exact or fails its
  checksum (a miss): never other bytes.

Before the fix, an acknowledgement under group waited for the write only,
not for the commit, and lost blocks here.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import numpy as np
import pytest

from kvd.config import DiskSettings
from kvd.core.engine import Engine
from kvd.core.keys import chain_keys
from kvd.core.requests import CommitRequest, KeysRequest
from kvd.io.engine import open_engine
from kvd.planes.disk import DiskPlane
from kvd.testing.crashdisk import PowerLoss, UnsyncedData
from kvd.testing.crashfs import CrashFs
from kvd.testing.put_stream import SPEC, block_bytes_for
from kvd.tiers.disk.tier import DiskTier
from kvd.tiers.host import ArenaLayout, HostArena

HOST_SLOTS = 24
SLOT_BYTES = 8 << 10
DURABLE_PUTS = 8


def settings_for(tmp_path: Path, fsync: str) -> DiskSettings:
    # A long group commit interval: only the waits themselves can make commits happen in time.
    return DiskSettings(directories=[str(tmp_path / "nvme0"), str(tmp_path / "nvme1")], capacity_bytes=2 << 20,
                        slot_bytes=SLOT_BYTES, segment_bytes=1 << 20, fsync=fsync, write_mode="back",
                        write_batch_blocks=4, group_commit_ms=60_000)


class Workload:
    def __init__(self, plane: DiskPlane, engine: Engine, arena: HostArena, seed: int) -> None:
        self.plane, self.engine, self.arena = plane, engine, arena
        self.rng = random.Random(seed)
        self.namespace_id = b""
        self.chains = 0

    def put(self, blocks: int) -> list[bytes]:
        """Store a new chain; its keys (those refused for want of host slots are left out)."""
        self.chains += 1
        keys = chain_keys(SPEC, np.arange(blocks * SPEC.block_tokens) + self.chains * 100_000)
        reserved = self.engine.reserve(KeysRequest(self.namespace_id, "client", keys, 0, 0))
        if reserved.lease is None:
            return []
        for handle, slot in zip(reserved.lease.handles, reserved.slots):
            self.arena.write(slot, block_bytes_for(handle.key, SPEC.block_bytes))
        self.engine.commit(CommitRequest(self.namespace_id, "client", reserved.lease.lease_id, 0))
        self.plane.wake()
        return [block.key for block in self.engine.stored(self.namespace_id, keys)]

    async def durable(self, keys: list[bytes]) -> bool:
        blocks = self.engine.stored(self.namespace_id, keys)
        return len(blocks) == len(keys) and not await self.plane.wait_durable(blocks, 30.0)


async def run(tmp_path: Path, fsync: str, seed: int) -> tuple[list[tuple[PowerLoss, list[bytes]]], DiskSettings]:
    fs = CrashFs(seed)
    engines: list[UnsyncedData] = []

    def make_tier(config):
        engines.append(UnsyncedData(open_engine(kind=config.io_engine, queue_depth=config.queue_depth)))
        return DiskTier(config, engine=engines[-1], fs=fs)

    settings = settings_for(tmp_path, fsync)
    arena = HostArena(ArenaLayout.from_capacity(HOST_SLOTS * SLOT_BYTES, SLOT_BYTES), prefault=False)
    plane = DiskPlane(settings, arena, make_tier=make_tier)
    recovery = await plane.open()
    engine = Engine(host_slot_count=HOST_SLOTS, host_slot_bytes=SLOT_BYTES, disk_slot_count=plane.slot_count,
                    disk_slot_bytes=SLOT_BYTES)
    await plane.recover(engine, recovery)
    plane.start()
    captures: list[tuple[PowerLoss, list[bytes]]] = []
    acked: list[bytes] = []
    capture_rng = random.Random(seed + 1)
    try:
        work = Workload(plane, engine, arena, seed)
        work.namespace_id = engine.register_namespace(SPEC).namespace_id
        await plane.register_namespace(engine, work.namespace_id)
        while len(captures) < DURABLE_PUTS:
            for _ in range(work.rng.randrange(1, 4)):  # fill host memory: write-back, unsynced
                kept = work.put(work.rng.randrange(1, 5))
                if kept and work.rng.random() < 0.2:
                    engine.delete(work.namespace_id, kept[-1:])
                    await plane.journal_deletions()
            keys = work.put(work.rng.randrange(1, 4))
            if keys and await work.durable(keys):
                acked.extend(keys)
                loss = await plane._run(PowerLoss.capture, fs, engines[0], capture_rng)
                captures.append((loss, list(acked)))
            await asyncio.sleep(0)
        engine.verify()
    finally:
        await plane.close(5.0)
        engines[0].close()
        arena.close()
    return captures, settings


def check_capture(loss: PowerLoss, acked: list[bytes], settings: DiskSettings) -> None:
    from kvd.planes.disk import disk_config

    loss.restore()
    tier = DiskTier(disk_config(settings), fs=loss.fs)
    recovery = tier.open()
    arena = HostArena(ArenaLayout(SLOT_BYTES, 64), prefault=False)
    try:
        records = list(recovery.blocks.get(SPEC.namespace_id(), []))
        found = {record.key for record in records}
        missing = [key.hex()[:12] for key in acked if key not in found]
        assert not missing, f"{len(missing)} of {len(acked)} blocks acknowledged durable lost: {missing[:4]}"
        for start in range(0, len(records), 32):
            chunk = records[start:start + 32]
            items = [(record.key, record.location, arena.address_at(arena.layout.slot_bytes * i),
                      record.layer_checksums) for i, record in enumerate(chunk)]
            ok = tier.read_blocks(SPEC.namespace_id(), SPEC.layer_bytes, SPEC.num_layers, items)
            for i, (record, good) in enumerate(zip(chunk, ok)):
                served = arena.slots[i, :SPEC.block_bytes].tobytes()
                if good:
                    assert served == block_bytes_for(record.key, SPEC.block_bytes), "a block read back wrong"
                else:
                    assert record.key not in acked, "a block acknowledged durable failed its checksum"
    finally:
        tier.close()
        arena.close()


@pytest.mark.parametrize("fsync", ["strict", "group", "none"])
def test_every_durable_ack_survives_a_power_loss_right_after_it(tmp_path, fsync):
    captures, settings = asyncio.run(run(tmp_path, fsync, seed=7))
    assert len(captures) == DURABLE_PUTS
    for loss, acked in captures:
        check_capture(loss, acked, settings)
