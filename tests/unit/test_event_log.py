"""KV events: the event log alone, then the exact events of each engine change.

The last tests drive an engine with a disk tier through seeded random
operations and, after every step, apply the new events to a BlockMirror
(the client's): the mirror must equal what the engine serves, key by key
and tier by tier, and every event must fit what the mirror holds.
"""

from __future__ import annotations

import contextlib
import random

import pytest

from kvd.client.events import BlockMirror, EventSnapshot, ResyncRequired
from kvd.core.block import NO_SLOT, BlockState
from kvd.core.engine import Engine, TierId
from kvd.core.events import EventKind, EventLog
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.errors import FailedPrecondition, ResourceExhausted
from kvd.invariants import InvariantError
from kvd.testing.engine_snapshot import snapshot
from kvd.core.requests import CommitRequest, KeysRequest
from kvd.testing import core_ops

STORED, REMOVED, TIER_CHANGED = EventKind.STORED, EventKind.REMOVED, EventKind.TIER_CHANGED
HOST, DISK = int(TierId.HOST), int(TierId.DISK)
SPEC = NamespaceSpec(model_id="events-test", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
LONG = 10_000
A, B = b"A" * 32, b"B" * 32


def K(chain: str) -> list[bytes]:
    return chain_keys(SPEC, [ord(ch) for ch in chain])


def key(number: int) -> bytes:
    return number.to_bytes(32, "big")


def shape(events) -> list[tuple]:
    """(sequence, kind, keys, parent, tier) of each event, for exact comparisons."""
    return [(event.sequence, event.kind, list(event.keys), event.parent_key, event.tier) for event in events]


# ----------------------------------------------------------------------
# The log alone


def test_a_batch_is_one_event_and_consecutive_changes_coalesce():
    log = EventLog()
    keys = [key(n) for n in range(100)]
    log.stored(A, keys, b"", HOST)
    # A chain continuing the open one joins it; a new root does not.
    log.stored(A, [key(100)], key(99), HOST)
    log.stored(A, [key(200)], b"", HOST)
    log.removed(A, key(5))
    log.removed(A, key(6))
    log.removed(B, key(7))
    log.tier_changed(A, key(1), DISK)
    log.tier_changed(A, key(2), DISK)
    log.tier_changed(A, key(3), HOST)
    assert shape(log.read(A, 1, 100)) == [
        (1, STORED, keys + [key(100)], b"", HOST),
        (2, STORED, [key(200)], b"", HOST),
        (3, REMOVED, [key(5), key(6)], b"", 0),
        (4, TIER_CHANGED, [key(1), key(2)], b"", DISK),
        (5, TIER_CHANGED, [key(3)], b"", HOST),
    ]
    # Sequence numbers are per namespace.
    assert shape(log.read(B, 1, 100)) == [(1, REMOVED, [key(7)], b"", 0)]
    assert log.published_events[STORED] == 2 and log.published_keys[STORED] == 102
    log.verify()


def test_a_stored_chain_in_another_tier_or_namespace_is_a_new_event():
    log = EventLog()
    log.stored(A, [key(1)], b"", HOST)
    log.stored(A, [key(2)], key(1), DISK)
    log.stored(B, [key(3)], key(2), DISK)
    assert [event.tier for event in log.read(A, 1, 10)] == [HOST, DISK]
    assert shape(log.read(B, 1, 10)) == [(1, STORED, [key(3)], key(2), DISK)]


def test_long_runs_split_at_max_event_keys_and_a_stored_continuation_names_its_parent():
    log = EventLog(max_event_keys=4)
    keys = [key(n) for n in range(10)]
    log.stored(A, keys[:3], b"", HOST)
    log.stored(A, keys[3:], keys[2], HOST)
    for n in range(6):
        log.removed(A, key(100 + n))
    assert shape(log.read(A, 1, 10)) == [
        (1, STORED, keys[0:4], b"", HOST),
        (2, STORED, keys[4:8], keys[3], HOST),
        (3, STORED, keys[8:10], keys[7], HOST),
        (4, REMOVED, [key(100 + n) for n in range(4)], b"", 0),
        (5, REMOVED, [key(104), key(105)], b"", 0),
    ]
    log.verify()


def test_the_ring_keeps_the_newest_events_within_both_bounds():
    log = EventLog(ring_events=3, ring_keys=4)
    for n in range(1, 5):
        log.removed(A, key(n))
        log.flush()
    # Four one-key events, three fit: event 1 left.
    assert log.first_sequence(A) == 2 and log.last_sequence(A) == 4
    assert log.read(A, 1, 10) is None
    assert [event.sequence for event in log.read(A, 2, 10)] == [2, 3, 4]
    assert [event.sequence for event in log.read(A, 3, 1)] == [3]
    assert log.read(A, 5, 10) == []
    # A three-key event pushes out two more (4 keys at most).
    log.stored(B, [key(10), key(11), key(12)], b"", HOST)
    log.flush()
    assert log.first_sequence(A) == 4 and log.retained_keys == 4 and core_ops.retained_events(log) == 2
    assert log.trimmed_events == 3
    log.verify()
    # Reading past the next event is a caller's bug.
    with pytest.raises(InvariantError):
        log.read(A, 6, 10)
    with pytest.raises(InvariantError):
        log.read(A, 0, 10)


def test_an_event_never_holds_more_keys_than_the_ring():
    log = EventLog(ring_events=10, ring_keys=3)
    log.stored(A, [key(n) for n in range(7)], b"", HOST)
    assert [len(event.keys) for event in log.read(A, log.first_sequence(A), 10)] == [1]
    assert log.last_sequence(A) == 3
    log.verify()


def test_an_unknown_namespace_has_no_events():
    log = EventLog()
    assert log.last_sequence(A) == 0 and log.first_sequence(A) == 1 and log.read(A, 1, 10) == []


def test_readers_publish_the_open_event_and_the_listener_hears_each_new_one():
    log = EventLog()
    heard = []

    def listener():
        # Called before the new event exists: flushing here publishes only
        # what was open before.
        heard.append(log.open_key_count)
        log.flush()

    log.listener = listener
    log.stored(A, [key(1)], b"", HOST)
    log.stored(A, [key(2)], key(1), HOST)  # joins the open event: no call
    assert heard == [0]
    log.listener = None
    log.removed(A, key(2))
    assert log.open_key_count == 1
    assert log.last_sequence(A) == 2 and log.open_key_count == 0
    log.verify()


def test_verify_catches_a_broken_numbering():
    log = EventLog()
    log.removed(A, key(1))
    log.flush()
    log.removed(A, key(2))
    log.flush()
    log.read(A, 2, 1)[0].sequence = 7
    with pytest.raises(InvariantError, match="event 7 where 2 was due"):
        log.verify()


# ----------------------------------------------------------------------
# The engine's events


def new_events(engine: Engine, namespace_id: bytes, after: int) -> list:
    events = engine.events.read(namespace_id, after + 1, 1 << 30)
    assert events is not None
    return events


def put(engine: Engine, ns: bytes, chain: str, client: str = "w", parent: str = "") -> int:
    keys = K(chain)[len(parent):]
    result = engine.reserve(KeysRequest(ns, client, keys, LONG, 0, parent_key=K(parent)[-1] if parent else b""))
    if result.lease is None:
        return 0
    return engine.commit(CommitRequest(ns, client, result.lease.lease_id, 0))[0]


def test_a_commit_is_one_stored_event_and_a_continued_chain_joins_it(engine_factory):
    engine = engine_factory(8, 64)
    ns = engine.register_namespace(SPEC).namespace_id
    assert put(engine, ns, "abc") == 3
    assert put(engine, ns, "abcde", parent="abc") == 2
    # Sealed in two steps of one lease: the second step continues the chain.
    result = engine.reserve(KeysRequest(ns, "w", K("xyz"), LONG, 0))
    engine.commit(CommitRequest(ns, "w", result.lease.lease_id, 0, keys=K("xyz")[:1]))
    engine.commit(CommitRequest(ns, "w", result.lease.lease_id, 0))
    # Nobody read in between: consecutive parts of one chain are one event.
    assert shape(new_events(engine, ns, 0)) == [
        (1, STORED, K("abcde"), b"", HOST),
        (2, STORED, K("xyz"), b"", HOST),
    ]


def test_each_commit_read_at_once_is_its_own_event(engine_factory):
    engine = engine_factory(8, 64)
    ns = engine.register_namespace(SPEC).namespace_id
    put(engine, ns, "abc")
    assert shape(new_events(engine, ns, 0)) == [(1, STORED, K("abc"), b"", HOST)]
    put(engine, ns, "abcde", parent="abc")
    assert shape(new_events(engine, ns, 1)) == [(2, STORED, K("abcde")[3:], K("abc")[-1], HOST)]


def test_aborts_and_rejected_calls_announce_nothing(engine_factory):
    engine = engine_factory(4, 64)
    ns = engine.register_namespace(SPEC).namespace_id
    result = engine.reserve(KeysRequest(ns, "w", K("abc"), LONG, 0))
    engine.commit(CommitRequest(ns, "w", result.lease.lease_id, 0, keys=K("a"),
                                abort_keys=K("abc")[1:]))  # seal "a", abort the rest
    assert shape(new_events(engine, ns, 0)) == [(1, STORED, K("a"), b"", HOST)]
    # An expired write lease aborts its blocks: nothing to announce.
    engine.reserve(KeysRequest(ns, "w", K("ab")[1:], 10, 0, parent_key=K("a")[-1]))
    engine.expire(100)
    before = snapshot(engine)
    with pytest.raises(FailedPrecondition):
        engine.reserve(KeysRequest(ns, "w", K("zz")[1:], LONG, 0, parent_key=K("zz")[0]))
    assert snapshot(engine) == before
    assert engine.events.last_sequence(ns) == 1


def test_eviction_and_delete_are_removed_events(engine_factory):
    engine = engine_factory(4, 64)
    ns = engine.register_namespace(SPEC).namespace_id
    put(engine, ns, "abcd")
    engine.events.flush()
    # Three new blocks evict abcd's three-block tail, leaves first: one event.
    put(engine, ns, "xyz")
    events = new_events(engine, ns, 1)
    assert shape(events) == [
        (2, REMOVED, [K("abcd")[3], K("abcd")[2], K("abcd")[1]], b"", 0),
        (3, STORED, K("xyz"), b"", HOST),
    ]
    assert engine.delete(ns, K("x")) == (3, 0)
    assert shape(new_events(engine, ns, 3)) == [(4, REMOVED, K("xyz")[::-1], b"", 0)]


class Plane:
    """Moves fake bytes (the block's key) between host and disk slots, as the daemon's disk plane does."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ns = engine.register_namespace(SPEC).namespace_id
        engine.enable_disk(self.ns)
        self.corrupt: set[int] = set()

    def flush(self, fail: frozenset[bytes] = frozenset()) -> None:
        writes = self.engine.pick_writes(100)
        self.journal()
        self.engine.finish_writes(writes, [write.block.key not in fail for write in writes])
        self.journal()

    def journal(self) -> None:
        removals = self.engine.take_disk_removals()
        self.engine.disk_removals_journalled([slot for _, _, slot in removals])

    def get(self, chain: str, client: str = "r") -> int:
        plan = self.engine.begin_get(KeysRequest(self.ns, client, K(chain), LONG, 0))
        self.engine.finish_loads(plan.loads, [load.source_slot not in self.corrupt for load in plan.loads])
        self.journal()
        served = len(self.engine.settle_get(plan))
        if plan.lease is not None:
            self.engine.release(client, [plan.lease.lease_id])
        return served


def test_demotion_promotion_loss_and_disk_eviction_with_a_disk_tier(engine_factory):
    engine = engine_factory(4, 64, disk_slot_count=6, disk_slot_bytes=64)
    plane = Plane(engine)
    ns = plane.ns
    put(engine, ns, "abcd")
    plane.flush()
    put(engine, ns, "wxyz")  # abcd's host copies go; their disk copies stay
    assert shape(new_events(engine, ns, 0)) == [
        (1, STORED, K("abcd"), b"", HOST),
        (2, TIER_CHANGED, K("abcd")[::-1], b"", DISK),
        (3, STORED, K("wxyz"), b"", HOST),
    ]
    # A Get brings abcd back: wxyz (never written) is evicted, abcd promoted.
    assert plane.get("abcd") == 4
    assert shape(new_events(engine, ns, 3)) == [
        (4, REMOVED, K("wxyz")[::-1], b"", 0),
        (5, TIER_CHANGED, K("abcd"), b"", HOST),
    ]
    # Corrupt "b" on disk after a demotion: the Get loses it and "cd" with it.
    put(engine, ns, "pqrs")
    engine.events.flush()
    plane.corrupt.add(engine.disk_slot(engine.lookup(ns, K("ab"))[-1]))
    assert plane.get("abcd") == 1
    after = engine.events.last_sequence(ns)
    events = [event for event in new_events(engine, ns, 5) if event.kind == REMOVED]
    assert events[-1].keys == [K("abcd")[3], K("abcd")[2], K("abcd")[1]]
    assert engine.events.last_sequence(ns) == after


def test_recovered_blocks_are_stored_on_disk(engine_factory):
    engine = engine_factory(4, 64, disk_slot_count=8, disk_slot_bytes=64)
    ns = engine.register_namespace(SPEC).namespace_id
    keys = K("abc")
    assert engine.recover(ns, [(keys[2], keys[1], 2), (keys[0], b"", 0), (keys[1], keys[0], 1)]) == 3
    assert shape(new_events(engine, ns, 0)) == [(1, STORED, keys, b"", DISK)]


# ----------------------------------------------------------------------
# Random operations, checked against a mirror after every step


def served(engine: Engine, ns: bytes) -> tuple[dict[bytes, int], dict[bytes, bytes]]:
    index = engine.namespace(ns).index
    blocks = [block for block in index if block.state == BlockState.SEALED]
    tiers = {block.key: int(engine.tier_of(block)) for block in blocks}
    parents = {block.key: block.parent.key if block.parent is not None else b"" for block in blocks}
    return tiers, parents


@pytest.mark.parametrize("seed", range(6))
def test_events_mirror_the_engine_through_random_operations(engine_factory, seed):
    rng = random.Random(seed)
    engine = engine_factory(6, 64, disk_slot_count=8, disk_slot_bytes=64)
    plane = Plane(engine)
    ns = plane.ns
    mirror = BlockMirror(EventSnapshot("", 0, [], [], b""))
    chains = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(12)]
    open_leases = []
    for step in range(400):
        action = rng.choice(["put", "put", "flush", "get", "get", "delete", "reserve", "abandon", "corrupt"])
        chain = rng.choice(chains)
        if action == "put":
            with contextlib.suppress(ResourceExhausted):  # every slot pinned by open reservations
                put(engine, ns, chain)
        elif action == "flush":
            stored = [block.key for block in engine.write_queue]
            plane.flush(fail=frozenset(rng.sample(stored, min(len(stored), rng.randint(0, 1)))))
        elif action == "get":
            plane.get(chain)
        elif action == "delete":
            engine.delete(ns, [K(chain)[rng.randrange(len(chain))]])
        elif action == "reserve" and len(open_leases) < 2:
            with contextlib.suppress(ResourceExhausted):
                result = engine.reserve(KeysRequest(ns, "slow", K(chain), LONG, 0))
                if result.lease is not None:
                    open_leases.append(result.lease.lease_id)
        elif action == "abandon" and open_leases:
            engine.release("slow", [open_leases.pop(rng.randrange(len(open_leases)))])
        elif action == "corrupt":
            durable = [engine.disk_slot(block) for block in engine.namespace(ns).index if engine.disk_slot(block) != NO_SLOT]
            if durable:
                plane.corrupt.add(rng.choice(durable))
        engine.verify()
        for event in new_events(engine, ns, mirror.sequence):
            mirror.apply(event)
        tiers, parents = served(engine, ns)
        assert mirror.tiers == tiers, f"step {step} ({action} {chain})"
        assert mirror.parents == parents
    assert engine.events.published_events[TIER_CHANGED] > 0 and engine.events.published_events[REMOVED] > 0
    engine.close_all_leases()


def test_the_mirror_refuses_a_gap_and_an_event_that_does_not_fit():
    mirror = BlockMirror(EventSnapshot("i", 3, [key(1)], [b""], bytes([HOST])))
    log = EventLog()
    for _ in range(3):
        log.removed(A, key(9))
        log.flush()
    log.stored(A, [key(2)], key(1), HOST)
    log.flush()
    log.removed(A, key(7))
    log.flush()
    log.stored(A, [key(8)], b"", HOST)
    log.flush()
    fourth, fifth, sixth = log.read(A, 4, 3)
    with pytest.raises(ResyncRequired, match="event 5 follows event 3"):
        mirror.apply(fifth)
    mirror.apply(fourth)
    assert mirror.tiers == {key(1): HOST, key(2): HOST}
    with pytest.raises(ResyncRequired, match="does not hold"):
        mirror.apply(fifth)
    assert mirror.sequence == 4
