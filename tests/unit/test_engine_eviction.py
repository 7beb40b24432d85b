"""The engine's eviction order: empty slots first, then least recently used,
leaf by leaf, never a pinned block (helpers: tests/unit/engine_helpers.py)."""

from __future__ import annotations

from kvd.testing import engine_ops
from kvd.core.requests import CommitRequest, KeysRequest
from tests.unit.engine_helpers import LONG, OTHER_SPEC, Checked, E, K, N, R, k, owner_keys, policy_order, put, stored


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
