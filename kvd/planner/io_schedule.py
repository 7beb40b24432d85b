"""Which disk job runs next: restores before prefetches before write-back.

The disk tier has one I/O thread (its ring is single-threaded), so jobs run
one at a time and their order is the whole scheduling decision. A restore
sits on an inference request's critical path (time to first token); a
prefetch is a guess about the near future; a write-back batch only has to
finish before host memory runs out. This module orders them that way,
after Tutti's observation that reads on the critical path should not share
a drive with writes that could wait for a gap:

  * `slack` (the default): the queued job of the most urgent class runs
    next (FIFO within a class). A write starts only when no read of any
    kind is waiting, so writes go out in the gaps between restores; the
    daemon cuts write-back into small jobs, so a restore that arrives
    while a write runs waits for one small job at most.
  * Right after a read finishes, another often follows (the next request's
    restore, the next layer group of a long prefix). A write that would
    start within `anticipation_s` of the last read's end waits that long
    for one (anticipatory scheduling): writes go in real gaps, not in the
    moment between two reads.
  * When the write backlog reaches its bound (`backlog_limit`, counted by
    the caller in blocks waiting for write-back), writes stop waiting for
    gaps and get a bounded share of the drive's time: each second a read
    job runs earns writes 1 / `write_share` of a second, which a write may
    spend while reads wait (a write costs what it ran, so slow writes, e.g.
    with fsync, take fewer turns). Memory never fills up because reads kept
    coming, and reads keep most of the drive. Callers report run times with
    job_done().
  * `fifo`: arrival order, whatever the class; the baseline the benchmark
    compares against.

CONTROL jobs (opening, syncing the manifest, journalling removals,
registering a namespace) are short and often hold others up, so they go
first in both modes.

Pure bookkeeping, no threads or clocks: the daemon's executor
(kvd.planes.disk) and the simulator drive it the same way.
"""

from __future__ import annotations

import collections
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvd.invariants import check


# Reads count as under way this long after the last one ended: an engine's restores come back to
# back, with gaps of its own compute between them; a drive idle this long serves writes only.
READS_ACTIVE_S = 0.25


class IoClass(enum.IntEnum):
    """Urgency, most urgent first."""

    CONTROL = 0
    RESTORE = 1
    PREFETCH = 2
    WRITE = 3


MODES = ("slack", "fifo")
READS = (IoClass.RESTORE, IoClass.PREFETCH)


@dataclass(slots=True)
class IoJob:
    io_class: IoClass
    payload: Any = None
    nbytes: int = 0
    sequence: int = -1  # arrival order, set by push


@dataclass(slots=True)
class ScheduleCounters:
    dispatched: dict[str, int] = field(default_factory=lambda: {c.name.lower(): 0 for c in IoClass})
    # Writes that ran because the backlog was full while reads waited.
    forced_writes: int = 0
    # Times a write was queued but a read went first.
    deferred_writes: int = 0
    # Queued jobs moved to a more urgent class (a Get waits for a prefetch).
    promoted: int = 0
    # Writes run inside a restore, in a layer's slack (take_fitting).
    slack_writes: int = 0


class IoSchedule:
    def __init__(self, mode: str = "slack", *, write_share: int = 4, backlog_limit: int = 256,
                 anticipation_s: float = 0.0) -> None:
        check(mode in MODES, f"unknown I/O schedule mode {mode!r} (known: {', '.join(MODES)})")
        check(write_share >= 1 and backlog_limit >= 1, "write_share and backlog_limit must be positive")
        check(anticipation_s >= 0, "anticipation_s must not be negative")
        self.mode = mode
        self.write_share = write_share
        self.backlog_limit = backlog_limit
        self.anticipation_s = anticipation_s if mode == "slack" else 0.0
        self._last_read_end = float("-inf")
        # When pop() held a write back for a read that may follow: the time
        # (same clock as `now`) from which the write may start.
        self.write_hold_until: float | None = None
        self.counters = ScheduleCounters()
        self._queues: dict[IoClass, collections.deque[IoJob]] = {c: collections.deque() for c in IoClass}
        self._fifo: collections.deque[IoJob] = collections.deque()
        self._next_sequence = 0
        # Seconds of drive time writes may take while reads wait: earned by
        # reads run while the backlog is full, spent by the writes that ran.
        self._write_credit_s = 0.0
        self._backlog_full = False

    def __len__(self) -> int:
        return len(self._fifo) + sum(len(queue) for queue in self._queues.values())

    def queued(self, io_class: IoClass) -> int:
        if self.mode == "fifo" and io_class != IoClass.CONTROL:
            return sum(1 for job in self._fifo if job.io_class == io_class)
        return len(self._queues[io_class])

    def queued_bytes(self, io_class: IoClass) -> int:
        """Bytes of the queued (not yet started) jobs of `io_class`, as their submitters counted them."""
        if self.mode == "fifo" and io_class != IoClass.CONTROL:
            return sum(job.nbytes for job in self._fifo if job.io_class == io_class)
        return sum(job.nbytes for job in self._queues[io_class])

    def push(self, job: IoJob) -> IoJob:
        check(job.sequence == -1, "job pushed twice")
        job.sequence = self._next_sequence
        self._next_sequence += 1
        if self.mode == "fifo" and job.io_class != IoClass.CONTROL:
            self._fifo.append(job)
        else:
            self._queues[job.io_class].append(job)
        return job

    def promote(self, matches: Callable[[IoJob], bool], io_class: IoClass) -> bool:
        """Move the queued job `matches` picks into the more urgent `io_class`.

        For a prefetch that a Get now waits for: the Get is on the critical
        path, so its read must not wait behind every other restore, nor be
        starved by them. The job goes to the back of its new class's queue.
        Under fifo arrival order is the whole policy, so nothing moves.
        False if no job less urgent than `io_class` matches (it already ran,
        is running, or is urgent enough).
        """
        if self.mode == "fifo":
            return False
        for queue_class in IoClass:
            if queue_class <= io_class:
                continue
            queue = self._queues[queue_class]
            for position, job in enumerate(queue):
                if matches(job):
                    del queue[position]
                    job.io_class = io_class
                    self._queues[io_class].append(job)
                    self.counters.promoted += 1
                    return True
        return False

    def take_fitting(self, max_bytes: int) -> IoJob | None:
        """The next queued write if it moves at most `max_bytes`, taken out to run now, inside a
        restore's slack (Tutti: writes in the gaps the engine's compute leaves between layer reads);
        None otherwise, and always under fifo."""
        writes = self._queues[IoClass.WRITE]
        if self.mode != "slack" or not writes or writes[0].nbytes > max_bytes:
            return None
        job = writes.popleft()
        self.counters.dispatched["write"] += 1
        self.counters.slack_writes += 1
        return job

    def reads_active(self, now: float) -> bool:
        """A restore or prefetch is queued, or one ended within READS_ACTIVE_S of `now`: a write
        job should go one chunk at a time then, so that a read waits for one chunk at most (slack
        only: under fifo arrival order is the whole policy)."""
        if self.mode != "slack":
            return False
        return now < self._last_read_end + READS_ACTIVE_S or any(self._queues[io_class] for io_class in READS)

    def read_done(self, now: float) -> None:
        """A read job (restore or prefetch) ended at `now` (seconds, any monotonic clock)."""
        self._last_read_end = now

    def pop(self, backlog: int = 0, now: float | None = None) -> IoJob | None:
        """The job to run now, or None if nothing is queued or a write is held back.

        backlog: blocks waiting for write-back (decides whether writes get
        their bounded share while reads are waiting). now: the time, for
        anticipation; a held-back write leaves write_hold_until set.
        """
        self.write_hold_until = None
        self._backlog_full = backlog >= self.backlog_limit
        if not self._backlog_full:
            self._write_credit_s = min(self._write_credit_s, 0.0)  # no hoarding for later
        job = self._choose(backlog)
        if (job is not None and job.io_class == IoClass.WRITE and now is not None and backlog < self.backlog_limit
                and now < self._last_read_end + self.anticipation_s):
            self._queues[IoClass.WRITE].appendleft(job)  # not now: a read may follow
            self.write_hold_until = self._last_read_end + self.anticipation_s
            return None
        if job is None:
            return None
        self.counters.dispatched[job.io_class.name.lower()] += 1
        return job

    def job_done(self, io_class: IoClass, run_s: float) -> None:
        """A job ran for run_s seconds: reads earn writes their share, writes spend it."""
        if io_class in READS:
            if self._backlog_full:
                self._write_credit_s = min(self._write_credit_s + run_s / self.write_share, 1.0)
        elif io_class == IoClass.WRITE:
            self._write_credit_s = max(self._write_credit_s - run_s, -1.0)

    def _choose(self, backlog: int) -> IoJob | None:
        if self._queues[IoClass.CONTROL]:
            return self._queues[IoClass.CONTROL].popleft()
        if self.mode == "fifo":
            return self._fifo.popleft() if self._fifo else None
        writes = self._queues[IoClass.WRITE]
        for io_class in READS:
            queue = self._queues[io_class]
            if not queue:
                continue
            if writes:
                if self._backlog_full and self._write_credit_s > 0:
                    self.counters.forced_writes += 1
                    return writes.popleft()
                self.counters.deferred_writes += 1
            return queue.popleft()
        return writes.popleft() if writes else None

    def drain(self) -> list[IoJob]:
        """Every queued job, in arrival order, leaving the schedule empty (shutdown)."""
        jobs = sorted([*self._fifo, *(job for queue in self._queues.values() for job in queue)],
                      key=lambda job: job.sequence)
        self._fifo.clear()
        for queue in self._queues.values():
            queue.clear()
        return jobs
