"""The engine (kvd.core.engine.Engine): namespaces, reserve and commit, and
keys presented under the wrong parent.

The engine's exact outcomes are checked across test_engine*.py by subject:
this module, test_engine_eviction.py (eviction order),
test_engine_commit_abort.py (commit errors and aborts),
test_engine_leases.py (get, acquire, release, renew, expiry, leaked handles)
and test_engine_delete.py. Their conventions and helpers are in
tests/unit/engine_helpers.py, the fixtures (make, env, writing) in
tests/unit/conftest.py."""

from __future__ import annotations

import dataclasses

from kvd.core.block import NO_SLOT, BlockState
from kvd.core.engine import TierId
from kvd.core.lease import LeaseKind
from kvd.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvd.testing import engine_ops
from kvd.testing.engine_snapshot import snapshot
from kvd.core.requests import CommitRequest, KeysRequest
from tests.unit.engine_helpers import (LONG, OTHER_SPEC, SLOT_BYTES, SPEC, E, F, K, N, R, block, k, policy_order, put,
    rejected)


# ----------------------------------------------------------------------
# Namespaces


def test_register_namespace_is_idempotent(env):
    engine, ns = env
    assert ns == SPEC.namespace_id()
    assert engine.register_namespace(SPEC) is engine.namespace(ns)
    other = engine.register_namespace(OTHER_SPEC)
    assert other.namespace_id != ns
    assert [s.namespace_id for s in engine.namespaces()] == [ns, other.namespace_id]
    assert engine.namespace(ns).block_bytes == SPEC.block_bytes


def test_register_namespace_limits(make):
    engine, _ = make(max_namespaces=2)
    too_big = dataclasses.replace(SPEC, head_dim=SLOT_BYTES)  # 2 * 64 * 2 bytes > slot
    rejected(engine, InvalidArgument, "register_namespace", too_big, match="slot")
    engine.register_namespace(OTHER_SPEC)
    rejected(engine, ResourceExhausted, "register_namespace", dataclasses.replace(SPEC, lora_id="third"))
    engine.register_namespace(SPEC)  # already registered: still fine when full


def test_unknown_or_malformed_namespace(env):
    engine, _ = env
    rejected(engine, NotFound, "lookup", OTHER_SPEC.namespace_id(), K("a"))
    rejected(engine, InvalidArgument, "lookup", b"short", K("a"), match="namespace_id")
    rejected(engine, NotFound, "reserve", KeysRequest(OTHER_SPEC.namespace_id(), "c", K("a"), LONG, 0))


# ----------------------------------------------------------------------
# Reserve and commit


def test_reserve_then_commit_a_fresh_chain(env):
    engine, ns = env
    result = engine.reserve(KeysRequest(ns, "writer", K("abc"), LONG, 0))
    assert result.statuses == [R, R, R]
    assert result.slots == [0, 1, 2]  # empty slots are handed out from 0
    lease = result.lease
    assert lease is not None and lease.kind == LeaseKind.WRITE and lease.client_id == "writer"
    assert lease.deadline_ms == LONG and lease.namespace_id == ns and lease.parent_handle is None
    assert [b.key for b in lease.blocks()] == K("abc")
    assert [block(engine, ns, c).state for c in ("a", "ab", "abc")] == [BlockState.WRITABLE] * 3
    # Writable blocks are not discoverable.
    assert engine.lookup(ns, K("abc")) == []
    assert engine_ops.get(engine, KeysRequest(ns, "reader", K("abc"), LONG, 0)) == (None, [])
    assert (engine.live_handles, engine.pinned_blocks, engine.host.pool.resident_blocks) == (3, 3, 3)
    assert engine.host.pool.used_bytes == 3 * SPEC.block_bytes
    assert engine.host.counters.reserved == 3
    assert policy_order(engine) == []

    assert engine.commit(CommitRequest(ns, "writer", lease.lease_id, 1))[:2] == (3, 0)
    assert len(engine.leases) == 0  # nothing left to write: the lease ends
    assert [b.key for b in engine.lookup(ns, K("abc"))] == K("abc")
    assert (engine.live_handles, engine.pinned_blocks) == (0, 0)
    assert engine.host.counters.sealed == 3
    # Only the leaf is an eviction candidate.
    assert policy_order(engine) == [k("abc")]
    assert engine.tier_of(block(engine, ns, "ab")) == TierId.HOST


def test_reserve_extends_a_stored_prefix(env):
    engine, ns = env
    put(engine, ns, "abc")
    result = engine.reserve(KeysRequest(ns, "writer", K("abcde"), LONG, 0))
    assert result.statuses == [E, E, E, R, R]
    assert result.slots == [NO_SLOT, NO_SLOT, NO_SLOT, 3, 4]
    # The prefix being extended is pinned so it cannot be evicted meanwhile.
    assert result.lease.parent_handle.key == k("abc")
    assert block(engine, ns, "abc").ref_count == 1
    assert policy_order(engine) == []
    assert engine.commit(CommitRequest(ns, "writer", result.lease.lease_id, 0))[:2] == (2, 0)
    assert block(engine, ns, "abc").ref_count == 0
    assert policy_order(engine) == [k("abcde")]
    assert [b.key for b in engine.lookup(ns, K("abcdef"))] == K("abcde")


def test_reserve_from_a_parent_key(env):
    engine, ns = env
    put(engine, ns, "ab")
    result = engine.reserve(KeysRequest(ns, "writer", K("abcd")[2:], LONG, 0, parent_key=k("ab")))
    assert result.statuses == [R, R]
    assert result.lease.parent_handle.key == k("ab")
    engine.commit(CommitRequest(ns, "writer", result.lease.lease_id, 0))
    assert block(engine, ns, "abc").parent is block(engine, ns, "ab")
    assert [b.key for b in engine.lookup(ns, K("abcd"))] == K("abcd")
    # A parent key with the whole rest of the chain already stored.
    result = engine.reserve(KeysRequest(ns, "writer", K("abcd")[2:], LONG, 0, parent_key=k("ab")))
    assert (result.lease, result.statuses) == (None, [E, E])


def test_the_chain_to_a_stored_key_runs_from_its_root(env):
    """What a Get continuing a local parent sends a peer's directory (issue 37): the whole chain."""
    engine, ns = env
    put(engine, ns, "abcd")
    assert engine.chain_to(ns, k("abc")) == K("abc")
    assert engine.chain_to(ns, k("a")) == K("a")
    assert engine.chain_to(ns, k("abz")) == []  # not stored here
    result = engine.reserve(KeysRequest(ns, "w", K("abcde")[4:], LONG, 0, parent_key=k("abcd")))
    assert engine.chain_to(ns, k("abcde")) == []  # reserved, not sealed: nothing to continue yet
    engine.release("w", [result.lease.lease_id])
    rejected(engine, InvalidArgument, "chain_to", ns, b"x" * 31, match="parent_key")


def test_reserve_parent_key_errors(env):
    engine, ns = env
    put(engine, ns, "a")
    rejected(engine, FailedPrecondition, "reserve", KeysRequest(ns, "w", K("zzz")[2:], LONG, 0, parent_key=k("zz")),
                                                                match="parent_key")
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "w", K("b"), LONG, 0, parent_key=b"x" * 31),
                                                             match="parent_key")
    # A writable block cannot be extended by anyone.
    result = engine.reserve(KeysRequest(ns, "w", K("ab"), LONG, 0))
    rejected(engine, FailedPrecondition, "reserve", KeysRequest(ns, "w", K("abc")[2:], LONG, 0, parent_key=k("ab")),
                                                                match="parent_key")
    engine.release("w", [result.lease.lease_id])


def test_reserve_of_a_stored_chain_opens_no_lease(env):
    engine, ns = env
    put(engine, ns, "ab")
    result = engine.reserve(KeysRequest(ns, "w", K("ab"), LONG, 0))
    assert (result.lease, result.statuses, result.slots) == (None, [E, E], [NO_SLOT, NO_SLOT])
    assert len(engine.leases) == 0
    result = engine.reserve(KeysRequest(ns, "w", [], LONG, 0))
    assert (result.lease, result.statuses, result.slots) == (None, [], [])


def test_in_flight_when_another_client_writes(env):
    engine, ns = env
    first = engine.reserve(KeysRequest(ns, "alice", K("abc"), LONG, 0))
    before = snapshot(engine.engine)
    second = engine.reserve(KeysRequest(ns, "bob", K("abcd"), LONG, 0))
    assert (second.lease, second.statuses, second.slots) == (None, [F, F, F, F], [NO_SLOT] * 4)
    assert snapshot(engine.engine) == before
    # Once the first block is sealed it exists; the walk stops at the next.
    engine.commit(CommitRequest(ns, "alice", first.lease.lease_id, 0, keys=[k("a")]))
    second = engine.reserve(KeysRequest(ns, "bob", K("abcd"), LONG, 0))
    assert (second.lease, second.statuses) == (None, [E, F, F, F])
    # The same client's own unfinished write is in flight too.
    again = engine.reserve(KeysRequest(ns, "alice", K("abc"), LONG, 0))
    assert again.statuses == [E, F, F]
    # A sibling branch is not blocked by the write in flight.
    sibling = engine.reserve(KeysRequest(ns, "bob", K("ax"), LONG, 0))
    assert sibling.statuses == [E, R]
    engine.release("bob", [sibling.lease.lease_id])
    engine.release("alice", [first.lease.lease_id])


def test_reserve_stops_with_no_space_when_everything_is_pinned(make):
    engine, ns = make(slots=4)
    result = engine.reserve(KeysRequest(ns, "w", K("abcdef"), LONG, 0))
    assert result.statuses == [R, R, R, R, N, N]
    assert result.slots == [0, 1, 2, 3, NO_SLOT, NO_SLOT]
    assert [b.key for b in result.lease.blocks()] == K("abcd")
    assert engine.commit(CommitRequest(ns, "w", result.lease.lease_id, 0))[:2] == (4, 0)
    assert engine.host.counters.evictions == 0


def test_full_pool_of_pinned_blocks_is_resource_exhausted(make):
    engine, ns = make(slots=6)
    put(engine, ns, "abc")
    put(engine, ns, "xyz")
    engine_ops.get(engine, KeysRequest(ns, "reader", K("abc"), LONG, 0))
    engine_ops.get(engine, KeysRequest(ns, "reader", K("xy"), LONG, 0))
    # The only candidate left, xyz, is the parent of the request: pinned for it.
    rejected(engine, ResourceExhausted, "reserve", KeysRequest(ns, "w", K("xyzuvw")[3:], LONG, 0,
                                                               parent_key=k("xyz")), match="full")
    engine_ops.get(engine, KeysRequest(ns, "reader", K("xyz"), LONG, 0))
    rejected(engine, ResourceExhausted, "reserve", KeysRequest(ns, "w", K("pq"), LONG, 0), match="full")
    engine.close_all_leases()


def test_full_pool_refusal_changes_nothing(make):
    engine, ns = make(slots=3)
    uncommitted = engine.reserve(KeysRequest(ns, "w", K("abc"), LONG, 0))
    rejected(engine, ResourceExhausted, "reserve", KeysRequest(ns, "w2", K("pq"), LONG, 0), match="full")
    engine.release("w", [uncommitted.lease.lease_id])
    # The only candidate is the block the request extends: still refused,
    # and the candidate keeps its place.
    put(engine, ns, "abc")
    rejected(engine, ResourceExhausted, "reserve", KeysRequest(ns, "w2", K("abcd"), LONG, 0))
    assert policy_order(engine) == [k("abc")]


# ----------------------------------------------------------------------
# Keys under a different parent


def test_key_under_a_different_parent_is_rejected(env):
    engine, ns = env
    put(engine, ns, "abc")
    put(engine, ns, "xyz")
    # Skipping a block of a stored chain.
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "w", [k("a"), k("abc")], LONG, 0), match=r"keys\[1\]")
    # A stored non-root block presented as a root block.
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "w", [k("ab")], LONG, 0), match=r"keys\[0\]")
    # Presented under the wrong parent_key.
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "w", [k("abc")], LONG, 0, parent_key=k("xyz")),
                                                             match=r"keys\[0\]")
    # A stored key after a missing one: it cannot be the missing one's child.
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "w", [k("p"), k("ab")], LONG, 0), match=r"keys\[1\]")
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "w", K("abc") + [k("p"), k("xy")], LONG, 0))
    # The parent itself repeated in the chain.
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "w", [k("p"), k("ab")], LONG, 0, parent_key=k("ab")))
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "w", [k("a"), k("a")], LONG, 0), match="duplicates")


def test_key_under_a_different_parent_evicts_nothing(make):
    # Regression: the check for a stored key after the first missing one ran
    # only after slots had been allocated, so a rejected request had already
    # evicted blocks (and a stored key that happened to be evicted first was
    # re-reserved under the wrong parent without any error).
    engine, ns = make(slots=4)
    for chain in ("a", "b", "c", "d"):
        put(engine, ns, chain)
    assert policy_order(engine) == [k("a"), k("b"), k("c"), k("d")]
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "w", [k("p"), k("c")], LONG, 0), match=r"keys\[1\]")
    # a is the next victim: the second key would be the one evicted.
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "w", [k("p"), k("a")], LONG, 0), match=r"keys\[1\]")
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "w", [k("p"), k("q"), k("d")], LONG, 0))
    assert engine.host.counters.evictions == 0


def test_writable_key_after_a_missing_one_is_rejected(env):
    engine, ns = env
    other = engine.reserve(KeysRequest(ns, "alice", K("xy"), LONG, 0))
    rejected(engine, InvalidArgument, "reserve", KeysRequest(ns, "bob", [k("p"), k("x")], LONG, 0))
    engine.release("alice", [other.lease.lease_id])
