"""The engine's commit errors and aborts (helpers: tests/unit/engine_helpers.py;
the `writing` fixture, a write lease over abcd, is in tests/unit/conftest.py)."""

from __future__ import annotations

import pytest

from kvd.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied
from kvd.invariants import InvariantError
from kvd.testing import engine_ops
from kvd.core.requests import CommitRequest, KeysRequest
from tests.unit.engine_helpers import LONG, OTHER_SPEC, K, block, k, policy_order, put, rejected, stored


# ----------------------------------------------------------------------
# Commit errors and aborts


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
