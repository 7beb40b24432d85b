"""The daemon's disk data plane: moves blocks between the arena and the drives.

The engine (kvd.core) decides which block goes where; the disk tier
(kvd.tiers.disk) moves bytes and keeps the records. This module runs them
together:

  * one dedicated I/O thread owns the DiskTier (every call into it happens
    there); the event loop owns the engine (every call into it happens on
    the loop, between awaits). The thread takes its jobs in the order the
    I/O schedule (kvd.core.io_schedule, disk.io_schedule) picks: restores
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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvd.config import DiskSettings
from kvd.core.block import Block
from kvd.core.engine import Engine, PrefetchPlan, Transfer
from kvd.core.get_life import GetLife, Served
from kvd.core.reads import LoadOutcome
from kvd.core.io_schedule import IoClass, IoSchedule
from kvd.core.durable import NotDurable
from kvd.core.mover import Mover, MoverSettings, WriteRound
from kvd.errors import ConfigError, Unavailable
from kvd.invariants import check
from kvd.io import faults
from kvd.planner.slack import SlackTable, WriteSizer
from kvd.planes.io_executor import ScheduledExecutor
from kvd.supervisor import Supervisor
from kvd.tiers.disk.journal import FsyncPolicy
from kvd.tiers.disk.layout import DiskConfig, drive_of, location_of, split_location
from kvd.tiers.disk.tier import DiskRecovery, DiskTier, ReadFailure
from kvd.tiers.host import HostArena

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05
# The tier's reason a read failed, as the engine's outcome of the load.
_LOAD_OUTCOMES = {ReadFailure.NONE: LoadOutcome.OK, ReadFailure.CHECKSUM: LoadOutcome.CORRUPT,
                  ReadFailure.IO_ERROR: LoadOutcome.UNREADABLE, ReadFailure.SHORT_READ: LoadOutcome.UNREADABLE,
                  ReadFailure.MISSING_SEGMENT: LoadOutcome.UNREADABLE}
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


class DiskPlane:
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

    # -- writes ---------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def _update_backlog(self) -> None:
        """Tell the schedule how many blocks wait for write-back while memory needs them written."""
        self._io.backlog = self.mover.backlog()

    def oldest_unwritten_s(self) -> float:
        """How long the oldest block queued for the disk has waited, at most (0: none waits);
        for metrics, any thread."""
        since = self._unwritten_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    async def _writer(self) -> None:
        mover = self.mover
        queue = self.engine.write_queue
        while not self._closing:
            queue.mark(time.monotonic())
            self._unwritten_since = queue.queued_since()
            round_ = mover.next_round()
            self._update_backlog()
            _resolve(mover.hopeless_waits())
            if round_ is None and mover.searching():
                # The slot searches stopped at their budget: go on after the
                # loop's other work, not after an idle wait.
                await asyncio.sleep(0)
                continue
            if round_ is None:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), IDLE_POLL_S)
                except TimeoutError:
                    pass
                continue
            self.writes_idle.clear()
            try:
                await self._write_round(round_)
            finally:
                self.writes_idle.set()
            self.counters.batches += 1
            outcomes = mover.finish_round(round_)
            self._batch_done.set()
            _resolve(outcomes)
            if mover.durable.commit_due():
                self._commit_wanted.set()

    async def wait_for_round(self, timeout_s: float) -> bool:
        """Wake the writer and wait for its next round to end (False after timeout_s): what a Get
        starved of host slots waits for (kvd.core.get_life), since the round's blocks may then give
        up their host copies."""
        self._batch_done.clear()
        self.wake()
        try:
            await asyncio.wait_for(self._batch_done.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _write_round(self, round_: WriteRound) -> None:
        """Removals first (durable), then the blocks chunk by chunk, then compaction if due.

        The chunks (under the slack schedule, of at most
        disk.write_chunk_blocks blocks and disk.write_chunk_bytes) go out as
        one job that keeps the drive busy: the next chunk is at the drive
        while the last one is journalled. While reads are under way (one is
        queued or ended lately) the job runs one chunk and the rest of the
        round queues again behind the reads, so a read waits for one chunk
        at most, two if it arrives while the drive was serving writes only.
        """
        failed_removals = await self._run(self._remove_sync, round_.removals) if round_.removals else set()
        self.mover.removals_journalled(round_, failed_removals)
        if round_.chunk_blocks:  # (fifo: whole rounds)
            block_bytes = max(write.block.index.block_bytes for write in round_.writes)
            fixed = max(1, min(self.settings.write_chunk_blocks, self.settings.write_chunk_bytes // block_bytes))
            round_.chunk_blocks = fixed if self.sizer is None else self.sizer.chunk_blocks(
                block_bytes, fixed, self.settings.write_batch_blocks)
        chunks = round_.chunks()
        while chunks:
            self._update_backlog()
            pieces = [self._write_items(round_, positions) for positions in chunks]
            _, layer_bytes, num_layers, first = pieces[0]
            # The first chunk's bytes: all of it that runs when the job runs inside a read's slack.
            done = await self._run(self._write_pieces, pieces, io_class=IoClass.WRITE,
                                   nbytes=len(first) * layer_bytes * num_layers)
            for positions, ok in zip(chunks, done):
                self.mover.chunk_written(round_, positions, ok)
            chunks = chunks[len(done):]
        await self._run(self.tier.compact_if_needed, self.settings.manifest_max_bytes)

    def _write_items(self, round_: WriteRound, positions: list[int]) -> tuple[bytes, int, int, list[tuple]]:
        """Loop thread: one chunk's writes as plain data (one namespace per chunk)."""
        writes = [round_.writes[position] for position in positions]
        engine = self.engine
        for write in writes:
            # The bytes written are the block's own, pinned in its host slot until the round ends.
            check(write.block.ref_count > 0 and engine.host_slot(write.block) == write.source_slot,
                  "a write from host slot {} that {!r} does not hold", write.source_slot, write.block)
        namespace_id = writes[0].block.index.namespace_id
        spec = self.engine.namespace(namespace_id).spec
        host = engine.host.pool
        items = [(write.block.key, write.block.parent.key if write.block.parent is not None else b"",
                  self._location(write.target_slot), self.arena.address_at(host.offset_of(write.source_slot)))
                 for write in writes]
        return namespace_id, spec.layer_bytes, spec.num_layers, items

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

    def _write_pieces(self, pieces: list[tuple[bytes, int, int, list[tuple]]]) -> list[list[bool]]:
        """I/O thread: write chunks in order, pipelined while they are of one namespace, until reads
        are under way (then at least the first); per chunk written, per block durable."""
        started = time.perf_counter()
        done: list[list[bool]] = []
        written_bytes = 0
        while len(done) < len(pieces) and not (done and self._io.yield_to_reads()):
            namespace_id, layer_bytes, num_layers, _ = pieces[len(done)]
            run = list(itertools.takewhile(lambda piece: piece[0] == namespace_id, pieces[len(done):]))
            for ok in self.tier.write_chunks(namespace_id, layer_bytes, num_layers, [piece[3] for piece in run],
                                             stop=self._io.yield_to_reads):
                done.append([bool(good) for good in ok])
                self.counters.chunks += 1
                written_bytes += sum(done[-1]) * layer_bytes * num_layers
        if self.sizer is not None:
            self.sizer.observe(False, written_bytes, time.perf_counter() - started)
        return done

    def _remove_sync(self, removals: list[tuple[bytes, bytes, int]], deleted: bool = False) -> set[int]:
        """I/O thread: journal removals; returns the slots whose REMOVE failed."""
        failed: set[int] = set()
        by_namespace: dict[bytes, list[tuple[bytes, int]]] = {}
        for namespace_id, key, slot in removals:
            by_namespace.setdefault(namespace_id, []).append((key, slot))
        for namespace_id, items in by_namespace.items():
            located = [(key, self._location(slot)) for key, slot in items]
            results = self.tier.remove_blocks(namespace_id, located, deleted=deleted)
            failed.update(slot for (_, slot), good in zip(items, results) if not good)
        if deleted:
            # Earlier REMOVEs too (an evicted disk copy of a block this Delete
            # removed from host memory): under fsync none they were never synced.
            self.tier.sync(force=True)
        self.counters.removal_failures += len(failed)
        return failed

    async def _journal_removals(self, deleted: bool = False) -> int:
        """Journal every removal the engine queued; how many failed.

        The removals are taken at once (before the first await) and their
        outcome is recorded even if the caller is cancelled meanwhile (its
        client went away): otherwise the slots would stay quarantined.
        """
        removals = self.mover.take_removals()
        if not removals:
            if deleted:  # what others appended unsynced must not outlive a Delete either
                await self._run(functools.partial(self.tier.sync, force=True))
            return 0
        journal = asyncio.ensure_future(self._journal(removals, deleted))
        # Its outcome is retrieved here even when nobody awaits it any more.
        journal.add_done_callback(lambda done: done.cancelled() or done.exception())
        return await asyncio.shield(journal)

    async def _journal(self, removals: list[tuple[bytes, bytes, int]], deleted: bool) -> int:
        failed = await self._run(self._remove_sync, removals, deleted)
        self.mover.removals_done(removals, failed)
        return len(failed)

    async def journal_deletions(self) -> int:
        """After a Delete: its blocks' REMOVE records durable (whatever disk.fsync
        says) and their first pages overwritten; how many could not be.

        Call it in the same step of the event loop as engine.delete (no
        await between): the removals are taken before the first await, so
        no other caller can take them and answer for them with a weaker
        sync. Removals queued earlier by others go with them.
        """
        return await self._journal_removals(deleted=True)

    async def _committer(self) -> None:
        """group: a commit every disk.group_commit_ms, and at once when a client
        waits for one; none: only when a client waits for one."""
        interval_s = self.settings.group_commit_ms / 1000.0 if self.config.fsync_policy == FsyncPolicy.GROUP else None
        while not self._closing:
            try:
                await asyncio.wait_for(self._commit_wanted.wait(), interval_s)
            except TimeoutError:
                pass
            self._commit_wanted.clear()
            await self._commit()

    async def _commit(self) -> None:
        """Sync every drive (the data of each segment written, then the manifest:
        whatever the policy) and answer the durable waits that sync covers."""
        durable = self.mover.durable
        covered = durable.begin_sync()
        await self._run(functools.partial(self.tier.sync, force=True))
        self.counters.commits += 1
        _resolve(durable.end_sync(covered, self._sync_failure))

    def _sync_failure(self, slot: int) -> str:
        """Why the drive of a disk slot did not sync ("" when it did)."""
        return self.tier.failed_drives.get(drive_of(self.config, self._location(slot)), "")

    def _no_drive_writes(self) -> str:
        """Why no drive takes writes ("" when one does): every drive is
        quarantined or failed, so a durability wait would only run out."""
        failed = self.tier.failed_drives
        if len(failed) < self.config.drive_count:
            return ""
        return "no drive takes writes: " + "; ".join(f"drive {drive}: {why}" for drive, why in sorted(failed.items()))

    def _admission(self, block: Block):
        return self.tier.accepts(self.engine.namespace(block.index.namespace_id).spec)

    async def wait_durable(self, blocks: Sequence[Block], timeout_s: float) -> list[NotDurable]:
        """Wait until every block has a durable copy; [] then, else why each of the others has not.

        The blocks waited for stay pinned meanwhile: otherwise host eviction
        could drop one before the writer reaches it, and the Put would wait
        for a write that never comes. Their chains' missing ancestors are
        queued for writing too (engine.require_durable).
        """
        self.counters.durable_waits += 1
        loop = asyncio.get_running_loop()
        waiting, failures, pins = self.mover.durable.start(blocks, self._no_drive_writes(),
                                                           lambda block: loop.create_future())
        try:
            self.wake()
            if self.mover.durable.commit_due():
                self._commit_wanted.set()
            if waiting:
                # asyncio.wait, not wait_for(gather(...)): when the call is
                # cancelled (its client died), wait_for cancels the gather and
                # never retrieves its CancelledError, which asyncio then logs as
                # an error. The futures left behind are resolved by the writer.
                await asyncio.wait(list(waiting.values()), timeout=timeout_s)
            for block, future in waiting.items():
                if not future.done():
                    failures.append(NotDurable(block, "DEADLINE_EXCEEDED", f"it was not written within {timeout_s:.1f} s "
                                               "(the call's deadline; the disk is busy or full)"))
                elif future.result() is not None:
                    failures.append(future.result())
        finally:
            for pin in pins:
                pin.release()
        if failures:
            self.counters.durable_wait_failures += 1
        order = {block: position for position, block in enumerate(blocks)}
        return sorted(failures, key=lambda failure: order[failure.block])

    # -- reads ----------------------------------------------------------

    def start_get(self, life: GetLife, on_layer=None, on_blocks=None) -> asyncio.Task:
        """Start the reads of a planned Get; a task that ends with what it serves (`Served`).

        Called in the loop step of the plan's begin_get, before any await:
        from then on another Get's plan lists these blocks as waits, and
        finds the futures it waits on here. The task owns the reads: if it
        is cancelled, they still finish (the I/O thread writes into the
        pinned slots) and then the Get is dropped (its lease and pins end).

        on_layer(layer, ok), if given, is called on the loop each time layer
        `layer` of every loaded block has landed and been verified; ok[i]
        says whether plan.loads[i] is still good. on_blocks(done, ok), if
        given instead, each time plan.loads[:done] have landed whole and
        been verified (ok as for on_layer, for those).
        """
        check(on_layer is None or on_blocks is None, "a Get reports layers or blocks, not both")
        plan = life.plan
        check(not life.pending or plan.lease is not None, "disk reads for a Get that pins nothing")
        # A Get now waits for these prefetches: they are restores from here on.
        for read in dict.fromkeys(filter(None, map(self._prefetch_reads.get, plan.waits))):
            self._io.promote(read, IoClass.RESTORE)
        loading = self.engine.loading
        check(all(block in self._loads or block not in loading for block in plan.waits),
              "a Get waits for a block being read that no read will report")
        for block in plan.waits:
            if block not in self._loads:
                life.wait_done(block, None)  # its read reported in this very loop step
        waiting = {block: self._loads[block] for block in plan.waits if block in self._loads}
        reading = self._submit_loads(life, on_layer, on_blocks) if plan.loads else None
        task = asyncio.ensure_future(self._complete_get(life, reading, waiting))
        task.add_done_callback(functools.partial(self._end_failed_get, life, reading))
        return task

    def _submit_loads(self, life: GetLife, on_layer, on_blocks) -> asyncio.Future:
        """Hand the plan's loads to the I/O thread as one restore job; its future.

        The loads are finished by a callback on that future, whatever becomes
        of the Get (even a task cancelled before it ever ran).
        """
        plan = life.plan
        loop = asyncio.get_running_loop()
        progress = None
        report = on_layer or on_blocks
        if report is not None:
            def progress(step: int, ok) -> None:  # I/O thread
                loop.call_soon_threadsafe(report, step, ok)
        if self.sizer is not None:
            spec = self.engine.namespace(plan.loads[0].block.index.namespace_id).spec
            self.sizer.restore(len(plan.loads) * spec.block_tokens, spec.layer_bytes // spec.block_tokens,
                               spec.num_layers)
        nbytes = sum(load.block.index.block_bytes for load in plan.loads)
        try:
            submitted = self._io.submit(IoClass.RESTORE, self._read_batch, self._read_work(plan.loads), progress,
                                        on_blocks is not None, nbytes=nbytes)
        except RuntimeError:  # the I/O thread is shut down: nothing read, nothing lost
            life.abandon()
            raise Unavailable("kvd is stopping; the Get's disk reads were not started") from None
        self._loads.update({load.block: loop.create_future() for load in plan.loads})
        reading = asyncio.wrap_future(submitted)
        # Registered before anyone awaits `reading`: the loads are finished
        # before the Get that awaits it resumes.
        reading.add_done_callback(functools.partial(self._finish_loads, life))
        return reading

    async def _complete_get(self, life: GetLife, reading: asyncio.Future | None,
                            waiting: dict[Block, asyncio.Future]) -> Served:
        """Await the plan's own reads, then those of other requests it waits on; settle."""
        if reading is not None:
            # Shielded: the I/O thread writes into the pinned slots whatever
            # becomes of this Get (see _end_failed_get).
            await asyncio.shield(reading)
            await self._journal_removals()
        if waiting:
            outcomes = await asyncio.gather(*(asyncio.shield(future) for future in waiting.values()))
            for block, outcome in zip(waiting, outcomes):
                life.wait_done(block, outcome)
        return life.settle()

    def _end_failed_get(self, life: GetLife, reading: asyncio.Future | None, task: asyncio.Task) -> None:
        """A Get that failed or was cancelled: its lease and its own pins end, once no read
        into its slots runs."""
        if not task.cancelled() and task.exception() is None:
            return

        def close(_done=None) -> None:
            life.drop()

        if reading is None:
            close()
        else:
            # Even when `reading` is done: its _finish_loads callback may be scheduled and not
            # yet run, and a callback added now runs after it.
            reading.add_done_callback(close)

    def _finish_loads(self, life: GetLife, reading: asyncio.Future) -> None:
        """Loop thread: record the reads' outcome. A block whose read failed (a media error,
        reported per entry) is lost; a read job that raised (a bug: the daemon stops) loses
        nothing, its blocks stay on disk."""
        loads = life.plan.loads
        outcomes = self._job_outcome("a disk read job", reading)
        life.loads_done(loads, outcomes)
        self._resolve_loads(loads, outcomes)

    def _job_outcome(self, what: str, job: asyncio.Future | concurrent.futures.Future) -> list[LoadOutcome] | None:
        """A read job's per-block outcome; None when it never ran (cancelled) or raised. A job
        that raised is a bug (media errors are results): it goes to the supervisor."""
        if job.cancelled():
            return None
        if job.exception() is not None:
            self._on_bug(what, job.exception())
            return None
        return job.result()

    def _resolve_loads(self, loads: Sequence[Transfer], outcomes: Sequence[LoadOutcome] | None) -> None:
        """Tell the requests waiting for these loads how they went (None: the reads never ran)."""
        check(outcomes is None or len(loads) == len(outcomes), "one outcome per load")
        for position, load in enumerate(loads):
            future = self._loads.pop(load.block, None)
            if future is not None and not future.done():
                future.set_result(None if outcomes is None else outcomes[position])

    def _read_work(self, loads: Sequence[Transfer]) -> list[tuple[bytes, int, int, list[tuple[int, int, int]]]]:
        """Loop thread: what to read, as plain data, grouped by namespace."""
        groups: dict[bytes, list[tuple[int, int, int]]] = {}
        engine = self.engine
        for position, load in enumerate(loads):
            # The bytes land in a slot only its own block holds, while the engine knows it is being read.
            check(load.block in engine.loading and engine.host_slot(load.block) == load.target_slot,
                  "a read into host slot {} that {!r} does not hold", load.target_slot, load.block)
            groups.setdefault(load.block.index.namespace_id, []).append(
                (position, self._location(load.source_slot),
                 self.arena.address_at(engine.host.pool.offset_of(load.target_slot)))
            )
        work = []
        for namespace_id, items in groups.items():
            spec = self.engine.namespace(namespace_id).spec
            work.append((namespace_id, spec.layer_bytes, spec.num_layers, items))
        return work

    def _read_batch(self, work, progress=None, by_block: bool = False) -> list[LoadOutcome]:
        """I/O thread: reads into the host slots, checksums verified, an outcome per load;
        progress(layer, mask) as layers land, or with by_block progress(done, mask) as leading
        blocks do."""
        total = sum(len(items) for *_, items in work)
        check(not by_block or len(work) == 1, "block-wise progress for a Get of one namespace only")
        outcomes = [LoadOutcome.UNREADABLE] * total
        for namespace_id, layer_bytes, num_layers, items in work:
            report = None
            if progress is not None:
                positions = [position for position, _, _ in items]

                def report(step: int, step_ok, positions=positions) -> None:
                    # Per-load mask in plan order (one namespace per Get).
                    mask = [True] * total
                    for position, good in zip(positions, step_ok):
                        mask[position] = bool(good)
                    progress(step, mask)

            failures = self._read_namespace(namespace_id, layer_bytes, num_layers, items, report, by_block)
            for (position, _, _), failure in zip(items, failures.tolist()):
                outcomes[position] = _LOAD_OUTCOMES[failure]
        return outcomes

    def _read_namespace(self, namespace_id: bytes, layer_bytes: int, num_layers: int, items, report,
                        by_block: bool) -> np.ndarray:
        """I/O thread: one namespace's reads; the tier's ReadFailure code per item."""
        requests = [(self.tier.key_of(slot), slot, address, self.tier.layer_checksums_of(slot))
                    for _, slot, address in items]
        failures = np.zeros(len(requests), dtype=np.int8)
        started = time.perf_counter()
        if by_block:
            # Whole blocks, reported as runs of them land: a client copies
            # them out while the rest are read.
            self.tier.read_blocks(namespace_id, layer_bytes, num_layers, requests, whole_blocks=True,
                                  on_blocks=report, failures=failures)
        else:
            slack = self._slack_writes(namespace_id, num_layers, len(items))
            # Nobody to hand layers to as they land, no writes between layer
            # groups: read each block whole, the drive's largest requests.
            self.tier.read_blocks(namespace_id, layer_bytes, num_layers, requests, report, between_groups=slack,
                                  whole_blocks=report is None and slack is None, failures=failures)
        if self.sizer is not None:
            self.sizer.observe(True, len(requests) * layer_bytes * num_layers, time.perf_counter() - started)
        return failures

    def _slack_writes(self, namespace_id: bytes, num_layers: int, blocks: int):
        """I/O thread: for a restore of `blocks` blocks, what to do between its layer groups: run
        the queued write-back jobs that fit in those layers' slack (Tutti); None without a profile."""
        if self.sizer is None:
            return None
        spec = self.engine.namespace(namespace_id).spec
        budgets = self.sizer.layer_budgets(blocks * spec.block_tokens, spec.layer_bytes // spec.block_tokens,
                                           num_layers)
        if budgets is None:
            return None

        return lambda first, stop: self._io.run_within(int(budgets[first:stop].sum()))

    # -- prefetch ---------------------------------------------------------

    def prefetch(
        self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes
    ) -> tuple[PrefetchPlan, asyncio.Task | None]:
        """Plan a Prefetch and queue its reads; returns without waiting for them.

        The reads go to the I/O thread as PREFETCH jobs of at most
        disk.prefetch_chunk_blocks blocks, behind restores. Everything a Get
        of these blocks needs is in place before this returns: the blocks
        are `loading` in the engine and their futures are in `_loads`. Each
        job's blocks are finished (verified ones kept, then unpinned) as
        soon as that job is done, so a Get waits for its own blocks' job
        only. The task, if any, ends once every job has, with the number of
        blocks read and verified.
        """
        if self.mover.draining:
            raise Unavailable("kvd is draining; no new disk reads are queued")
        plan, jobs = self.mover.prefetch(namespace_id, keys, parent_key)
        if not plan.loads:
            return plan, None
        loop = asyncio.get_running_loop()
        jobs_done = []
        for number, loads in enumerate(jobs):
            try:
                read = self._io.submit(IoClass.PREFETCH, self._read_batch, self._read_work(loads))
            except RuntimeError:  # the I/O thread is shut down: nothing read, nothing lost
                for unread in jobs[number:]:
                    self.mover.prefetch_done(unread, None)
                break
            self._loads.update({load.block: loop.create_future() for load in loads})
            self._prefetch_reads.update(dict.fromkeys([load.block for load in loads], read))
            job_done = loop.create_future()
            # Called in the I/O thread (or here, if already done): hop to the loop.
            read.add_done_callback(lambda read, loads=loads, job_done=job_done: loop.call_soon_threadsafe(
                self._finish_prefetch, loads, read, job_done))
            jobs_done.append(job_done)
        task = asyncio.ensure_future(self._prefetched(jobs_done, len(plan.loads)))
        self._prefetches.add(task)
        task.add_done_callback(self._prefetches.discard)
        return plan, task

    def _finish_prefetch(self, loads: list[Transfer], read: concurrent.futures.Future,
                         job_done: asyncio.Future) -> None:
        """Loop thread: one prefetch job is over; verified blocks stay in host memory, unpinned."""
        for load in loads:
            self._prefetch_reads.pop(load.block, None)
        # Dropped unread at shutdown (cancelled), or a job that raised (a bug, reported):
        # the blocks stay on disk only.
        outcomes = self._job_outcome("a disk prefetch job", read)
        ok = None if outcomes is None else [outcome == LoadOutcome.OK for outcome in outcomes]
        loaded = self.mover.prefetch_done(loads, ok)
        self._resolve_loads(loads, outcomes)
        if not job_done.done():
            job_done.set_result(loaded)

    async def _prefetched(self, jobs_done: list[asyncio.Future], queued: int) -> int:
        """Blocks read and verified once every job of one Prefetch is over."""
        loaded = sum(await asyncio.gather(*jobs_done))
        if loaded < queued and not self._closing:
            # Blocks whose read failed were dropped: journal their removal.
            await self._journal_removals()
        return loaded

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


def _resolve(outcomes) -> None:
    """Hand each durable wait its block's outcome (None: durable), unless it gave up already."""
    for future, failure in outcomes:
        if not future.done():
            future.set_result(failure)


async def _call(function: Callable[[], object]) -> object:
    return function()


def _log_bug(what: str, error: BaseException) -> None:
    """Without a supervisor (a plane run on its own, in tests): log it."""
    log.error("%s failed", what, exc_info=error)
