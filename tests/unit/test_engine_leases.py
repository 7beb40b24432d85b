"""The engine's leases: get and acquire, release, renew and expiry, and block
handles leaked or owned by leases (helpers: tests/unit/engine_helpers.py)."""

from __future__ import annotations

import gc
import sys
import warnings

import pytest

from kvd.core.block import BlockState
from kvd.core.lease import LeaseKind
from kvd.errors import InvalidArgument, NotFound, PermissionDenied, ResourceExhausted
from kvd.invariants import InvariantError
from kvd.testing import engine_ops
from kvd.core.requests import CommitRequest, KeysRequest
from tests.unit.engine_helpers import LONG, E, K, block, k, policy_order, put, rejected, stored


# ----------------------------------------------------------------------
# Get, acquire


def test_get_pins_the_stored_prefix(env):
    engine, ns = env
    put(engine, ns, "abc")
    lease, matched = engine_ops.get(engine, KeysRequest(ns, "reader", K("abcd"), 500, 10))
    assert [b.key for b in matched] == K("abc")
    assert lease.kind == LeaseKind.READ and lease.deadline_ms == 510
    assert [b.ref_count for b in matched] == [1, 1, 1]
    assert (engine.live_handles, engine.pinned_blocks) == (3, 3)
    assert policy_order(engine) == []
    state = engine.namespace(ns)
    assert (state.get_hits, state.get_misses) == (3, 1)
    # A second reader shares the blocks.
    second, _ = engine_ops.get(engine, KeysRequest(ns, "other", K("ab"), 500, 10))
    assert [b.ref_count for b in matched] == [2, 2, 1]
    assert engine.pinned_blocks == 3 and engine.live_handles == 5
    assert engine.release("reader", [lease.lease_id]) == 1
    assert [b.ref_count for b in matched] == [1, 1, 0]
    assert policy_order(engine) == [k("abc")]
    engine.release("other", [second.lease_id])
    assert (engine.live_handles, engine.pinned_blocks) == (0, 0)


def test_get_miss_opens_no_lease(env):
    engine, ns = env
    assert engine_ops.get(engine, KeysRequest(ns, "reader", K("ab"), LONG, 0)) == (None, [])
    assert len(engine.leases) == 0
    assert engine.namespace(ns).get_misses == 2


def test_lookup_counts_and_never_pins(env):
    engine, ns = env
    put(engine, ns, "ab")
    assert [b.key for b in engine.lookup(ns, K("abc"))] == K("ab")
    state = engine.namespace(ns)
    assert (state.lookup_hits, state.lookup_misses) == (2, 1)
    assert engine.pinned_blocks == 0


def test_lookup_and_get_from_a_parent_key(env):
    engine, ns = env
    put(engine, ns, "abcd")
    tail = K("abcd")[2:]
    assert [b.key for b in engine.lookup(ns, tail, k("ab"))] == tail
    # The continuation must hang under that parent, not just be stored.
    assert engine.lookup(ns, tail, k("a")) == []
    assert engine.lookup(ns, tail) == []
    # An unknown parent matches nothing (it may have been evicted).
    assert engine.lookup(ns, tail, k("zz")) == []
    lease, matched = engine_ops.get(engine, KeysRequest(ns, "r", tail, LONG, 0, parent_key=k("ab")))
    assert [b.key for b in matched] == tail and [h.key for h in lease.handles] == tail
    assert block(engine, ns, "ab").ref_count == 0  # only the matched blocks are pinned
    assert engine_ops.get(engine, KeysRequest(ns, "r", tail, LONG, 0, parent_key=k("zz"))) == (None, [])
    rejected(engine, InvalidArgument, "lookup", ns, tail, b"x" * 5, match="parent_key")
    rejected(engine, InvalidArgument, "begin_get", KeysRequest(ns, "r", tail, LONG, 0, parent_key=b"x" * 5),
             match="parent_key")
    engine.release("r", [lease.lease_id])
    # A parent still being written matches nothing.
    result = engine.reserve(KeysRequest(ns, "w", K("abcdef")[4:], LONG, 0, parent_key=k("abcd")))
    assert engine.lookup(ns, K("abcdef")[5:], k("abcde")) == []
    engine.release("w", [result.lease.lease_id])


def test_acquire_handles(env):
    engine, ns = env
    put(engine, ns, "ab")
    handles = engine_ops.acquire(engine, ns, K("abc"))
    assert [h.key for h in handles] == K("ab")
    assert engine.live_handles == 2
    with handles[1] as handle:
        assert handle.block.ref_count == 1 and not handle.writable
    assert handles[1].released
    handles[1].release()  # idempotent
    assert engine.live_handles == 1
    with pytest.raises(InvariantError):
        _ = handles[1].block
    handles[0].release()
    engine.verify()
    assert (engine.live_handles, engine.pinned_blocks) == (0, 0)


# ----------------------------------------------------------------------
# Release, renew, expiry


def test_release_of_a_write_lease_aborts_unsealed_blocks(writing):
    engine, ns, lease_id = writing
    engine.commit(CommitRequest(ns, "writer", lease_id, 0, keys=[k("a")]))
    assert engine.release("writer", [lease_id]) == 1
    assert stored(engine, ns) == {k("a")}
    assert engine.host.counters.aborted == 3
    assert policy_order(engine) == [k("a")]
    rejected(engine, NotFound, "release", "writer", [lease_id])


def test_release_is_all_or_nothing(env):
    engine, ns = env
    put(engine, ns, "ab")
    mine, _ = engine_ops.get(engine, KeysRequest(ns, "me", K("ab"), LONG, 0))
    theirs, _ = engine_ops.get(engine, KeysRequest(ns, "them", K("a"), LONG, 0))
    rejected(engine, PermissionDenied, "release", "me", [mine.lease_id, theirs.lease_id])
    rejected(engine, NotFound, "release", "me", [mine.lease_id, 999])
    rejected(engine, InvalidArgument, "release", "me", [mine.lease_id, mine.lease_id], match="duplicates")
    rejected(engine, InvalidArgument, "release", "", [mine.lease_id], match="client_id")
    rejected(engine, InvalidArgument, "release", "x" * 257, [mine.lease_id], match="client_id")
    assert engine.release("me", []) == 0
    assert engine.close_all_leases() == 2
    assert (engine.live_handles, engine.pinned_blocks) == (0, 0)


def test_expiry_aborts_writable_blocks_and_drops_read_pins(env):
    engine, ns = env
    put(engine, ns, "xy")
    write = engine.reserve(KeysRequest(ns, "writer", K("abc"), 100, 0))
    engine.commit(CommitRequest(ns, "writer", write.lease.lease_id, 50, keys=[k("a")]))
    read, _ = engine_ops.get(engine, KeysRequest(ns, "reader", K("xy"), 100, 20))  # deadline 120
    assert engine.pinned_blocks == 5
    assert engine.expire(99) == 0
    with pytest.raises(NotFound):
        engine.commit(CommitRequest(ns, "writer", write.lease.lease_id, 100))
    assert len(engine.leases) == 1
    assert stored(engine, ns) == set(K("xy") + [k("a")])
    assert engine.host.pool.resident_blocks == 3 and engine.host.counters.aborted == 2
    assert block(engine, ns, "a").ref_count == 0
    assert engine.pinned_blocks == 2
    assert engine.expire(119) == 0
    assert engine.expire(120) == 1
    assert engine.leases.expired_total == 2
    assert (engine.live_handles, engine.pinned_blocks) == (0, 0)
    assert policy_order(engine) == [k("a"), k("xy")]
    rejected(engine, NotFound, "release", "reader", [read.lease_id])
    rejected(engine, NotFound, "renew", "reader", read.lease_id, LONG, 200)


def test_a_held_lease_outlives_its_end_until_the_last_hold_goes(env):
    """SaveLayers and LoadLayers hold their lease while a copy runs into or out of its slots: an
    expiry, a release or the drain meanwhile ends it for the client at once (NOT_FOUND) but frees
    no slot until unhold; a second hold keeps it one step longer."""
    engine, ns = env
    put(engine, ns, "xy")
    write = engine.reserve(KeysRequest(ns, "writer", K("abc"), 100, 0))  # deadline 100
    read, _ = engine_ops.get(engine, KeysRequest(ns, "reader", K("xy"), 100, 0))
    writable = [handle.block for handle in write.lease.handles]
    slots = [engine.host_slot(b) for b in writable]
    engine.leases.hold(write.lease)
    engine.leases.hold(read)
    engine.leases.hold(read)
    assert engine.expire(100) == 2
    # Gone for the client, not for the copies.
    rejected(engine, NotFound, "commit", CommitRequest(ns, "writer", write.lease.lease_id, 100))
    rejected(engine, NotFound, "release", "reader", [read.lease_id])
    assert [b.state for b in writable] == [BlockState.WRITABLE] * 3
    assert [engine.host_slot(b) for b in writable] == slots and engine.pinned_blocks == 5
    assert engine.close_all_leases() == 0  # the drain ends nothing a copy still holds
    engine.leases.unhold(write.lease)
    assert write.lease.ended and engine.host.counters.aborted == 3 and engine.pinned_blocks == 2
    engine.leases.unhold(read)
    assert not read.ended and engine.pinned_blocks == 2
    engine.leases.unhold(read)
    assert read.ended and (engine.live_handles, engine.pinned_blocks, len(engine.leases)) == (0, 0, 0)
    assert engine.leases.expired_total == 2
    with pytest.raises(InvariantError):
        engine.leases.unhold(read)


def test_a_lease_released_while_held_ends_at_unhold_and_cannot_be_held_again(env):
    engine, ns = env
    put(engine, ns, "ab")
    lease, _ = engine_ops.get(engine, KeysRequest(ns, "r", K("ab"), LONG, 0))
    engine.leases.hold(lease)
    assert engine.release("r", [lease.lease_id]) == 1
    assert not lease.ended and engine.pinned_blocks == 2
    with pytest.raises(InvariantError):
        engine.leases.hold(lease)
    engine.leases.unhold(lease)
    assert lease.ended and engine.pinned_blocks == 0


def test_every_call_with_now_expires_first(env):
    engine, ns = env
    put(engine, ns, "ab")
    for call in (
        lambda now: engine_ops.get(engine, KeysRequest(ns, "r", K("a"), 0, now)),
        lambda now: engine.reserve(KeysRequest(ns, "r", K("ab"), 0, now)),
        lambda now: engine.renew("r", 12345, 0, now),
    ):
        lease, _ = engine_ops.get(engine, KeysRequest(ns, "reader", K("ab"), 10, 0))
        try:
            call(10)
        except NotFound:
            pass
        assert all(l.lease_id != lease.lease_id for l in engine.leases)
        engine.close_all_leases()


def test_renew_extends_the_deadline(env):
    engine, ns = env
    put(engine, ns, "ab")
    lease, _ = engine_ops.get(engine, KeysRequest(ns, "reader", K("ab"), 100, 0))
    assert engine.renew("reader", lease.lease_id, 100, 50) == 150
    assert engine.expire(100) == 0  # the old deadline is stale
    assert engine_ops.next_deadline_ms(engine.leases) == 150
    assert engine.expire(150) == 1
    assert engine_ops.next_deadline_ms(engine.leases) is None


def test_lease_ms_bounds(make):
    engine, ns = make(lease_ms_default=1_000, lease_ms_max=LONG)
    put(engine, ns, "a")
    lease, _ = engine_ops.get(engine, KeysRequest(ns, "r", K("a"), 0, 100))
    assert lease.deadline_ms == 1_100  # 0 means the default
    lease, _ = engine_ops.get(engine, KeysRequest(ns, "r", K("a"), LONG, 100))
    assert lease.deadline_ms == LONG + 100  # the maximum is inclusive
    assert engine.renew("r", lease.lease_id, 0, 200) == 1_200
    for bad in (-1, LONG + 1, 10**9):
        rejected(engine, InvalidArgument, "begin_get", KeysRequest(ns, "r", K("a"), bad, 100), match="lease_ms")
        rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "r", K("ab"), bad, 100), match="lease_ms")
        rejected(engine, InvalidArgument, "renew", "r", lease.lease_id, bad, 100, match="lease_ms")
    engine.close_all_leases()


def test_lease_table_full(make):
    engine, ns = make(max_leases=1)
    put(engine, ns, "ab")
    put(engine, ns, "xy")
    held, _ = engine_ops.get(engine, KeysRequest(ns, "r", K("a"), LONG, 0))
    assert policy_order(engine) == [k("ab"), k("xy")]
    rejected(engine, ResourceExhausted, "reserve", KeysRequest(ns, "w", K("pq"), LONG, 0), match="leases")
    # Regression: the refused reserve used to touch the stored prefix first.
    rejected(engine, ResourceExhausted, "reserve", KeysRequest(ns, "w", K("abc"), LONG, 0), match="leases")
    # Needing no lease, a reserve of a stored chain still works.
    assert engine.reserve(KeysRequest(ns, "w", K("ab"), LONG, 0)).statuses == [E, E]
    # A get refused for lack of lease room changes nothing, counters included.
    rejected(engine, ResourceExhausted, "begin_get", KeysRequest(ns, "r", K("ab"), LONG, 0), match="leases")
    assert [b.ref_count for b in engine.lookup(ns, K("ab"))] == [1, 0]
    engine.release("r", [held.lease_id])


def test_batch_and_client_limits(make):
    engine, ns = make(max_batch_keys=2)
    rejected(engine, InvalidArgument, "lookup", ns, K("abc"), match="at most 2")
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "w", K("abc"), LONG, 0), match="at most 2")
    rejected(engine, InvalidArgument, "delete", ns, K("abc"))
    rejected(engine, InvalidArgument, "release", "w", [1, 2, 3])
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "", K("ab"), LONG, 0), match="client_id")
    rejected(engine, InvalidArgument, "begin_get", KeysRequest(ns, "", K("ab"), LONG, 0), match="client_id")
    rejected(engine, InvalidArgument, "lookup", ns, [k("a"), b"x" * 33], match=r"keys\[1\] is 33 bytes")


# ----------------------------------------------------------------------
# Leaked handles


@pytest.mark.allow_leaked_handles
def test_a_dropped_handle_is_counted_warned_and_released(env):
    engine, ns = env
    put(engine, ns, "ab")
    handles = engine_ops.acquire(engine, ns, K("ab"))
    handles[0].release()
    with pytest.warns(ResourceWarning, match="leaked block handle"):
        del handles[1]  # the last reference: finalized right here
    assert engine.leaked_handles == 1
    assert (engine.live_handles, engine.pinned_blocks) == (0, 0)
    assert policy_order(engine) == [k("ab")]
    engine.verify()


@pytest.mark.allow_leaked_handles
def test_a_leak_under_warnings_as_errors_still_releases(env, monkeypatch):
    # With the ResourceWarning an error, __del__ raises; the reference must
    # have been dropped before that, or the block would stay pinned forever.
    engine, ns = env
    put(engine, ns, "a")
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    handles = engine_ops.acquire(engine, ns, K("a"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        del handles[0]
        gc.collect()
    assert [type(u.exc_value) for u in unraisable] == [ResourceWarning]
    assert engine.leaked_handles == 1
    assert (engine.live_handles, engine.pinned_blocks) == (0, 0)
    engine.verify()


@pytest.mark.allow_leaked_handles
def test_a_dropped_writer_handle_aborts_its_block(env):
    engine, ns = env
    result = engine.reserve(KeysRequest(ns, "w", K("a"), LONG, 0))
    lease = result.lease
    engine.leases._leases.pop(lease.lease_id)  # forget the lease: its handle is now owned by nobody
    engine.leases.refund(lease, lease.pinned)  # and charge its client nothing for it
    with pytest.warns(ResourceWarning):
        lease.handles.clear()
    assert engine.leaked_handles == 1
    assert stored(engine, ns) == set()
    assert engine.host.counters.aborted == 1


def test_leases_own_their_handles_so_closing_is_not_a_leak(env):
    engine, ns = env
    put(engine, ns, "abc")
    engine_ops.get(engine, KeysRequest(ns, "r", K("abc"), LONG, 0))
    engine.reserve(KeysRequest(ns, "w", K("abcd"), LONG, 0))
    assert engine.close_all_leases() == 2
    gc.collect()
    assert engine.leaked_handles == 0
    assert (engine.live_handles, engine.pinned_blocks) == (0, 0)
    assert stored(engine, ns) == set(K("abc"))
