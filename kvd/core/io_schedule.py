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
  * When the write backlog reaches its bound (`backlog_limit`, counted by
    the caller in blocks waiting for write-back), writes stop waiting for
    gaps and get a bounded share: one write job after every `write_share`
    read jobs. Memory never fills up because reads kept coming, and reads
    keep most of the drive.
  * `fifo`: arrival order, whatever the class; the baseline the benchmark
    compares against.

CONTROL jobs (opening, syncing the manifest, journalling removals,
registering a namespace) are short and often hold others up, so they go
first in both modes.

Pure bookkeeping, no threads or clocks: the daemon's executor
(kvd.server.disk_plane) and the simulator drive it the same way.
"""

from __future__ import annotations

import collections
import enum
from dataclasses import dataclass, field
from typing import Any

from kvd.invariants import check


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


class IoSchedule:
    def __init__(self, mode: str = "slack", *, write_share: int = 4, backlog_limit: int = 256) -> None:
        check(mode in MODES, f"unknown I/O schedule mode {mode!r} (known: {', '.join(MODES)})")
        check(write_share >= 1 and backlog_limit >= 1, "write_share and backlog_limit must be positive")
        self.mode = mode
        self.write_share = write_share
        self.backlog_limit = backlog_limit
        self.counters = ScheduleCounters()
        self._queues: dict[IoClass, collections.deque[IoJob]] = {c: collections.deque() for c in IoClass}
        self._fifo: collections.deque[IoJob] = collections.deque()
        self._next_sequence = 0
        self._reads_since_write = 0

    def __len__(self) -> int:
        return len(self._fifo) + sum(len(queue) for queue in self._queues.values())

    def queued(self, io_class: IoClass) -> int:
        if self.mode == "fifo" and io_class != IoClass.CONTROL:
            return sum(1 for job in self._fifo if job.io_class == io_class)
        return len(self._queues[io_class])

    def queued_bytes(self, io_class: IoClass) -> int:
        jobs = self._fifo if self.mode == "fifo" and io_class != IoClass.CONTROL else self._queues[io_class]
        return sum(job.nbytes for job in jobs if job.io_class == io_class)

    def push(self, job: IoJob) -> IoJob:
        check(job.sequence == -1, "job pushed twice")
        job.sequence = self._next_sequence
        self._next_sequence += 1
        if self.mode == "fifo" and job.io_class != IoClass.CONTROL:
            self._fifo.append(job)
        else:
            self._queues[job.io_class].append(job)
        return job

    def pop(self, backlog: int = 0) -> IoJob | None:
        """The job to run now, or None if nothing is queued.

        backlog: blocks waiting for write-back (decides whether writes get
        their bounded share while reads are waiting).
        """
        job = self._choose(backlog)
        if job is None:
            return None
        self.counters.dispatched[job.io_class.name.lower()] += 1
        if job.io_class in READS:
            self._reads_since_write += 1
        elif job.io_class == IoClass.WRITE:
            self._reads_since_write = 0
        return job

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
                if backlog >= self.backlog_limit and self._reads_since_write >= self.write_share:
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
