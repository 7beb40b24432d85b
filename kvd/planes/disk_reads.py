"""The disk plane's reads: a Get's loads (kvd.core.get_life drives the Get; this runs its
reads on the I/O thread, layer by layer or block by block, checksums verified, and reports
each load's outcome) and Prefetch's read jobs behind restores.

A part of kvd.planes.disk.DiskPlane: it shares the plane's state through self."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import time
from collections.abc import Sequence

import numpy as np

from kvd.core.keys import NamespaceSpec
from kvd.core.block import Block
from kvd.core.engine import PrefetchPlan, Transfer
from kvd.core.get_life import GetLife, Served
from kvd.core.reads import LoadOutcome
from kvd.planner.io_schedule import IoClass
from kvd.errors import Unavailable
from kvd.invariants import check
from kvd.tiers.disk.tier import ReadFailure


# The tier's reason a read failed, as the engine's outcome of the load.
_LOAD_OUTCOMES = {ReadFailure.NONE: LoadOutcome.OK, ReadFailure.CHECKSUM: LoadOutcome.CORRUPT,
                  ReadFailure.IO_ERROR: LoadOutcome.UNREADABLE, ReadFailure.SHORT_READ: LoadOutcome.UNREADABLE,
                  ReadFailure.MISSING_SEGMENT: LoadOutcome.UNREADABLE}


class DiskReads:
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
        """Hand the plan's loads to the I/O thread as one restore job; a future done once the
        loads are finished in the engine.

        They are finished by a callback on the job's future, whatever becomes
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
            spec = life.spec
            self.sizer.restore(len(plan.loads) * spec.block_tokens, spec.layer_bytes // spec.block_tokens,
                               spec.num_layers)
        nbytes = sum(load.block.index.block_bytes for load in plan.loads)
        try:
            submitted = self._io.submit(IoClass.RESTORE, self._read_batch,
                                        self._read_work(plan.loads, life.load_offsets, life.spec), progress,
                                        on_blocks is not None, nbytes=nbytes)
        except RuntimeError:  # the I/O thread is shut down: nothing read, nothing lost
            life.abandon()
            raise Unavailable("kvd is stopping; the Get's disk reads were not started") from None
        self._loads.update({load.block: loop.create_future() for load in plan.loads})
        # Done only once _finish_loads has recorded the reads in the engine. Not the read
        # job's own future: that one may be done before the Get's task first runs (the I/O
        # thread can finish before start_get returns), and awaiting a done future does not
        # yield, so the Get would settle before the callback that finishes its loads.
        landed = loop.create_future()
        asyncio.wrap_future(submitted).add_done_callback(functools.partial(self._finish_loads, life, landed))
        return landed

    async def _complete_get(self, life: GetLife, reading: asyncio.Future | None,
                            waiting: dict[Block, asyncio.Future]) -> Served:
        """Await the plan's own reads, then those of other requests it waits on; settle."""
        if reading is not None:
            # Shielded: the I/O thread writes into the pinned slots whatever
            # becomes of this Get (see _end_failed_get).
            await asyncio.shield(reading)  # and the removals its failed reads queued, journalled
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
            # `reading` is done once _finish_loads has run: no read into the slots is left.
            reading.add_done_callback(close)

    def _finish_loads(self, life: GetLife, landed: asyncio.Future, reading: asyncio.Future) -> None:
        """Loop thread: record the reads' outcome, then say so (`landed`). A block whose read
        failed (a media error, reported per entry) is lost; a read job that raised (a bug: the
        daemon stops) loses nothing, its blocks stay on disk."""
        loads = life.plan.loads
        try:
            outcomes = self._job_outcome("a disk read job", reading)
            removals = life.loads_done(loads, outcomes)
            self._resolve_loads(loads, outcomes)
        except Exception as error:  # a bug, in a callback no task awaits: to the supervisor
            self._on_bug("finishing a Get's disk reads", error)
            landed.set_exception(error)
            return
        if removals:
            # Journalled whatever becomes of the Get (its slots stay quarantined until they are);
            # the Get settles after them.
            self._start_journal(removals, False).add_done_callback(functools.partial(_mirror, landed))
        else:
            # The Get sees the job's own end: cancelled (the daemon stops) or raised (a bug) fail it.
            _mirror(landed, reading)

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

    def _read_work(self, loads: Sequence[Transfer], offsets: Sequence[int], spec: NamespaceSpec
                   ) -> list[tuple[bytes, int, int, list[tuple[int, int, int]]]]:
        """Loop thread: what to read, as plain data (the loads of one namespace, of shape `spec`);
        offsets[i]: where in the host tier loads[i] lands."""
        namespace_id = loads[0].block.index.namespace_id
        check(all(load.block.index.namespace_id == namespace_id for load in loads), "one read job, one namespace")
        items = [(position, self._location(load.source_slot), self.arena.address_at(offset))
                 for position, (load, offset) in enumerate(zip(loads, offsets, strict=True))]
        return [(namespace_id, spec.layer_bytes, spec.num_layers, items)]

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
        spec = self.engine.namespace(namespace_id).spec
        loop = asyncio.get_running_loop()
        jobs_done = []
        for number, loads in enumerate(jobs):
            try:
                read = self._io.submit(IoClass.PREFETCH, self._read_batch,
                                      self._read_work(loads, self.engine.load_offsets(loads), spec))
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


def _mirror(target: asyncio.Future, source: asyncio.Future) -> None:
    """End `target` as `source` ended: cancelled, raised, or done (with its result)."""
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())
