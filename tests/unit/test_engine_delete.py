"""The engine's delete of subtrees (helpers: tests/unit/engine_helpers.py)."""

from __future__ import annotations

from kvd.testing import engine_ops
from kvd.testing.engine_snapshot import snapshot
from kvd.core.requests import KeysRequest
from tests.unit.engine_helpers import LONG, K, k, policy_order, put, stored


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
