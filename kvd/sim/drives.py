"""The modelled devices at work: the daemon's mover's jobs, run in simulated time.

Each tier below host memory has a device of its own (kvd.sim.disk: a drive
under the disk, memory under a middle tier). On each turn the mover
(kvd.core.mover) picks the next write round for each tier; as the daemon's
disk plane must, the round's removals (evicted blocks) are journalled
before new bytes go into their slots, then its writes go out a chunk at a
time. Removals left over (lost, deleted or evicted blocks) are journalled
when the drive is idle. Reads are a Get's own loads (its GetLife is told
when they end) and prefetch jobs; a Get that needs a block another read is
loading waits for that read, and a queued prefetch it waits for becomes a
restore, as the daemon promotes it.

Bytes move on the fake slot contents (kvd.sim.plane), with the injected
faults (kvd.sim.faults). Which blocks move, and when, is the mover's and
the engine's decision; this only runs the jobs and says when they end.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvd.planner.io_schedule import IoSchedule
from kvd.core.mover import WriteRound
from kvd.core.reads import LoadOutcome
from kvd.core.tier import StorageTier
from kvd.core.transfer import Transfer
from kvd.sim.disk import DiskOp, DiskOpKind, ModelledDisk
from kvd.sim.events import EventKind
from kvd.sim.faults import Faults
from kvd.sim.world import World

if TYPE_CHECKING:
    from kvd.sim.clients import Flow


@dataclass(slots=True, eq=False)
class WriteBatch:
    """The mover's write round in flight on the modelled drive: its chunks, one job each."""

    round: WriteRound
    chunks: list[list[int]] = field(default_factory=list)
    next_chunk: int = 0


def modelled_devices(world: World) -> dict[StorageTier, ModelledDisk]:
    """One modelled device per tier below host memory, the disk's last; none without a disk tier."""
    config, engine = world.config, world.engine
    devices = {}
    if config.disk_blocks:
        ids = itertools.count(1)
        for tier in engine.lower_tiers:
            schedule = IoSchedule(config.io_schedule, write_share=config.write_share,
                                  backlog_limit=config.write_backlog_blocks)
            spec = config.disk if tier is engine.disk else config.middle
            devices[tier] = ModelledDisk(spec, schedule, ids)
    return devices


class Drives:
    def __init__(self, world: World, faults: Faults) -> None:
        self.world = world
        self.faults = faults
        self.devices = modelled_devices(world)
        self.disk: ModelledDisk | None = self.devices[world.engine.disk] if self.devices else None
        # Keys loading -> the read operation loading them; read operation id -> the Gets
        # waiting for it; the reads in flight, prefetches' and Gets' own.
        self.loading: dict[bytes, int] = {}
        self.read_waiters: dict[int, list[Flow]] = {}
        self.prefetch_reads: dict[int, DiskOp] = {}
        self.get_reads: dict[int, DiskOp] = {}
        # The mover's write round in flight to each tier below host memory.
        self.batches: dict[StorageTier, WriteBatch] = {}

    # ------------------------------------------------------------------
    # Writes: the mover's rounds and journalled removals

    def start_rounds(self) -> None:
        """The mover's next write round for each tier (it reclaims first), its removals journalled first."""
        for tier in self.devices:
            round_ = self.world.mover.next_round(tier)
            if round_ is not None:
                batch = self.batches[tier] = WriteBatch(round_)
                if round_.removals:
                    self.journal(round_.removals, batch)
                else:
                    self._removals_journalled(batch)

    def start_jobs(self) -> None:
        """Removals in slack time, then each device's next job, its end an event."""
        world = self.world
        if self.disk.idle and world.engine.disk.pool.removals:
            # Removals of lost, deleted or evicted blocks, in slack time.
            self.journal(world.mover.take_removals(), None)
        timeline = world.timeline
        for tier, device in self.devices.items():
            operation = device.start_next(timeline.now_us, world.mover.backlog(tier))
            if operation is not None:
                timeline.schedule(operation.done_us, EventKind.DISK_DONE, operation)

    def journal(self, removals: list[tuple[bytes, bytes, int]], batch: WriteBatch | None) -> None:
        """Journal removals (namespace id, key, disk slot), for a round (`batch`) or on their own."""
        operation = self.disk.op(DiskOpKind.JOURNAL, 0, self.world.timeline.now_us)
        operation.removals = removals
        operation.batch = batch
        self.disk.submit(operation)

    def _removals_journalled(self, batch: WriteBatch) -> None:
        self.world.mover.round_removals_journalled(batch.round, ())
        batch.chunks = batch.round.chunks()
        self._submit_chunk(batch)

    def _submit_chunk(self, batch: WriteBatch) -> None:
        writes = [batch.round.writes[position] for position in batch.chunks[batch.next_chunk]]
        device = self.devices[batch.round.target]
        operation = device.op(DiskOpKind.WRITE, sum(w.block.index.block_bytes for w in writes),
                              self.world.timeline.now_us)
        operation.writes = writes
        operation.batch = batch
        device.submit(operation)

    def write_done(self, operation: DiskOp) -> list | None:
        """A journal or a write chunk ended; the outcomes of the durable waits when it ended a round."""
        world = self.world
        batch = operation.batch
        if operation.kind == DiskOpKind.JOURNAL:
            world.contents.drop(operation.removals)
            if batch is None:
                world.mover.removals_journalled(operation.removals, ())
            else:
                self._removals_journalled(batch)
            return None
        failing = self.faults.failing_writes(operation.writes)
        world.mover.chunk_written(batch.round, batch.chunks[batch.next_chunk],
                                  world.contents.write(operation.writes, failing))
        batch.next_chunk += 1
        if batch.next_chunk < len(batch.chunks):
            self._submit_chunk(batch)
            return None
        outcomes = world.mover.finish_round(batch.round)
        del self.batches[batch.round.target]
        return outcomes

    # ------------------------------------------------------------------
    # Reads: Gets' loads and prefetches

    def read(self, kind: DiskOpKind, loads: Sequence[Transfer]) -> list[DiskOp]:
        """One read operation per device the loads come from."""
        by_source: dict[StorageTier, list[Transfer]] = {}
        for load in loads:
            by_source.setdefault(load.source, []).append(load)
        operations = []
        for source, group in by_source.items():
            device = self.devices[source]
            operation = device.op(kind, sum(load.block.index.block_bytes for load in group),
                                  self.world.timeline.now_us)
            operation.loads = group
            device.submit(operation)
            operations.append(operation)
            for load in group:
                self.loading[load.block.key] = operation.op_id
        return operations

    def prefetch(self, jobs: Sequence[Sequence[Transfer]]) -> None:
        """A prefetch's jobs (the mover's plan), as PREFETCH reads behind restores."""
        for job in jobs:
            for operation in self.read(DiskOpKind.PREFETCH, job):
                self.prefetch_reads[operation.op_id] = operation

    def start_get_reads(self, flow: Flow) -> None:
        """A planned Get's reads: its own loads, and the reads in flight of the blocks it waits for
        (a queued prefetch among them becomes a restore, as the daemon promotes it)."""
        life = flow.life
        plan = life.plan
        for operation in self.read(DiskOpKind.READ, plan.loads):
            operation.reader = life
            self.get_reads[operation.op_id] = operation
            flow.wait_ops.add(operation.op_id)
        flow.waits = set(plan.waits)
        waited = {self.loading[block.key] for block in plan.waits}
        if waited & set(self.prefetch_reads):
            for device in self.devices.values():
                device.promote(waited & set(self.prefetch_reads))
        flow.wait_ops |= waited
        for op_id in flow.wait_ops:
            self.read_waiters.setdefault(op_id, []).append(flow)

    def read_done(self, operation: DiskOp) -> tuple[list[Flow], list[LoadOutcome]]:
        """A read ended: its bytes in the host slots (or lost), the engine told; the Gets that
        waited for it, and each load's outcome."""
        world = self.world
        corrupt = self.faults.corrupt_loads(operation.loads)
        ok = world.contents.load(operation.loads, corrupt)
        outcomes = [LoadOutcome.OK if good else LoadOutcome.CORRUPT for good in ok]
        if operation.kind == DiskOpKind.PREFETCH:
            del self.prefetch_reads[operation.op_id]
            world.mover.prefetch_done(operation.loads, ok)
        else:
            del self.get_reads[operation.op_id]
            removals = operation.reader.loads_done(operation.loads, outcomes)
            if removals:  # as the daemon: the lost blocks' removals journalled before the Get settles
                self.journal(removals, None)
        world.stats.lost_blocks += ok.count(False)
        for load in operation.loads:
            del self.loading[load.block.key]
        return self.read_waiters.pop(operation.op_id, []), outcomes

    def nothing_in_flight(self) -> bool:
        """No read, no write round in flight."""
        return not (self.read_waiters or self.prefetch_reads or self.get_reads or self.batches)
