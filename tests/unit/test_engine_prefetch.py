"""Prefetch in the engine and the I/O schedule: reads ahead of a Get, no lease.

Same fake data plane as tests/unit/test_engine_disk.py: a string names a
chain of one-token blocks, and `Plane` moves fake contents between host and
disk slots as the daemon moves bytes, so every test can check that what a
Get serves is the block that was Put under its key.
"""

from __future__ import annotations

import contextlib
import random

import pytest

from kvd.core.block import NO_SLOT, BlockState
from kvd.core.engine import Engine, PrefetchLimit, TierId
from kvd.planner.io_schedule import IoClass, IoJob, IoSchedule
from kvd.errors import InvalidArgument, NotFound, ResourceExhausted
from kvd.core.requests import CommitRequest, KeysRequest
from kvd.testing import engine_ops
from tests.unit.test_engine_disk import LONG, SPEC, K, Plane, k, tiers

BOUND = 256


@pytest.fixture
def plane(engine_factory) -> Plane:
    """4 host slots, 16 disk slots; "abcd" only on disk, "wxyz" in host memory and on disk."""
    plane = Plane(engine_factory(4, 64, disk_slot_count=16, disk_slot_bytes=64))
    plane.put("abcd")
    plane.flush()
    plane.put("wxyz")
    plane.flush()
    assert tiers(plane, "abcd") == [TierId.DISK] * 4
    return plane


def prefetch(plane: Plane, chain: str, bound: int = BOUND, parent_key: bytes = b""):
    return plane.engine.begin_prefetch(plane.ns, K(chain), parent_key, bound)


def finish(plane: Plane, loads, corrupt: set[int] = frozenset()) -> None:
    plane.engine.finish_prefetch(loads, plane.load(loads, corrupt))
    plane.journal_removals()


def test_prefetch_reads_disk_only_blocks_unpinned_and_a_get_then_uses_them(plane):
    engine = plane.engine
    plan = prefetch(plane, "abcdef")
    assert [load.block.key for load in plan.loads] == K("abcd")
    assert (plan.matched, plan.missing, plan.in_host, plan.loading, plan.refused) == (4, 2, 0, 0, 0)
    assert plan.limit == PrefetchLimit.NONE
    # Not servable before the reads are verified: Lookup still says disk.
    assert tiers(plane, "abcd") == [TierId.DISK] * 4
    assert engine.prefetch_in_flight == 4 and engine.pinned_blocks == 4
    engine.verify()
    finish(plane, plan.loads)
    engine.verify()
    assert tiers(plane, "abcd") == [TierId.HOST] * 4
    # Unpinned once read: ordinary eviction candidates, no lease, no handle.
    assert engine.prefetch_in_flight == 0 and engine.pinned_blocks == 0 and engine.live_handles == 0
    assert len(engine.leases) == 0
    counters = engine.prefetch_counters
    assert (counters.queued, counters.missing, counters.used, counters.wasted) == (4, 2, 0, 0)
    # The Get reads nothing from disk and counts the blocks as used.
    get = engine.begin_get(KeysRequest(plane.ns, "r", K("abcd"), LONG, 0))
    assert not get.loads and not get.waits
    assert plane.served(engine.settle_get(get)) == K("abcd")
    engine.release("r", [get.lease.lease_id])
    assert (counters.used, counters.wasted) == (4, 0)
    # Used once is enough: another Get counts nothing more.
    assert plane.get("abcd") == K("abcd")
    assert counters.used == 4 and not engine_ops.prefetched(engine)


def test_a_second_prefetch_of_blocks_in_host_memory_queues_nothing(plane):
    plan = prefetch(plane, "abcd")
    finish(plane, plan.loads)
    again = prefetch(plane, "abcd")
    assert not again.loads and again.in_host == 4
    assert plane.engine.prefetch_counters.in_host == 4


def test_prefetched_blocks_evicted_before_any_get_are_wasted(plane):
    engine = plane.engine
    plan = prefetch(plane, "ab")
    finish(plane, plan.loads)
    assert tiers(plane, "abcd") == [TierId.HOST] * 2 + [TierId.DISK] * 2
    plane.put("mnop")  # four new blocks push both out (demoted: they stay on disk)
    plane.flush()
    engine.verify()
    assert tiers(plane, "ab") == [TierId.DISK] * 2
    assert (engine.prefetch_counters.used, engine.prefetch_counters.wasted) == (0, 2)
    assert not engine_ops.prefetched(engine)
    # Deleting a prefetched block counts as wasted too.
    plan = prefetch(plane, "abcd")
    finish(plane, plan.loads)
    assert engine.delete(plane.ns, [k("a")]) == (4, 0)
    assert engine.prefetch_counters.wasted == 6 and not engine_ops.prefetched(engine)


def test_a_get_racing_a_prefetch_waits_for_its_reads_and_is_served_the_right_bytes(plane):
    engine = plane.engine
    plan = prefetch(plane, "abcd")
    get = engine.begin_get(KeysRequest(plane.ns, "r", K("abcd"), LONG, 0))
    # The Get reads nothing itself: it waits for the prefetch's reads.
    assert not get.loads and get.waits == engine.lookup(plane.ns, K("abcd"))
    assert engine.prefetch_counters.used == 4
    finish(plane, plan.loads)
    engine.verify()
    assert plane.served(engine.settle_get(get)) == K("abcd")
    engine.release("r", [get.lease.lease_id])
    assert engine.live_handles == 0 and engine.prefetch_counters.wasted == 0


def test_a_corrupt_prefetched_block_is_lost_never_served_and_wasted(plane):
    engine = plane.engine
    plan = prefetch(plane, "abcd")
    get = engine.begin_get(KeysRequest(plane.ns, "r", K("ab"), LONG, 0))  # waits for a and b
    corrupt_c = {plan.loads[2].source_slot}
    finish(plane, plan.loads, corrupt_c)
    engine.verify()
    assert plane.served(engine.settle_get(get)) == K("ab")
    engine.release("r", [get.lease.lease_id])
    # c and, chained under it, d are gone from every tier.
    assert engine.lookup(plane.ns, K("abcd")) == engine.lookup(plane.ns, K("ab"))
    assert engine.disk.counters.load_failures == 1
    counters = engine.prefetch_counters
    assert (counters.used, counters.wasted) == (2, 2)
    assert engine.live_handles == 0
    engine.verify()


def test_blocks_lost_while_their_read_is_in_flight_keep_their_slot_until_it_ends(plane):
    """A prefetch in two jobs: the first job's block a fails, which loses b,
    c and d too; c and d are still being read by the second job, so their
    host slots must stay theirs until it ends, or a Put could be given a
    slot the disk thread is about to overwrite."""
    engine = plane.engine
    plan = prefetch(plane, "abcd")
    first, second = plan.loads[:2], plan.loads[2:]
    slots = [load.target_slot for load in second]
    finish(plane, first, {first[0].source_slot})
    engine.verify()
    for load, slot in zip(second, slots):
        assert load.block.state == BlockState.LOST
        assert engine.host.pool.owners[slot] is load.block and slot not in engine.host.pool.free_slots
    assert engine.lookup(plane.ns, K("abcd")) == []
    # The second job then fails as a whole: its disk slots were removed
    # meanwhile (the daemon's tier refuses to read a slot without its block).
    engine.finish_prefetch(second, [False, False])
    engine.verify()
    assert all(engine.host.pool.owners[slot] is None for slot in slots)
    assert engine.live_handles == 0 and engine.prefetch_in_flight == 0
    assert engine.prefetch_counters.wasted == 4 and not engine_ops.prefetched(engine)


def test_two_gets_a_failed_read_of_one_keeps_the_other_gets_slot_until_its_read_ends(plane):
    """The same hazard between two Gets: r1 reads a, r2 waits for a and reads b."""
    engine = plane.engine
    first = engine.begin_get(KeysRequest(plane.ns, "r1", K("a"), LONG, 0))
    second = engine.begin_get(KeysRequest(plane.ns, "r2", K("ab"), LONG, 0))
    assert [load.block.key for load in first.loads] == K("a")
    assert [load.block.key for load in second.loads] == [k("ab")] and second.waits == first.matched
    b_slot = second.loads[0].target_slot
    engine.finish_loads(first.loads, plane.load(first.loads, {first.loads[0].source_slot}))
    engine.verify()
    assert engine.host.pool.owners[b_slot] is second.loads[0].block
    engine.finish_loads(second.loads, plane.load(second.loads))
    assert engine.host.pool.owners[b_slot] is None
    assert engine.settle_get(first) == [] and engine.settle_get(second) == []
    engine.verify()
    assert engine.live_handles == 0


def test_the_in_flight_bound_truncates_and_says_so(plane):
    engine = plane.engine
    plan = prefetch(plane, "abcd", bound=2)
    assert [load.block.key for load in plan.loads] == K("ab")
    assert plan.refused == 2 and plan.limit == PrefetchLimit.IN_FLIGHT
    # While those two are in flight, nothing more is queued.
    again = prefetch(plane, "abcd", bound=2)
    assert (again.loading, again.refused, len(again.loads), again.limit) == (2, 2, 0, PrefetchLimit.IN_FLIGHT)
    finish(plane, plan.loads)
    rest = prefetch(plane, "abcd", bound=2)
    assert [load.block.key for load in rest.loads] == K("abcd")[2:] and rest.in_host == 2
    finish(plane, rest.loads)
    assert tiers(plane, "abcd") == [TierId.HOST] * 4
    counters = engine.prefetch_counters
    assert (counters.queued, counters.refused, counters.loading, counters.in_host) == (4, 4, 2, 2)
    engine.verify()


def test_a_pinned_host_tier_refuses_prefetch(plane):
    engine = plane.engine
    lease = engine.begin_get(KeysRequest(plane.ns, "r", K("wxyz"), LONG, 0)).lease  # all 4 host slots pinned
    plan = prefetch(plane, "abcd")
    assert not plan.loads and plan.refused == 4 and plan.limit == PrefetchLimit.HOST_FULL
    assert tiers(plane, "abcd") == [TierId.DISK] * 4
    engine.release("r", [lease.lease_id])
    engine.verify()


def test_prefetch_demotes_to_make_room_but_never_drops_a_block_held_nowhere_else(engine_factory):
    plane = Plane(engine_factory(4, 64, disk_slot_count=16, disk_slot_bytes=64))
    engine = plane.engine
    plane.put("abcd")
    plane.flush()
    plane.put("wxyz")  # not written yet: the host tier is full of blocks only it holds
    plan = prefetch(plane, "abcd")
    assert not plan.loads and plan.refused == 4 and plan.limit == PrefetchLimit.HOST_FULL
    assert tiers(plane, "wxyz") == [TierId.HOST] * 4 and engine.host.counters.evictions == 4
    plane.flush()  # now on disk: their host copies may be demoted
    plan = prefetch(plane, "abcd")
    assert len(plan.loads) == 4
    finish(plane, plan.loads)
    assert tiers(plane, "wxyz") == [TierId.DISK] * 4 and tiers(plane, "abcd") == [TierId.HOST] * 4
    engine.verify()


def test_prefetch_never_evicts_a_block_of_its_own_prefix(plane):
    """a is in host memory and would be the next victim; prefetching "abcd"
    must evict wxyz's blocks instead."""
    engine = plane.engine
    assert plane.get("a") == K("a")
    plan = prefetch(plane, "abcd")
    assert plan.in_host == 1 and [load.block.key for load in plan.loads] == K("abcd")[1:]
    finish(plane, plan.loads)
    assert tiers(plane, "abcd") == [TierId.HOST] * 4
    engine.verify()


def test_abandoned_prefetch_loads_give_their_slots_back(plane):
    engine = plane.engine
    plan = prefetch(plane, "abcd")
    engine.abandon_prefetch(plan.loads)
    engine.verify()
    assert tiers(plane, "abcd") == [TierId.DISK] * 4
    assert engine.live_handles == 0 and engine.prefetch_in_flight == 0 and not engine.loading
    assert plane.get("abcd") == K("abcd")


def test_without_a_disk_tier_everything_stored_is_in_host_memory(engine_factory):
    engine: Engine = engine_factory(4, 64)
    ns = engine.register_namespace(SPEC).namespace_id
    result = engine.reserve(KeysRequest(ns, "w", K("ab"), LONG, 0))
    engine.commit(CommitRequest(ns, "w", result.lease.lease_id, 0))
    plan = engine.begin_prefetch(ns, K("abc"), b"", BOUND)
    assert (plan.matched, plan.in_host, plan.missing, len(plan.loads), plan.refused) == (2, 2, 1, 0, 0)


def test_bad_input_is_refused_before_anything_changes(plane):
    engine = plane.engine
    with pytest.raises(NotFound):
        engine.begin_prefetch(b"\x01" * 32, K("ab"), b"", BOUND)
    with pytest.raises(InvalidArgument, match="namespace_id"):
        engine.begin_prefetch(b"short", K("ab"), b"", BOUND)
    with pytest.raises(InvalidArgument, match=r"keys\[1\]"):
        engine.begin_prefetch(plane.ns, [k("a"), b"short"], b"", BOUND)
    with pytest.raises(InvalidArgument, match="parent_key"):
        engine.begin_prefetch(plane.ns, K("ab"), b"short", BOUND)
    assert engine.prefetch_in_flight == 0 and not engine.loading and engine.prefetch_counters.queued == 0
    assert tiers(plane, "abcd") == [TierId.DISK] * 4
    # An unknown parent matches nothing, as for Lookup.
    plan = engine.begin_prefetch(plane.ns, K("ab"), b"\x02" * 32, BOUND)
    assert plan.matched == 0 and plan.missing == 2
    engine.verify()


def test_a_prefetch_under_a_parent_key_reads_the_continuation(plane):
    plan = prefetch(plane, "cd", parent_key=b"")
    assert plan.matched == 0  # "c" as a root block is another chain
    plan = plane.engine.begin_prefetch(plane.ns, K("abcd")[2:], k("ab"), BOUND)
    assert [load.block.key for load in plan.loads] == K("abcd")[2:]
    finish(plane, plan.loads)
    assert tiers(plane, "abcd") == [TierId.DISK] * 2 + [TierId.HOST] * 2
    assert NO_SLOT not in [load.target_slot for load in plan.loads]


# ----------------------------------------------------------------------
# The I/O schedule: a prefetch a Get waits for becomes a restore


def test_a_promoted_prefetch_runs_with_the_restores():
    schedule = IoSchedule("slack")
    for index, io_class in enumerate([IoClass.PREFETCH, IoClass.PREFETCH, IoClass.RESTORE, IoClass.WRITE]):
        schedule.push(IoJob(io_class, payload=index))
    assert schedule.promote(lambda job: job.payload == 1, IoClass.RESTORE)
    assert not schedule.promote(lambda job: job.payload == 2, IoClass.RESTORE)  # urgent enough already
    order = []
    while (job := schedule.pop()) is not None:
        order.append((job.io_class, job.payload))
    assert order == [(IoClass.RESTORE, 2), (IoClass.RESTORE, 1), (IoClass.PREFETCH, 0), (IoClass.WRITE, 3)]
    assert schedule.counters.promoted == 1
    assert not schedule.promote(lambda job: True, IoClass.RESTORE)  # nothing queued


def test_fifo_promotes_nothing():
    schedule = IoSchedule("fifo")
    schedule.push(IoJob(IoClass.PREFETCH, payload=0))
    assert not schedule.promote(lambda job: True, IoClass.RESTORE)
    assert schedule.pop().io_class == IoClass.PREFETCH


# ----------------------------------------------------------------------
# Random interleavings: prefetches in jobs finishing in any order, Gets that
# wait for them, Puts that evict, corrupt reads, deletes


@pytest.mark.parametrize("seed", range(40))
def test_random_interleavings_never_serve_a_wrong_block(engine_factory, seed):
    rng = random.Random(seed)
    plane = Plane(engine_factory(6, 64, disk_slot_count=24, disk_slot_bytes=64))
    engine = plane.engine
    chains = ["abcdefgh", "abcxyz", "mnopq", "mnrs", "uvw"]
    jobs: list[list] = []  # prefetch jobs queued, not yet finished

    def finish_job(job) -> None:
        jobs.remove(job)
        corrupt = {load.source_slot for load in job if rng.random() < 0.1}
        # A job whose blocks were removed meanwhile fails as a whole (see above).
        if any(load.block.state != BlockState.SEALED for load in job):
            engine.finish_prefetch(job, [False] * len(job))
        else:
            finish(plane, job, corrupt)

    for _ in range(120):
        chain = rng.choice(chains)[: rng.randint(1, 8)]
        action = rng.random()
        if action < 0.25:
            with contextlib.suppress(ResourceExhausted):  # all host slots pinned by reads in flight
                plane.put(chain)
            plane.flush()
        elif action < 0.45:
            plan = prefetch(plane, chain, bound=rng.randint(1, 6))
            step = rng.randint(1, 3)
            jobs.extend(plan.loads[start:start + step] for start in range(0, len(plan.loads), step))
        elif action < 0.6 and jobs:
            finish_job(rng.choice(jobs))
        elif action < 0.9:
            get = engine.begin_get(KeysRequest(plane.ns, "r", K(chain), LONG, 0))
            engine.finish_loads(get.loads, plane.load(get.loads, {l.source_slot for l in get.loads if rng.random() < 0.1}))
            plane.journal_removals()
            while any(load.block in get.waits for job in jobs for load in job):
                finish_job(next(job for job in jobs if any(load.block in get.waits for load in job)))
            served = engine.settle_get(get)
            plane.check_served(served)
            assert [block.key for block in served] == K(chain)[: len(served)]
            if get.lease is not None:
                engine.release("r", [get.lease.lease_id])
        else:
            engine.delete(plane.ns, [k(chain)])
            plane.journal_removals()
        engine.verify()
    while jobs:
        finish_job(jobs[0])
    engine.verify()
    assert engine.prefetch_in_flight == 0 and not engine.loading and engine.live_handles == 0
