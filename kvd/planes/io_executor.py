"""The disk tier's I/O thread, taking its jobs in the order an IoSchedule picks.

Every call into the DiskTier happens on this one thread (the native ring is
single-threaded). Callers on the event loop hand it jobs with an urgency
class and await the result:

    executor = ScheduledExecutor(IoSchedule("slack"))
    ok = await executor.run(IoClass.RESTORE, tier.read_blocks, ...)

The loop keeps `backlog` up to date (blocks waiting for write-back), which
the schedule uses to give writes their bounded share when memory is
filling up. Queue lengths, waits and run times per class are counted for
metrics and `kvd status`; `on_job`, if set, is called on the I/O thread
with each job's class, wait and run time (seconds) as it ends.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvd.planner.io_schedule import READS, IoClass, IoJob, IoSchedule
from kvd.planner.load_time import RateMeter

# A held write looks at the clock again at least this often (the clock may
# be injected, and jump: a submit is not the only thing that ends a hold).
HOLD_POLL_S = 0.05


@dataclass(slots=True)
class ClassTimes:
    jobs: int = 0
    wait_seconds: float = 0.0  # queued, not yet running
    run_seconds: float = 0.0
    max_wait_seconds: float = 0.0


@dataclass(slots=True)
class _Work:
    function: Callable[..., Any]
    args: tuple
    future: concurrent.futures.Future
    queued_at: float


@dataclass(slots=True)
class ExecutorStats:
    by_class: dict[str, ClassTimes] = field(default_factory=lambda: {c.name.lower(): ClassTimes() for c in IoClass})


class ScheduledExecutor:
    def __init__(self, schedule: IoSchedule, *, name: str = "kvd-disk",
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.schedule = schedule
        # Seconds, for the schedule's write hold and the job times (tests inject one).
        self._clock = clock
        self.backlog = 0  # set by the event loop; read by the I/O thread (an int: no lock needed)
        self.stats = ExecutorStats()
        # The drives' recent read rate (restores and prefetches, bytes over run time), for the
        # load-time estimates a Lookup may ask for (kvd.planner.load_time).
        self.read_rate = RateMeter()
        # (class name, wait_s, run_s) per job, on the I/O thread; must not raise.
        self.on_job: Callable[[str, float, float], None] | None = None
        self._condition = threading.Condition()
        self._closed = False
        self._reading = False  # the I/O thread is inside a read job (a write may run in its slack)
        self._read_running = 0  # bytes of the read job the I/O thread runs now (0: none)
        # Called on the I/O thread if its loop itself fails (a bug: a job's own exception goes to
        # its caller); the thread has then failed every queued job and stopped.
        self.on_crash: Callable[[BaseException], None] | None = None
        self.crashed: BaseException | None = None
        self._busy = False  # a job popped and not yet done
        self._idle_waiters: list[concurrent.futures.Future] = []
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, io_class: IoClass, function: Callable[..., Any], *args: Any,
               nbytes: int = 0) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._condition:
            if self._closed:
                raise RuntimeError("the disk I/O thread is shut down")
            self.schedule.push(IoJob(io_class, _Work(function, args, future, self._clock()), nbytes))
            self._condition.notify()
        return future

    async def run(self, io_class: IoClass, function: Callable[..., Any], *args: Any, nbytes: int = 0) -> Any:
        return await asyncio.wrap_future(self.submit(io_class, function, *args, nbytes=nbytes))

    def promote(self, future: concurrent.futures.Future, io_class: IoClass) -> bool:
        """Move the queued job of `future` into the more urgent `io_class` (IoSchedule.promote)."""
        with self._condition:
            return self.schedule.promote(lambda job: job.payload.future is future, io_class)

    def queued_read_bytes(self) -> int:
        """Bytes of restores and prefetches queued, and of the one running (all of it: how far it got
        is not known here): what a new read waits behind."""
        with self._condition:
            return self._read_running + sum(self.schedule.queued_bytes(io_class) for io_class in READS)

    def queued(self) -> dict[str, int]:
        with self._condition:
            return {c.name.lower(): self.schedule.queued(c) for c in IoClass}

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as error:
            with self._condition:
                self.crashed = error
                self._closed = True
                orphans = self.schedule.drain()
                waiters, self._idle_waiters = self._idle_waiters, []
            for job in orphans:
                job.payload.future.set_exception(RuntimeError("the disk I/O thread failed"))
            for waiter in waiters:
                waiter.set_result(None)
            if self.on_crash is None:
                raise  # (threading's excepthook prints it)
            self.on_crash(error)  # logged once, by whoever it tells

    def _loop(self) -> None:
        while True:
            with self._condition:
                job = self.schedule.pop(self.backlog, self._clock())
                while job is None:
                    hold_until = self.schedule.write_hold_until
                    if hold_until is not None:
                        # A write held back for a read that may follow: wait
                        # for one (a submit wakes us) or for the hold to end.
                        self._condition.wait(max(0.0, min(hold_until - self._clock(), HOLD_POLL_S)))
                    elif self._closed:
                        return
                    else:
                        self._condition.wait()
                    job = self.schedule.pop(self.backlog, self._clock())
                self._busy = True
            self._execute(job)
            with self._condition:
                self._busy = False
                if not len(self.schedule):
                    waiters, self._idle_waiters = self._idle_waiters, []
                    for waiter in waiters:
                        waiter.set_result(None)

    def when_idle(self) -> concurrent.futures.Future:
        """A future done once no job is queued or running (at shutdown: after the last
        restore, before the tier closes)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._condition:
            if self._closed and not self._thread.is_alive() or not (self._busy or len(self.schedule)):
                future.set_result(None)
            else:
                self._idle_waiters.append(future)
        return future

    def run_fitting(self, max_bytes: int) -> int:
        """On the I/O thread, inside a running job (a restore, between its layer groups): run the
        queued write now if it moves at most `max_bytes` (IoSchedule.take_fitting); the bytes it
        moved, 0 if none fitted. Its time counts in the enclosing job's run time too."""
        with self._condition:
            job = self.schedule.take_fitting(max_bytes)
        if job is None:
            return 0
        self._execute(job)
        return job.nbytes

    def run_within(self, budget: int) -> None:
        """run_fitting for as long as the queued writes fit what is left of `budget` bytes."""
        while budget > 0 and (moved := self.run_fitting(budget)):
            budget -= moved

    def yield_to_reads(self) -> bool:
        """For a write job of several chunks, between them (I/O thread): stop here, because reads
        are under way (IoSchedule.reads_active), or because this write runs inside a read's slack
        and must stay small. Otherwise the job keeps the drive fed, chunk after chunk."""
        if self._reading:
            return True
        with self._condition:
            return self.schedule.reads_active(self._clock())

    def _execute(self, job: IoJob) -> None:
        """Run one job on this thread, count it, and hand its outcome to its caller."""
        work: _Work = job.payload
        if not work.future.set_running_or_notify_cancel():
            return
        started = self._clock()
        error: BaseException | None = None
        result = None
        outer = self._reading
        self._reading = outer or job.io_class in READS
        if job.io_class in READS:
            self._read_running = job.nbytes
        try:
            result = work.function(*work.args)
        except BaseException as caught:  # handed to the awaiting caller
            error = caught
        finally:
            self._reading = outer
            if job.io_class in READS:
                self._read_running = 0
        finished = self._clock()
        with self._condition:
            self.schedule.job_done(job.io_class, finished - started)
            if job.io_class in READS:
                self.schedule.read_done(finished)
        # Counted before the caller learns the outcome, so whoever
        # reads the metrics after a job sees it.
        class_name = job.io_class.name.lower()
        times = self.stats.by_class[class_name]
        waited = started - work.queued_at
        times.jobs += 1
        times.wait_seconds += waited
        times.max_wait_seconds = max(times.max_wait_seconds, waited)
        times.run_seconds += finished - started
        if job.io_class in READS and error is None:
            self.read_rate.add(job.nbytes, finished - started, finished)
        if self.on_job is not None:
            self.on_job(class_name, waited, finished - started)
        if error is not None:
            work.future.set_exception(error)
            del error  # no reference cycle through the traceback
        else:
            work.future.set_result(result)

    def shutdown(self, wait: bool = True) -> None:
        """Run what is queued, then stop the thread."""
        with self._condition:
            self._closed = True
            self._condition.notify()
        if wait:
            self._thread.join()
