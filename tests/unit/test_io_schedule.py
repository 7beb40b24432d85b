"""The disk job schedule: urgency order, writes in the gaps, the bounded share, FIFO."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.planner.io_schedule import READS_ACTIVE_S, IoClass, IoJob, IoSchedule
from kvd.invariants import InvariantError
from kvd.planes.io_executor import ScheduledExecutor

R, P, W, C = IoClass.RESTORE, IoClass.PREFETCH, IoClass.WRITE, IoClass.CONTROL


def fill(schedule: IoSchedule, classes: list[IoClass]) -> None:
    for index, io_class in enumerate(classes):
        schedule.push(IoJob(io_class, payload=index))


def drain(schedule: IoSchedule, backlog: int = 0) -> list[tuple[IoClass, int]]:
    order = []
    while (job := schedule.pop(backlog)) is not None:
        order.append((job.io_class, job.payload))
    return order


def test_slack_runs_control_then_restores_then_prefetches_then_writes():
    schedule = IoSchedule("slack")
    fill(schedule, [W, P, R, W, C, R, P])
    assert drain(schedule) == [(C, 4), (R, 2), (R, 5), (P, 1), (P, 6), (W, 0), (W, 3)]
    assert schedule.counters.deferred_writes == 4 and schedule.counters.forced_writes == 0
    assert schedule.counters.dispatched == {"control": 1, "restore": 2, "prefetch": 2, "write": 2}


def test_fifo_keeps_arrival_order_except_control():
    schedule = IoSchedule("fifo")
    fill(schedule, [W, P, R, W, C, R])
    assert drain(schedule) == [(C, 4), (W, 0), (P, 1), (R, 2), (W, 3), (R, 5)]


def run_all(schedule: IoSchedule, backlog: int, seconds: dict[IoClass, float]) -> list[IoClass]:
    """Pop and 'run' every job, reporting each class's run time as job_done."""
    order = []
    while (job := schedule.pop(backlog)) is not None:
        order.append(job.io_class)
        schedule.job_done(job.io_class, seconds[job.io_class])
    return order


def test_a_full_backlog_gives_writes_a_share_of_the_drive_time():
    """write_share 4: each second of reads earns a quarter second of writes
    while reads wait; a write may go once the credit is positive and costs
    what it ran. Reads of 0.1 s and writes of 0.05 s: a write after every
    two reads; writes of 0.1 s: one after every four."""
    schedule = IoSchedule("slack", write_share=4, backlog_limit=10)
    fill(schedule, [W] * 3 + [R] * 6)
    assert run_all(schedule, 10, {R: 0.1, W: 0.05}) == [R, W, R, R, W, R, R, W, R]
    schedule = IoSchedule("slack", write_share=4, backlog_limit=10)
    fill(schedule, [W] * 2 + [R] * 8)
    assert run_all(schedule, 10, {R: 0.1, W: 0.1}) == [R, W, R, R, R, R, W, R, R, R]
    assert schedule.counters.forced_writes == 2
    # Below the bound, reads always go first, and nothing is saved up for later.
    schedule = IoSchedule("slack", write_share=4, backlog_limit=10)
    fill(schedule, [W] * 3 + [R] * 9)
    assert run_all(schedule, 9, {R: 0.1, W: 0.05}) == [R] * 9 + [W] * 3


def test_bad_settings_are_refused():
    with pytest.raises(InvariantError):
        IoSchedule("lifo")
    with pytest.raises(InvariantError):
        IoSchedule("slack", write_share=0)
    schedule = IoSchedule()
    job = schedule.push(IoJob(R))
    with pytest.raises(InvariantError):
        schedule.push(job)


@settings(max_examples=200, deadline=None)
@given(
    mode=st.sampled_from(["slack", "fifo"]),
    steps=st.lists(st.one_of(st.sampled_from(list(IoClass)), st.integers(0, 20)), max_size=60),
    write_share=st.integers(1, 4),
)
def test_every_job_runs_exactly_once_and_within_a_class_in_arrival_order(mode, steps, write_share):
    """Pushes (a class) and pops (an int: the backlog) interleaved at random."""
    schedule = IoSchedule(mode, write_share=write_share, backlog_limit=10)
    pushed, popped = [], []
    for step in steps:
        if isinstance(step, IoClass):
            pushed.append(schedule.push(IoJob(step, payload=len(pushed))))
        else:
            job = schedule.pop(step)
            if job is not None:
                popped.append(job)
                if mode == "slack" and job.io_class == IoClass.WRITE and step < 10:
                    # Below the bound a write runs only when no read waits.
                    assert schedule.queued(R) == schedule.queued(P) == 0
    popped += [job for job in iter(lambda: schedule.pop(0), None)]
    assert sorted(job.payload for job in popped) == list(range(len(pushed)))
    for io_class in IoClass:
        sequence = [job.sequence for job in popped if job.io_class == io_class]
        assert sequence == sorted(sequence)
    assert len(schedule) == 0


def test_the_executor_runs_jobs_in_schedule_order_on_one_thread():
    executor = ScheduledExecutor(IoSchedule("slack"))
    gate = threading.Event()
    ran: list[str] = []
    threads: set[int] = set()

    running = threading.Event()

    def job(name: str) -> str:
        threads.add(threading.get_ident())
        if name == "first":
            running.set()
            gate.wait(10)
        ran.append(name)
        return name

    first = executor.submit(W, job, "first")  # holds the thread while the rest queue up
    assert running.wait(10)
    futures = [executor.submit(io_class, job, name) for io_class, name in
               [(W, "write"), (P, "prefetch"), (R, "restore"), (C, "control")]]
    assert executor.queued() == {"control": 1, "restore": 1, "prefetch": 1, "write": 1}
    gate.set()
    assert [f.result(10) for f in [first, *futures]] == ["first", "write", "prefetch", "restore", "control"]
    assert ran == ["first", "control", "restore", "prefetch", "write"]
    assert len(threads) == 1
    failing = executor.submit(R, lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(10)
    executor.shutdown()
    assert executor.stats.by_class["restore"].jobs == 2
    with pytest.raises(RuntimeError):
        executor.submit(R, job, "late")


def test_a_new_read_is_priced_behind_the_read_running_and_those_queued():
    """queued_read_bytes (what Lookup(load_times) puts ahead of a disk hit): the running restore
    counts whole until it ends, queued reads count, writes do not."""
    executor = ScheduledExecutor(IoSchedule("slack"))
    gate, running = threading.Event(), threading.Event()

    def held() -> None:
        running.set()
        gate.wait(10)

    first = executor.submit(R, held, nbytes=3 << 20)
    assert running.wait(10)
    queued = [executor.submit(P, lambda: None, nbytes=1 << 20), executor.submit(W, lambda: None, nbytes=8 << 20)]
    assert executor.queued_read_bytes() == 4 << 20
    gate.set()
    for future in (first, *queued):
        future.result(10)
    assert executor.queued_read_bytes() == 0
    executor.shutdown()


def test_a_write_waits_briefly_after_a_read_for_another_read():
    """Anticipation: within anticipation_s of a read's end a write is held
    back (unless the backlog is full); after that, or with a read queued
    meanwhile, the schedule goes on as before."""
    schedule = IoSchedule("slack", backlog_limit=10, anticipation_s=0.002)
    fill(schedule, [W])
    schedule.read_done(1.000)
    assert schedule.pop(0, now=1.001) is None and schedule.write_hold_until == pytest.approx(1.002)
    schedule.push(IoJob(R, payload="late read"))
    assert schedule.pop(0, now=1.0015).payload == "late read"  # the read that came in the hold
    schedule.read_done(1.010)
    assert schedule.pop(10, now=1.011).io_class == W  # a full backlog does not wait
    fill(schedule, [W])
    schedule.read_done(1.020)
    assert schedule.pop(0, now=1.0225).io_class == W and schedule.write_hold_until is None
    assert len(schedule) == 0
    # fifo never holds anything back.
    fifo = IoSchedule("fifo", anticipation_s=0.002)
    fill(fifo, [W])
    fifo.read_done(1.0)
    assert fifo.pop(0, now=1.0).io_class == W


def test_the_executor_holds_a_write_for_a_read_that_follows():
    """On an injected clock that stands still, a write submitted just after
    a read is held, a read that follows runs first, and the write runs once
    the clock passes the hold."""
    now = [1.0]
    executor = ScheduledExecutor(IoSchedule("slack", anticipation_s=0.2), clock=lambda: now[0])
    ran: list[str] = []
    executor.submit(R, ran.append, "read 1").result(10)
    write = executor.submit(W, ran.append, "write")
    read = executor.submit(R, ran.append, "read 2")
    read.result(10)
    assert not write.done() and ran == ["read 1", "read 2"]  # held: still within 0.2 s of a read
    now[0] = 2.0
    write.result(10)
    executor.shutdown()
    assert ran == ["read 1", "read 2", "write"]


def test_a_write_that_fits_is_taken_out_for_a_restores_slack_and_only_under_slack():
    schedule = IoSchedule("slack")
    schedule.push(IoJob(W, payload="big", nbytes=8 << 20))
    schedule.push(IoJob(W, payload="small", nbytes=1 << 20))
    assert schedule.take_fitting(4 << 20) is None  # the next write (in order) does not fit
    assert schedule.take_fitting(8 << 20).payload == "big"
    assert schedule.take_fitting(1 << 20).payload == "small"
    assert schedule.take_fitting(1 << 30) is None and len(schedule) == 0
    assert schedule.counters.slack_writes == 2 and schedule.counters.dispatched["write"] == 2
    fifo = IoSchedule("fifo")
    fifo.push(IoJob(W, nbytes=1))
    assert fifo.take_fitting(1 << 30) is None


def test_the_executor_runs_a_fitting_write_inside_the_job_that_asks():
    """A restore running on the I/O thread runs a queued write between its layer groups: the write's
    caller gets its result before the restore ends, on the same thread; a write too big stays queued."""
    executor = ScheduledExecutor(IoSchedule("slack"))
    queued = threading.Event()
    ran: list[str] = []
    threads: set[int] = set()

    def restore() -> int:
        threads.add(threading.get_ident())
        assert queued.wait(10)
        ran.append("restore, group 1")
        moved = executor.run_fitting(4 << 20) + executor.run_fitting(4 << 20)
        ran.append("restore, group 2")
        return moved

    def write(name: str) -> str:
        threads.add(threading.get_ident())
        ran.append(name)
        return name

    reading = executor.submit(R, restore)
    small = executor.submit(W, write, "small write", nbytes=1 << 20)
    big = executor.submit(W, write, "big write", nbytes=64 << 20)
    queued.set()
    assert reading.result(10) == 1 << 20
    assert small.result(10) == "small write" and big.result(10) == "big write"
    executor.shutdown()
    assert ran == ["restore, group 1", "small write", "restore, group 2", "big write"] and len(threads) == 1
    assert executor.schedule.counters.slack_writes == 1 and executor.stats.by_class["write"].jobs == 2


@pytest.mark.parametrize("mode", ["slack", "fifo"])
def test_a_long_write_yields_to_a_queued_read_and_stays_small_inside_one(mode):
    """yield_to_reads, asked by a write job between its chunks: yes once a restore is queued (slack
    only: fifo keeps arrival order), and always while the write runs inside a read's slack."""
    executor = ScheduledExecutor(IoSchedule(mode))
    started, release = threading.Event(), threading.Event()
    answers: list[tuple[str, bool]] = []

    def long_write() -> None:
        started.set()
        answers.append(("alone", executor.yield_to_reads()))
        assert release.wait(10)
        answers.append(("read queued", executor.yield_to_reads()))

    def nested_write() -> None:
        answers.append(("inside a read", executor.yield_to_reads()))

    def restore() -> None:
        executor.run_fitting(1 << 20)
        answers.append(("the read itself", executor.yield_to_reads()))

    writing = executor.submit(W, long_write)
    assert started.wait(10)
    reading = executor.submit(R, restore)
    nested = executor.submit(W, nested_write, nbytes=1 << 10)
    release.set()
    writing.result(10), reading.result(10), nested.result(10)
    executor.shutdown()
    expected = [("alone", False), ("read queued", mode == "slack")]
    if mode == "slack":  # the small write runs inside the restore's slack
        expected += [("inside a read", True), ("the read itself", True)]
    else:
        expected += [("the read itself", True), ("inside a read", False)]
    assert answers == expected


def test_reads_count_as_under_way_for_a_while_after_the_last_one():
    slack, fifo = IoSchedule("slack"), IoSchedule("fifo")
    assert not slack.reads_active(10.0)
    for schedule in (slack, fifo):
        schedule.read_done(10.0)
    assert slack.reads_active(10.0 + READS_ACTIVE_S / 2) and not fifo.reads_active(10.0 + READS_ACTIVE_S / 2)
    assert not slack.reads_active(10.0 + READS_ACTIVE_S)  # a drive serving writes only
    slack.push(IoJob(IoClass.PREFETCH, "queued"))
    assert slack.reads_active(100.0)
