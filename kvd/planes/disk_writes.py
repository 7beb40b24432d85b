"""The disk plane's writes: the writer task that runs the mover's rounds (kvd.core.mover:
removals journalled first, then chunks of writes, in the reads' gaps), the commits that sync
them under fsync group and none, journalled removals and Deletes, and durable waits
(kvd.core.durable).

A part of kvd.planes.disk.DiskPlane: it shares the plane's state through self."""

from __future__ import annotations

import asyncio
import functools
import itertools
import time
from collections.abc import Sequence


from kvd.core.block import Block
from kvd.planner.io_schedule import IoClass
from kvd.core.durable import NotDurable
from kvd.core.mover import WriteRound
from kvd.invariants import check
from kvd.tiers.disk.journal import FsyncPolicy
from kvd.tiers.disk.layout import drive_of


IDLE_POLL_S = 0.05


class DiskWrites:
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
        self.mover.round_removals_journalled(round_, failed_removals)
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
        return await asyncio.shield(self._start_journal(removals, deleted))

    def _start_journal(self, removals: list[tuple[bytes, bytes, int]], deleted: bool) -> asyncio.Future:
        """Journal removals already taken, in a task of their own: their outcome is recorded
        (and retrieved) even when nobody awaits it any more."""
        journal = asyncio.ensure_future(self._journal(removals, deleted))
        journal.add_done_callback(lambda done: done.cancelled() or done.exception())
        return journal

    async def _journal(self, removals: list[tuple[bytes, bytes, int]], deleted: bool) -> int:
        failed = await self._run(self._remove_sync, removals, deleted)
        self.mover.removals_journalled(removals, failed)
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
        waiting, failures, pins, commit_due = self.mover.durable.start(blocks, self._no_drive_writes(),
                                                                       lambda block: loop.create_future())
        try:
            self.wake()
            if commit_due:
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
            self.mover.durable.finish(pins)
        if failures:
            self.counters.durable_wait_failures += 1
        order = {block: position for position, block in enumerate(blocks)}
        return sorted(failures, key=lambda failure: order[failure.block])


def _resolve(outcomes) -> None:
    """Hand each durable wait its block's outcome (None: durable), unless it gave up already."""
    for future, failure in outcomes:
        if not future.done():
            future.set_result(failure)
