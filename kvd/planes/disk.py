"""The daemon's disk data plane: moves blocks between the arena and the drives.

The engine (kvd.core) decides which block goes where; the disk tier
(kvd.tiers.disk) moves bytes and keeps the records. This module runs them
together:

  * one dedicated I/O thread owns the DiskTier (every call into it happens
    there); the event loop owns the engine (every call into it happens on
    the loop, between awaits). The thread takes its jobs in the order the
    I/O schedule (kvd.planner.io_schedule, disk.io_schedule) picks: restores
    for Gets first, then prefetches, then write-back, which goes out in
    small jobs (disk.write_chunk_blocks) in the gaps between reads;
  * a writer task drains the engine's write-through queue in batches:
    removals of evicted blocks are made durable first, then the data, then
    the PUT records (the tier's write order);
  * Get: blocks only on disk are read layer by layer straight into the
    host slots the engine gave them, checksums verified; a block that fails
    is lost (engine.finish_loads) and never served;
  * a Put that asked for ACK_DURABLE waits until its blocks are written and
    synced: under fsync strict by the write itself, under group and none
    by a commit, which a waiting client starts at once (kvd.core.durable).

DiskPlane here holds the plane's state, opens, recovers, starts and closes
it; its writes (the writer, commits, removals, durable waits) are
disk_writes.py's part of it and its reads (Gets' loads, Prefetch)
disk_reads.py's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvd.config import DiskSettings
from kvd.core.block import Block
from kvd.core.engine import Engine
from kvd.planner.io_schedule import IoClass, IoSchedule
from kvd.core.mover import Mover, MoverSettings
from kvd.errors import ConfigError
from kvd.io import faults
from kvd.planner.slack import SlackTable, WriteSizer
from kvd.planes.disk_reads import DiskReads
from kvd.planes.disk_writes import IDLE_POLL_S, DiskWrites
from kvd.planes.io_executor import ScheduledExecutor
from kvd.supervisor import Supervisor
from kvd.tiers.disk.journal import FsyncPolicy
from kvd.tiers.disk.layout import DiskConfig, location_of, split_location
from kvd.tiers.disk.reads import Places
from kvd.tiers.disk.tier import DiskRecovery, DiskTier
from kvd.tiers.host import HostArena

log = logging.getLogger(__name__)

@dataclass(slots=True)


class DiskPlaneCounters:
    batches: int = 0
    chunks: int = 0  # write chunks at the drive (data batches), counted on the I/O thread
    commits: int = 0
    removal_failures: int = 0
    durable_waits: int = 0
    durable_wait_failures: int = 0
    recovery: dict = field(default_factory=dict)


def disk_config(settings: DiskSettings) -> DiskConfig:
    return DiskConfig(
        directories=tuple(settings.directories),
        capacity_bytes=settings.capacity_bytes,
        slot_bytes=settings.slot_bytes,
        min_slot_bytes=settings.min_slot_bytes,
        segment_bytes=settings.segment_bytes,
        fsync_policy=FsyncPolicy(settings.fsync),
        queue_depth=settings.queue_depth,
        io_engine=settings.io_engine,
        read_extent_bytes=settings.read_extent_bytes,
        zero_segments=settings.zero_segments,
    )


def _write_sizer(settings: DiskSettings) -> WriteSizer | None:
    if not settings.slack_profile or settings.io_schedule != "slack":
        return None
    try:
        return WriteSizer(SlackTable.load(Path(settings.slack_profile)))
    except ValueError as error:
        raise ConfigError("disk.slack_profile", str(error)) from None


class DiskPlane(DiskWrites, DiskReads):
    def __init__(self, settings: DiskSettings, arena: HostArena,
                 make_tier: Callable[[DiskConfig], DiskTier] = DiskTier) -> None:
        self.settings = settings
        self.config = disk_config(settings)
        self.arena = arena
        # The tier's maker, called on the I/O thread (crash tests hand in their own file systems).
        self._make_tier = make_tier
        # Told of a bug met off the request path (the daemon's supervisor stops it; see start).
        self._on_bug: Callable[[str, BaseException], None] = _log_bug
        self.engine: Engine | None = None
        self.tier: DiskTier | None = None
        self.counters = DiskPlaneCounters()
        self._io = ScheduledExecutor(IoSchedule(settings.io_schedule, write_share=settings.write_share,
                                                backlog_limit=settings.write_backlog_blocks,
                                                anticipation_s=settings.write_anticipation_ms / 1000.0))
        # Write jobs sized to the restores' slack (disk.slack_profile), or None: write_chunk_blocks.
        self.sizer = _write_sizer(settings)
        self._wake = asyncio.Event()
        self._loads: dict[Block, asyncio.Future] = {}
        # Blocks being prefetched -> their read job, to promote it when a Get
        # waits for one; and the tasks that see each Prefetch's reads done.
        self._prefetch_reads: dict[Block, concurrent.futures.Future] = {}
        self._prefetches: set[asyncio.Task] = set()
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        # When to write and in what order (kvd.core.mover); made with the engine.
        self.mover: Mover | None = None
        # Set whenever no write batch is in flight (its pins are released).
        self.writes_idle = asyncio.Event()
        self.writes_idle.set()
        # Set after every write batch: what a Get short of host slots waits for.
        self._batch_done = asyncio.Event()
        # Set when a client waits for a commit (fsync group or none).
        self._commit_wanted = asyncio.Event()
        # When the oldest block queued for the disk was queued, at the latest (time.monotonic; None: none).
        self._unwritten_since: float | None = None

    @property
    def slot_count(self) -> int:
        return self.config.slot_count

    async def _run(self, function, *args, io_class: IoClass = IoClass.CONTROL, nbytes: int = 0):
        return await self._io.run(io_class, function, *args, nbytes=nbytes)

    @property
    def io(self) -> ScheduledExecutor:
        """The I/O thread and its schedule (queue lengths and times for metrics)."""
        return self._io

    def drive_states(self) -> list[str]:
        """Each drive's state, for metrics (any thread): ok, failed or quarantined."""
        tier = self.tier
        if tier is None:
            return []
        return ["quarantined" if drive in tier.quarantined else "failed" if drive in tier.failed_drives else "ok"
                for drive in range(self.config.drive_count)]

    def recovery_lost_blocks(self) -> int:
        """Blocks the drives described that the last start could not recover (known ones)."""
        return self.counters.recovery.get("lost_blocks", 0)

    def totals(self) -> tuple[int, int, dict[bytes, int]]:
        """(commits, segment fdatasyncs, corrupt blocks by namespace) so far (for metrics; any thread)."""
        stats = self.tier.stats if self.tier is not None else None
        if stats is None:
            return self.counters.commits, 0, {}
        return self.counters.commits, stats.fsyncs, dict(stats.corrupt_blocks)

    def io_bytes(self) -> tuple[int, int]:
        """Bytes (read, written) through the drives so far (for metrics; any thread)."""
        stats = self.tier.stats if self.tier is not None else None
        return (stats.bytes_read, stats.bytes_written) if stats is not None else (0, 0)

    # -- start ----------------------------------------------------------

    async def open(self) -> DiskRecovery:
        """Open the drives (in the I/O thread); O(records), no data read."""

        def open_tier() -> tuple[DiskTier, DiskRecovery]:
            tier = self._make_tier(self.config)
            recovery = tier.open()
            for fault in faults.inject(tier.engine, os.environ.get(faults.FAULTS_ENV, "")):
                log.warning("injecting disk faults (testing only)", extra={"rule": repr(fault)})
            return tier, recovery

        self.tier, recovery = await self._run(open_tier)
        return recovery

    async def recover(self, engine: Engine, recovery: DiskRecovery) -> int:
        """Index what the drives hold; journal removals of what was dropped."""
        self.engine = engine
        settings = self.settings
        self.mover = Mover(engine, MoverSettings(
            write_mode=settings.write_mode, batch_blocks=settings.write_batch_blocks,
            # Under fifo a round is one job, in arrival order with the reads:
            # the behaviour the slack schedule replaced (the benchmark's baseline).
            chunk_blocks=0 if settings.io_schedule == "fifo" else settings.write_chunk_blocks,
            prefetch_max_blocks=settings.prefetch_max_blocks, prefetch_chunk_blocks=settings.prefetch_chunk_blocks,
            sync=settings.fsync),
            admission_reason=lambda block: self._admission(block).reason)
        drives = self.config.drive_count
        for drive in recovery.quarantined:
            engine.retire_disk_pages(range(drive, self.config.slot_count, drives))
        indexed = 0
        for namespace_id, entry in recovery.namespaces.items():
            if entry.spec is None:
                log.warning("disk namespace with an unreadable spec left alone", extra={"namespace": namespace_id.hex()})
                continue
            state = engine.register_namespace(entry.spec)
            if self.tier.accepts(entry.spec):
                engine.enable_disk(state.namespace_id)
            records = recovery.blocks.get(namespace_id, [])
            indexed += engine.recover(
                namespace_id,
                [(record.key, record.parent_key if any(record.parent_key) else b"", self._slot(record.location))
                 for record in records],
            )
        await self._journal_removals()
        self.counters.recovery = {
            "records": recovery.records,
            "indexed": indexed,
            "dropped_at_open": recovery.dropped.total,
            "truncated_bytes": recovery.truncated_bytes,
            "damaged_bytes": recovery.damaged_bytes,
            "lost_records": recovery.lost_records,
            "quarantined_drives": len(recovery.quarantined),
        }
        # Dropped at open, destroyed by damage, on quarantined drives (where
        # known), and chains the engine dropped because their parent was lost.
        self.counters.recovery["lost_blocks"] = (
            recovery.dropped.total + recovery.lost_records + engine.disk.counters.recovery_dropped
            + sum(damage.blocks or 0 for damage in recovery.quarantined.values()))
        return indexed

    def start(self, supervisor: Supervisor | None = None) -> None:
        """Start the writer and (fsync group or none) the commit task; under `supervisor`
        (the daemon's), a failure of either, or of the I/O thread, stops the daemon."""
        spawn = supervisor.spawn if supervisor is not None else asyncio.create_task
        if supervisor is not None:
            self._on_bug = supervisor.fail
            loop = asyncio.get_running_loop()
            self._io.on_crash = lambda error: loop.call_soon_threadsafe(supervisor.fail, "the disk I/O thread", error)
        self._tasks.append(spawn(self._writer(), name="disk-writer"))
        if self.config.fsync_policy != FsyncPolicy.STRICT:
            self._tasks.append(spawn(self._committer(), name="disk-commit"))

    async def register_namespace(self, engine: Engine, namespace_id: bytes) -> None:
        """Persist a namespace on the drives and start writing its blocks, if the tier takes them."""
        state = engine.namespace(namespace_id)
        if state.index.disk_enabled:
            return
        admission = self.tier.accepts(state.spec)
        if not admission:
            log.warning(
                "namespace stays in host memory only",
                extra={"model_id": state.spec.model_id, "reason": admission.reason},
            )
            return
        await self._run(self.tier.register_namespace, namespace_id, state.spec.encode())
        engine.enable_disk(namespace_id)


    async def places(self, namespace_id: bytes, keys: Sequence[bytes], disk_slots: Sequence[int]) -> Places:
        """Where the blocks in the engine's `disk_slots` lie on the drives, and their layers'
        checksums (DiskTier.places), asked on the I/O thread; the caller holds them pinned."""
        spec = self.engine.namespace(namespace_id).spec
        keys_and_slots = [(key, self._location(slot)) for key, slot in zip(keys, disk_slots)]
        return await self._run(self.tier.places, namespace_id, spec.layer_bytes, spec.num_layers, keys_and_slots)

    def segment_fds(self) -> list[int]:
        return self.tier.segment_fds()

    def _location(self, slot: int) -> int:
        """The disk tier's location (kvd.tiers.disk.layout) of the engine's disk slot."""
        pool = self.engine.disk.pool
        if len(pool.classes) == 1:
            return slot
        page, slot_class, position = pool.place_of(slot)
        return location_of(page, slot_class.index, position)

    def _slot(self, location: int) -> int:
        """The engine's disk slot at a location the disk tier found; -1 if it has none."""
        pool = self.engine.disk.pool
        if len(pool.classes) == 1:
            return location
        page, class_index, position = split_location(location)
        if class_index >= len(pool.classes) or page >= pool.page_count:
            return -1
        return pool.slot_at(page, class_index, position)


    # -- stop -----------------------------------------------------------

    async def close(self, flush_timeout_s: float) -> None:
        """Write what is queued (within the time given), sync, and close the drives."""
        engine = self.engine
        # Write-back blocks still only in memory get the grace period too.
        if self.mover is not None:
            self.mover.draining = True
        deadline = asyncio.get_running_loop().time() + flush_timeout_s
        while engine is not None and engine.write_queue and asyncio.get_running_loop().time() < deadline:
            self.wake()
            await asyncio.sleep(IDLE_POLL_S)
        if self._prefetches:
            # Prefetch reads get what is left of the time too; those still
            # queued then are dropped unread (their blocks stay on disk).
            await asyncio.wait(set(self._prefetches), timeout=max(0.0, deadline - asyncio.get_running_loop().time()))
            for read in list(self._prefetch_reads.values()):
                read.cancel()
        self._closing = True
        self.wake()
        for task in self._tasks:
            task.cancel()
        # A task that failed was reported by its supervisor; the tier is closed all the same.
        await asyncio.gather(*self._tasks, return_exceptions=True)
        # Every queued job first (a restore runs against the open tier, never a closed one).
        await asyncio.wrap_future(self._io.when_idle())
        # The I/O thread is gone if it crashed (reported): then this thread is the tier's only caller.
        run = self._run if self._io.crashed is None else _call
        try:
            if self.tier is not None:
                await run(self.tier.close)  # (which syncs what the policy syncs first)
        finally:
            self._io.shutdown(wait=True)


async def _call(function: Callable[[], object]) -> object:
    return function()


def _log_bug(what: str, error: BaseException) -> None:
    """Without a supervisor (a plane run on its own, in tests): log it."""
    log.error("%s failed", what, exc_info=error)
