"""The engine (kvd.core.engine.Engine): exact outcomes of every operation.

Keys come from a namespace with one token per block, so a string names a
chain: K("abc") are the keys of the blocks "a", "ab", "abc" and K("abx")[2]
is a sibling of K("abc")[2]. Every engine call goes through `Checked`, which
runs engine.verify() after it, whether the call succeeded or raised. Every
rejected call is made through `rejected`, which also asserts that the
engine's observable state is exactly what it was before.
"""

from __future__ import annotations

import dataclasses
import gc
import sys
import warnings

import pytest

from kvd.core.block import NO_SLOT, BlockState
from kvd.core.engine import Engine, EngineLimits, ReserveStatus, TierId
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.lease import LeaseKind
from kvd.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvdError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvd.invariants import InvariantError
from kvd.testing import engine_ops
from kvd.testing.engine_snapshot import snapshot
from kvd.core.requests import CommitRequest, KeysRequest

R, E, F, N = ReserveStatus.RESERVED, ReserveStatus.EXISTS, ReserveStatus.IN_FLIGHT, ReserveStatus.NO_SPACE

SPEC = NamespaceSpec(model_id="engine-test", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
OTHER_SPEC = dataclasses.replace(SPEC, lora_id="adapter")
SLOT_BYTES = 64
LONG = 10_000  # a lease that does not expire within a test


def K(chain: str, spec: NamespaceSpec = SPEC) -> list[bytes]:
    return chain_keys(spec, [ord(ch) for ch in chain])


def k(chain: str) -> bytes:
    """The key of the last block of `chain`."""
    return K(chain)[-1]


class Checked:
    """Proxy that verifies the engine after every call, even a failed one."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str):
        attribute = getattr(self.engine, name)
        if not callable(attribute) or name == "verify":
            return attribute

        def call(*args, **kwargs):
            try:
                return attribute(*args, **kwargs)
            finally:
                self.engine.verify()

        return call


def rejected(engine: Checked, error: type[KvdError], method: str, *args, match: str | None = None) -> KvdError:
    before = snapshot(engine.engine)
    with pytest.raises(error, match=match) as raised:
        getattr(engine, method)(*args)
    assert type(raised.value) is error
    assert snapshot(engine.engine) == before
    return raised.value


@pytest.fixture
def make(engine_factory):
    def build(slots: int = 6, **limits) -> tuple[Checked, bytes]:
        engine = engine_factory(slots, SLOT_BYTES, limits=EngineLimits(**limits))
        namespace_id = engine.register_namespace(SPEC).namespace_id
        engine.verify()
        return Checked(engine), namespace_id

    return build


@pytest.fixture
def env(make):
    return make()


def put(engine: Checked, ns: bytes, chain: str, *, client: str = "writer", now: int = 0):
    """Store `chain` (reserve + commit everything); returns the statuses."""
    result = engine.reserve(KeysRequest(ns, client, K(chain), LONG, now))
    if result.lease is not None:
        engine.commit(CommitRequest(ns, client, result.lease.lease_id, now))
    return result.statuses


def stored(engine: Checked, ns: bytes) -> set[bytes]:
    return set(engine.engine.namespace(ns).index.nodes)


def block(engine: Checked, ns: bytes, chain: str):
    return engine.engine.namespace(ns).index.get(k(chain))


def policy_order(engine: Checked) -> list[bytes]:
    return [b.key for b in engine.engine.host.policy.order()]


def owner_keys(engine: Checked) -> dict[int, bytes]:
    return {slot: owner.key for slot, owner in enumerate(engine.engine.host.pool.owners) if owner is not None}


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
# Eviction order


def reserve_and_report_evictions(engine: Checked, ns: bytes, chain: str) -> list[bytes]:
    """Reserve and commit `chain`; the keys it evicted, in eviction order."""
    owners = owner_keys(engine)
    result = engine.reserve(KeysRequest(ns, "w", K(chain), LONG, 0))
    evicted = [owners[slot] for slot in result.slots if slot in owners]
    engine.commit(CommitRequest(ns, "w", result.lease.lease_id, 0))
    return evicted


def test_empty_slots_are_used_before_anything_is_evicted(env):
    engine, ns = env
    put(engine, ns, "ab")
    put(engine, ns, "xy")
    assert reserve_and_report_evictions(engine, ns, "pq") == []
    assert engine.host.counters.evictions == 0
    assert stored(engine, ns) == set(K("ab") + K("xy") + K("pq"))


def test_a_cold_prefix_is_evicted_from_its_tail(env):
    engine, ns = env
    put(engine, ns, "abc")
    put(engine, ns, "xyz")
    assert policy_order(engine) == [k("abc"), k("xyz")]
    # abc is the least recently used prefix: all of it goes, tail first,
    # before anything of xyz.
    evicted = reserve_and_report_evictions(engine, ns, "pqr")
    assert evicted == [k("abc"), k("ab"), k("a")]
    assert engine.host.counters.evictions == 3
    assert engine.lookup(ns, K("abc")) == []
    assert [b.key for b in engine.lookup(ns, K("xyz"))] == K("xyz")


def test_partial_eviction_keeps_the_prefix_reachable(env):
    engine, ns = env
    put(engine, ns, "abc")
    put(engine, ns, "xyz")
    assert reserve_and_report_evictions(engine, ns, "p") == [k("abc")]
    # Evicting c made ab a candidate, next in line (cold), ahead of xyz.
    assert policy_order(engine) == [k("ab"), k("xyz"), k("p")]
    assert [b.key for b in engine.lookup(ns, K("abc"))] == K("ab")
    assert policy_order(engine) == [k("xyz"), k("p"), k("ab")]  # the lookup used it


def test_lru_across_prefixes(env):
    engine, ns = env
    put(engine, ns, "abc")
    put(engine, ns, "xyz")
    engine.lookup(ns, K("abc"))  # abc is now more recent than xyz
    assert policy_order(engine) == [k("xyz"), k("abc")]
    assert reserve_and_report_evictions(engine, ns, "pqrs") == [k("xyz"), k("xy"), k("x"), k("abc")]
    assert [b.key for b in engine.lookup(ns, K("abc"))] == K("ab")


def test_lru_among_single_blocks(make):
    engine, ns = make(slots=4)
    for chain in ("a", "b", "c", "d"):
        put(engine, ns, chain)
    engine.lookup(ns, K("b"))
    engine_ops.get(engine, KeysRequest(ns, "reader", K("a"), LONG, 0))  # pinned: not a candidate
    engine.lookup(ns, K("c"))
    assert policy_order(engine) == [k("d"), k("b"), k("c")]
    assert reserve_and_report_evictions(engine, ns, "pq") == [k("d"), k("b")]
    assert policy_order(engine) == [k("c"), k("pq")]
    # A reserve that finds its chain stored touches it, like a lookup.
    assert engine.reserve(KeysRequest(ns, "w", K("c"), LONG, 0)).statuses == [E]
    assert policy_order(engine) == [k("pq"), k("c")]
    engine.close_all_leases()


def test_lookup_of_an_inner_prefix_does_not_touch_the_leaf(env):
    engine, ns = env
    put(engine, ns, "abc")
    put(engine, ns, "xyz")
    engine.lookup(ns, K("ab"))  # ab is not a candidate; abc stays oldest
    assert policy_order(engine) == [k("abc"), k("xyz")]


def test_branches_are_evicted_leaf_by_leaf(env):
    engine, ns = env
    put(engine, ns, "ab")
    put(engine, ns, "ax")
    put(engine, ns, "ay")
    assert policy_order(engine) == [k("ab"), k("ax"), k("ay")]
    # Two free slots first; then a stays until its last child goes, and
    # goes right after it.
    assert reserve_and_report_evictions(engine, ns, "pqrstu") == [k("ab"), k("ax"), k("ay"), k("a")]


def test_eviction_is_shared_across_namespaces(env):
    engine, ns = env
    other = engine.register_namespace(OTHER_SPEC).namespace_id
    put(engine, ns, "abc")
    result = engine.reserve(KeysRequest(other, "w", K("abc", OTHER_SPEC), LONG, 0))
    engine.commit(CommitRequest(other, "w", result.lease.lease_id, 0))
    evicted = reserve_and_report_evictions(engine, ns, "pq")
    assert evicted == [k("abc"), k("ab")]
    assert len(engine.namespace(other).index) == 3


def test_pinned_blocks_are_never_evicted(env):
    engine, ns = env
    put(engine, ns, "abc")
    put(engine, ns, "xyz")
    lease, matched = engine_ops.get(engine, KeysRequest(ns, "reader", K("abc"), LONG, 0))
    assert [b.ref_count for b in matched] == [1, 1, 1]
    result = engine.reserve(KeysRequest(ns, "w", K("pqrs"), LONG, 0))
    assert result.statuses == [R, R, R, N]
    assert stored(engine, ns) == set(K("abc") + K("pqr"))
    engine.release("w", [result.lease.lease_id])
    engine.release("reader", [lease.lease_id])
    assert policy_order(engine) == [k("abc")]


def test_a_pinned_inner_block_protects_its_prefix_only(env):
    engine, ns = env
    put(engine, ns, "abc")
    put(engine, ns, "xyz")
    lease, _ = engine_ops.get(engine, KeysRequest(ns, "reader", K("ab"), LONG, 0))
    # c is still a candidate (the oldest); after it goes, ab is pinned and
    # not a candidate, so xyz goes next.
    assert reserve_and_report_evictions(engine, ns, "pqrs") == [k("abc"), k("xyz"), k("xy"), k("x")]
    assert [b.key for b in engine.lookup(ns, K("abc"))] == K("ab")
    engine.release("reader", [lease.lease_id])
    assert policy_order(engine)[-1] == k("ab")


# ----------------------------------------------------------------------
# Commit errors and aborts


@pytest.fixture
def writing(env):
    """A write lease over abcd, nothing committed yet."""
    engine, ns = env
    result = engine.reserve(KeysRequest(ns, "writer", K("abcd"), LONG, 0))
    return engine, ns, result.lease.lease_id


def test_partial_commits_in_order(writing):
    engine, ns, lease_id = writing
    assert engine.commit(CommitRequest(ns, "writer", lease_id, 0, keys=K("ab")))[:2] == (2, 0)
    assert [b.key for b in engine.lookup(ns, K("abcd"))] == K("ab")
    # The sealed blocks stay pinned by the lease until it ends.
    assert block(engine, ns, "ab").ref_count == 1
    assert engine.commit(CommitRequest(ns, "writer", lease_id, 0))[:2] == (2, 0)
    assert len(engine.leases) == 0
    assert block(engine, ns, "ab").ref_count == 0


def test_duplicate_commit_is_failed_precondition(writing):
    engine, ns, lease_id = writing
    engine.commit(CommitRequest(ns, "writer", lease_id, 0, keys=[k("a")]))
    rejected(engine, FailedPrecondition, "commit", CommitRequest(ns, "writer", lease_id, 0, keys=[k("a")]),
                                                                 match="already committed")
    rejected(engine, FailedPrecondition, "commit", CommitRequest(ns, "writer", lease_id, 0, keys=K("ab")),
                                                                 match="already committed")
    # Once everything is committed the lease has ended: NotFound, not a
    # second success.
    engine.commit(CommitRequest(ns, "writer", lease_id, 0))
    rejected(engine, NotFound, "commit", CommitRequest(ns, "writer", lease_id, 0, keys=[k("a")]))


def test_commit_of_a_key_not_in_the_lease(writing):
    engine, ns, lease_id = writing
    put(engine, ns, "xy")
    rejected(engine, InvalidArgument, "commit", CommitRequest(ns, "writer", lease_id, 0, keys=[k("xy")]),
                                                              match="not part of lease")
    rejected(engine, InvalidArgument, "commit", CommitRequest(ns, "writer", lease_id, 0, keys=[k("a"), k("zz")]),
                                                              match="keys")
    rejected(engine, InvalidArgument, "commit", CommitRequest(ns, "writer", lease_id, 0, abort_keys=[k("zz")]),
                                                              match="abort_keys")


def test_commit_argument_errors(writing):
    engine, ns, lease_id = writing
    rejected(engine, InvalidArgument, "commit", CommitRequest(ns, "writer", lease_id, 0, keys=[k("a")],
                                                              abort_keys=[k("a")]), match="both")
    rejected(engine, InvalidArgument, "commit", CommitRequest(ns, "writer", lease_id, 0, keys=[k("a"), k("a")]),
                                                              match="duplicates")
    rejected(engine, InvalidArgument, "commit", CommitRequest(ns, "writer", lease_id, 0, abort_keys=[k("ab"),
                                                              k("ab")]), match="duplicates")
    rejected(engine, FailedPrecondition, "commit", CommitRequest(ns, "writer", lease_id, 0, keys=[k("ab")]),
                                                                 match="parent")
    rejected(engine, FailedPrecondition, "commit", CommitRequest(ns, "writer", lease_id, 0, keys=[k("abc")],
                                                                 abort_keys=[k("ab")]), match="after")
    rejected(engine, InvalidArgument, "commit", CommitRequest(ns, "writer", lease_id, 0, keys=[b"short"]),
                                                              match=r"keys\[0\]")
    rejected(engine, InvalidArgument, "commit", CommitRequest(ns, "writer", lease_id, 0, abort_keys=[b"s"]),
                                                              match=r"abort_keys\[0\]")
    other = engine.register_namespace(OTHER_SPEC).namespace_id
    rejected(engine, InvalidArgument, "commit", CommitRequest(other, "writer", lease_id, 0, keys=[k("a")]),
                                                              match="namespace")
    rejected(engine, NotFound, "commit", CommitRequest(ns, "writer", lease_id + 100, 0, keys=[k("a")]))


def test_foreign_lease_is_permission_denied(writing):
    engine, ns, lease_id = writing
    rejected(engine, PermissionDenied, "commit", CommitRequest(ns, "mallory", lease_id, 0, keys=[k("a")]))
    rejected(engine, PermissionDenied, "commit", CommitRequest(ns, "mallory", lease_id, 0))
    rejected(engine, PermissionDenied, "release", "mallory", [lease_id])
    rejected(engine, PermissionDenied, "renew", "mallory", lease_id, LONG, 0)


def test_read_lease_cannot_be_committed(env):
    engine, ns = env
    put(engine, ns, "ab")
    lease, _ = engine_ops.get(engine, KeysRequest(ns, "reader", K("ab"), LONG, 0))
    rejected(engine, FailedPrecondition, "commit", CommitRequest(ns, "reader", lease.lease_id, 0), match="read lease")
    engine.release("reader", [lease.lease_id])


def test_abort_takes_the_rest_of_the_chain(writing):
    engine, ns, lease_id = writing
    free_before = len(engine.host.pool.free_slots)
    assert engine.commit(CommitRequest(ns, "writer", lease_id, 0, keys=[k("a")], abort_keys=[k("abc")]))[:2] == (1, 2)
    assert stored(engine, ns) == set(K("ab"))
    assert len(engine.host.pool.free_slots) == free_before + 2
    assert engine.host.counters.aborted == 2
    assert len(engine.leases) == 1  # ab is still being written
    rejected(engine, FailedPrecondition, "commit", CommitRequest(ns, "writer", lease_id, 0, keys=[k("abc")]),
                                                                 match="aborted")
    assert engine.commit(CommitRequest(ns, "writer", lease_id, 0))[:2] == (1, 0)
    assert len(engine.leases) == 0
    assert [b.key for b in engine.lookup(ns, K("abcd"))] == K("ab")


def test_abort_everything(writing):
    engine, ns, lease_id = writing
    assert engine.commit(CommitRequest(ns, "writer", lease_id, 0, abort_keys=[k("a")]))[:2] == (0, 4)
    assert stored(engine, ns) == set()
    assert len(engine.leases) == 0
    assert engine.host.pool.resident_blocks == 0
    assert (engine.live_handles, engine.pinned_blocks) == (0, 0)


def test_seal_prefix_keeps_what_was_written_and_aborts_the_rest(env):
    """A write kvd cut short (a fetch from a peer, a failed SaveLayers): a sealed prefix, no holes."""
    engine, ns = env
    lease = engine.reserve(KeysRequest(ns, "fetch", K("abcd"), LONG, 0)).lease
    assert engine.seal_prefix(lease, 2, 0) == 2
    assert stored(engine, ns) == set(K("ab")) and engine.host.counters.aborted == 2
    assert len(engine.leases) == 0 and lease.ended
    lease = engine.reserve(KeysRequest(ns, "fetch", K("abxy"), LONG, 0)).lease
    assert engine.seal_prefix(lease, 0, 0) == 0
    assert stored(engine, ns) == set(K("ab")) and len(engine.leases) == 0
    lease = engine.reserve(KeysRequest(ns, "fetch", K("abxy"), LONG, 0)).lease
    with pytest.raises(InvariantError):
        engine.seal_prefix(lease, 3, 0)  # two were reserved
    assert engine.seal_prefix(lease, 2, 0) == 2
    assert stored(engine, ns) == set(K("abxy"))


def test_abort_after_commit_is_refused(writing):
    engine, ns, lease_id = writing
    engine.commit(CommitRequest(ns, "writer", lease_id, 0, keys=K("ab")))
    rejected(engine, FailedPrecondition, "commit", CommitRequest(ns, "writer", lease_id, 0, abort_keys=[k("a")]),
                                                                 match="already committed")
    rejected(engine, FailedPrecondition, "commit", CommitRequest(ns, "writer", lease_id, 0, abort_keys=[k("ab")]),
                                                                 match="already committed")
    assert engine.commit(CommitRequest(ns, "writer", lease_id, 0, abort_keys=[k("abc")]))[:2] == (0, 2)
    assert len(engine.leases) == 0
    assert policy_order(engine) == [k("ab")]


def test_abort_under_a_stored_parent_readmits_the_parent(env):
    engine, ns = env
    put(engine, ns, "ab")
    result = engine.reserve(KeysRequest(ns, "w", K("abcd"), LONG, 0))
    assert engine.commit(CommitRequest(ns, "w", result.lease.lease_id, 0, abort_keys=[k("abc")]))[:2] == (0, 2)
    assert policy_order(engine) == [k("ab")]
    assert block(engine, ns, "ab").ref_count == 0


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
    assert engine.leases.next_deadline_ms() == 150
    assert engine.expire(150) == 1
    assert engine.leases.next_deadline_ms() is None


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
# Delete


def test_delete_removes_a_subtree(env):
    engine, ns = env
    put(engine, ns, "abc")
    put(engine, ns, "abx")
    put(engine, ns, "q")
    assert engine.delete(ns, [k("ab")]) == (3, 0)
    assert stored(engine, ns) == {k("a"), k("q")}
    assert engine.host.counters.deleted == 3
    assert engine.host.pool.resident_blocks == 2
    # The surviving parent is now a leaf and a candidate again.
    assert policy_order(engine) == [k("q"), k("a")]
    assert engine.delete(ns, [k("ab"), k("zz")]) == (0, 0)
    assert engine.delete(ns, [k("a"), k("a"), k("q")]) == (2, 0)
    assert engine.host.pool.resident_blocks == 0


def test_delete_of_a_pinned_subtree_is_refused(env):
    engine, ns = env
    put(engine, ns, "abc")
    lease, _ = engine_ops.get(engine, KeysRequest(ns, "r", K("abc"), LONG, 0))
    before = snapshot(engine.engine)
    assert engine.delete(ns, [k("a")]) == (0, 1)
    assert engine.delete(ns, [k("abc")]) == (0, 1)
    assert snapshot(engine.engine) == before
    engine.release("r", [lease.lease_id])
    # Pinning an ancestor does not protect the descendants.
    lease, _ = engine_ops.get(engine, KeysRequest(ns, "r", K("a"), LONG, 0))
    assert engine.delete(ns, [k("ab")]) == (2, 0)
    assert engine.delete(ns, [k("a")]) == (0, 1)
    engine.release("r", [lease.lease_id])


def test_delete_of_a_subtree_being_written_is_refused(env):
    engine, ns = env
    put(engine, ns, "ab")
    result = engine.reserve(KeysRequest(ns, "w", K("abcd"), LONG, 0))
    before = snapshot(engine.engine)
    assert engine.delete(ns, [k("a")]) == (0, 1)
    assert engine.delete(ns, [k("abcd")]) == (0, 1)
    assert snapshot(engine.engine) == before
    engine.release("w", [result.lease.lease_id])


def test_delete_mixed(env):
    engine, ns = env
    put(engine, ns, "ab")
    put(engine, ns, "xy")
    lease, _ = engine_ops.get(engine, KeysRequest(ns, "r", K("xy"), LONG, 0))
    assert engine.delete(ns, [k("a"), k("x")]) == (2, 1)
    assert stored(engine, ns) == set(K("xy"))
    engine.release("r", [lease.lease_id])


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
