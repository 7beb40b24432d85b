"""Pins per client (the cap, its accounting) and the engine's counters by
tier (Get hits and misses, evictions by reason), read through the metrics.

Keys come from a one-token-per-block namespace: K("abc") are the keys of
the blocks "a", "ab", "abc". Every rejected call must leave the engine
exactly as it was (kvd.testing.engine_snapshot); every test's engines are
verified at teardown, which checks the pins charged to each client
against the handles its leases hold.
"""

from __future__ import annotations

import pytest

from kvd.core.engine import EngineLimits, TierId
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.policy import DiskPolicies
from kvd.errors import ResourceExhausted
from kvd.metrics import make_registry
from kvd.testing import engine_ops
from kvd.testing.engine_snapshot import snapshot
from kvd.core.requests import CommitRequest, KeysRequest

SPEC = NamespaceSpec(model_id="pins-test", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
LONG = 10_000


def K(chain: str) -> list[bytes]:
    return chain_keys(SPEC, [ord(ch) for ch in chain])


def put(engine, ns: bytes, chain: str, client: str = "writer") -> None:
    result = engine.reserve(KeysRequest(ns, client, K(chain), LONG, 0))
    if result.lease is not None:
        engine.commit(CommitRequest(ns, client, result.lease.lease_id, 0))
    engine.verify()


def refused(engine, method: str, *args) -> ResourceExhausted:
    """The call is refused with RESOURCE_EXHAUSTED and changes nothing."""
    before = snapshot(engine)
    rejections = engine.leases.pin_cap_rejections
    with pytest.raises(ResourceExhausted) as raised:
        getattr(engine, method)(*args)
    engine.verify()
    assert snapshot(engine) == before
    assert engine.leases.pin_cap_rejections == rejections + 1
    return raised.value


@pytest.fixture
def capped(engine_factory):
    engine = engine_factory(16, 64, limits=EngineLimits(max_pins_per_client=4))
    return engine, engine.register_namespace(SPEC).namespace_id


def test_a_get_past_the_pin_cap_is_refused_before_anything_changes(capped):
    engine, ns = capped
    put(engine, ns, "abcd")
    put(engine, ns, "abcdef")  # 2 new blocks and their pinned parent: under the cap
    lease, matched = engine_ops.get(engine, KeysRequest(ns, "reader", K("abc"), LONG, 0))
    assert len(matched) == 3 and engine.leases.pins_of("reader") == 3
    error = refused(engine, "begin_get", KeysRequest(ns, "reader", K("ab"), LONG, 0))
    assert "'reader' pins 3 blocks" in error.message and "2 more" in error.message
    assert "cap of 4 blocks per client (leases.max_pins_per_client)" in error.message
    # Exactly at the cap is allowed, and the cap is per client.
    engine_ops.get(engine, KeysRequest(ns, "reader", K("a"), LONG, 0))
    assert engine.leases.pins_of("reader") == 4
    _, other = engine_ops.get(engine, KeysRequest(ns, "other", K("abcd"), LONG, 0))
    assert len(other) == 4 and engine.leases.pins_of("other") == 4
    assert (engine.leases.pinning_clients(), engine.leases.max_client_pins(), engine.leases.pinned_total) == (2, 4, 8)
    # A Get that matches nothing pins nothing and is never refused.
    assert engine_ops.get(engine, KeysRequest(ns, "reader", K("xyz"), LONG, 0)) == (None, [])
    engine.release("reader", [lease.lease_id])
    assert engine.leases.pins_of("reader") == 1
    engine_ops.get(engine, KeysRequest(ns, "reader", K("abc"), LONG, 0))
    engine.verify()


def test_a_reserve_counts_every_missing_key_and_the_pinned_parent(capped):
    engine, ns = capped
    put(engine, ns, "ab")
    # "ab" stored: 4 missing keys after it, plus its parent "ab" pinned = 5.
    error = refused(engine, "reserve", KeysRequest(ns, "writer", K("abcdef"), LONG, 0))
    assert "pins 0 blocks" in error.message and "5 more" in error.message
    # A chain of stored keys only reserves nothing and pins nothing.
    assert engine.reserve(KeysRequest(ns, "writer", K("ab"), LONG, 0)).lease is None
    result = engine.reserve(KeysRequest(ns, "writer", K("abcde"), LONG, 0))
    assert engine.leases.pins_of("writer") == 4 == result.lease.pinned
    # Aborting the tail gives its pins back at once; sealing keeps them until the lease ends.
    engine.commit(CommitRequest(ns, "writer", result.lease.lease_id, 0, keys=[K("abcde")[2]],
                                abort_keys=[K("abcde")[4]]))
    engine.verify()
    assert engine.leases.pins_of("writer") == 3 == result.lease.pinned
    engine.release("writer", [result.lease.lease_id])
    assert engine.leases.pins_of("writer") == 0 and engine.leases.pinning_clients() == 0


def test_expired_leases_give_their_pins_back_and_the_blocks_become_evictable(engine_factory):
    """A client that died pins nothing once its leases' deadlines pass."""
    engine = engine_factory(4, 64, limits=EngineLimits(max_pins_per_client=8))
    ns = engine.register_namespace(SPEC).namespace_id
    put(engine, ns, "abcd")
    engine_ops.get(engine, KeysRequest(ns, "dead", K("abcd"), 100, 0))
    assert engine.leases.pins_of("dead") == 4 and engine.pinned_blocks == 4
    # Before the deadline the whole host tier is pinned: nothing can be evicted.
    with pytest.raises(ResourceExhausted, match="host tier is full"):
        engine.reserve(KeysRequest(ns, "writer", K("wx"), LONG, 99))
    assert engine.expire(now_ms=100) == 1
    assert (engine.leases.pins_of("dead"), engine.leases.pinning_clients(), engine.pinned_blocks) == (0, 0, 0)
    assert engine.leases.expired_total == 1
    put(engine, ns, "wx")
    engine.verify()
    assert len(engine.lookup(ns, K("abcd"))) == 2  # its tail was evicted, leaves first
    assert engine.host.counters.evictions == 2


def test_pin_metrics(capped):
    engine, ns = capped
    registry, _ = make_registry(engine)
    put(engine, ns, "abcd")
    engine_ops.get(engine, KeysRequest(ns, "r1", K("abc"), LONG, 0))
    engine_ops.get(engine, KeysRequest(ns, "r2", K("a"), LONG, 0))
    with pytest.raises(ResourceExhausted):
        engine_ops.get(engine, KeysRequest(ns, "r1", K("ab"), LONG, 0))
    value = registry.get_sample_value
    assert value("kvd_lease_pinned_blocks") == 4
    assert value("kvd_lease_clients") == 2
    assert value("kvd_lease_client_pinned_blocks_max") == 3
    assert value("kvd_lease_client_pin_cap_blocks") == 4
    assert value("kvd_lease_pin_cap_rejections_total") == 1


def test_get_hits_and_misses_by_tier_without_a_disk(engine_factory):
    engine = engine_factory(8, 64)
    ns = engine.register_namespace(SPEC).namespace_id
    registry, _ = make_registry(engine)
    put(engine, ns, "abc")
    lease, _ = engine_ops.get(engine, KeysRequest(ns, "r", K("abcde"), LONG, 0))  # 3 found, 2 not
    engine.release("r", [lease.lease_id])
    engine.lookup(ns, K("abcde"))  # Lookups are not Gets
    value = registry.get_sample_value
    assert value("kvd_tier_hits_total", {"tier": "host"}) == 3
    assert value("kvd_tier_misses_total", {"tier": "host"}) == 2
    assert value("kvd_tier_hits_total", {"tier": "disk"}) is None


@pytest.fixture
def tiered(engine_factory):
    """4 host slots, 8 disk slots; blocks go to disk when flushed."""
    engine = engine_factory(4, 64, disk_slot_count=8, disk_slot_bytes=64)
    ns = engine.register_namespace(SPEC).namespace_id
    engine.enable_disk(ns)
    return engine, ns


def flush(engine) -> None:
    """The daemon's write pipeline, every write succeeding."""
    writes = engine.pick_writes(100)
    removals = engine.take_disk_removals()
    engine.disk_removals_journalled([slot for _, _, slot in removals])
    engine.finish_writes(writes, [True] * len(writes))
    engine.verify()


def get(engine, ns: bytes, chain: str, client: str = "r") -> int:
    plan = engine.begin_get(KeysRequest(ns, client, K(chain), LONG, 0))
    engine.finish_loads(plan.loads, [True] * len(plan.loads))
    served = engine.settle_get(plan)
    if plan.lease is not None:
        engine.release(client, [plan.lease.lease_id])
    engine.verify()
    return len(served)


def test_a_get_of_disk_only_blocks_is_a_host_miss_and_a_disk_hit(tiered):
    engine, ns = tiered
    registry, _ = make_registry(engine)
    value = registry.get_sample_value
    put(engine, ns, "abcd")
    flush(engine)
    put(engine, ns, "wxyz")  # host full: abcd's copies are demoted to disk
    flush(engine)
    assert [engine.tier_of(block) for block in engine.lookup(ns, K("abcd"))] == [TierId.DISK] * 4
    assert get(engine, ns, "abcdef") == 4  # 4 read back from disk, 2 stored nowhere
    assert value("kvd_tier_hits_total", {"tier": "host"}) == 0
    assert value("kvd_tier_misses_total", {"tier": "host"}) == 6
    assert value("kvd_tier_hits_total", {"tier": "disk"}) == 4
    assert value("kvd_tier_misses_total", {"tier": "disk"}) == 2
    assert value("kvd_tier_moves_total", {"source_tier": "disk", "target_tier": "host"}) == 4
    assert get(engine, ns, "abcd") == 4  # now resident
    assert value("kvd_tier_hits_total", {"tier": "host"}) == 4
    assert value("kvd_tier_hits_total", {"tier": "disk"}) == 4
    # Per tier and per namespace agree: host hits + disk hits = Get hits.
    label = ns.hex()[:16]
    assert value("kvd_get_blocks_total", {"namespace": label, "result": "hit"}) == 8
    assert value("kvd_get_blocks_total", {"namespace": label, "result": "miss"}) == 2
    # wxyz made room for abcd: demoted, their disk copies kept.
    assert value("kvd_tier_evicted_blocks_total", {"tier": "host", "reason": "demoted"}) == 8
    assert value("kvd_tier_evicted_blocks_total", {"tier": "host", "reason": "dropped"}) == 0


def test_an_abandoned_get_plan_is_not_counted(tiered):
    engine, ns = tiered
    put(engine, ns, "abcd")
    flush(engine)
    put(engine, ns, "wxyz")
    flush(engine)
    before = (engine.host.counters.hits, engine.host.counters.misses, engine.disk.counters.hits,
              engine.disk.counters.misses, engine.namespace(ns).get_hits, engine.namespace(ns).get_misses)
    plan = engine.begin_get(KeysRequest(ns, "r", K("abcdef"), LONG, 0))
    assert len(plan.loads) == 4 and engine.disk.counters.hits == before[2] + 4
    engine.abandon_get(plan)
    engine.verify()
    assert (engine.host.counters.hits, engine.host.counters.misses, engine.disk.counters.hits,
            engine.disk.counters.misses, engine.namespace(ns).get_hits, engine.namespace(ns).get_misses) == before


def evicted_by(registry, tier: str):
    """reason -> blocks evicted from `tier` for it, as exported."""
    return lambda reason: registry.get_sample_value("kvd_tier_evicted_blocks_total", {"tier": tier, "reason": reason})


def test_host_evictions_by_reason_add_up(engine_factory):
    """4 host slots, admission after 2 sightings: on-demand evictions are
    demoted (disk copy), not_admitted (never written: seen once) or dropped
    (admitted, not yet written)."""
    engine = engine_factory(4, 64, disk_slot_count=8, disk_slot_bytes=64,
                            disk_policies=DiskPolicies(admission_min_hits=2))
    ns = engine.register_namespace(SPEC).namespace_id
    engine.enable_disk(ns)
    registry, _ = make_registry(engine)
    evicted = evicted_by(registry, "host")
    put(engine, ns, "ab")
    put(engine, ns, "ab")  # seen twice: admitted and queued for disk
    flush(engine)
    put(engine, ns, "cd")  # seen once: never admitted
    put(engine, ns, "ef")  # evicts ab's copies (demoted)
    assert (evicted("demoted"), evicted("not_admitted"), evicted("dropped")) == (2, 0, 0)
    put(engine, ns, "gh")  # evicts cd (never admitted)
    assert (evicted("demoted"), evicted("not_admitted"), evicted("dropped")) == (2, 2, 0)
    put(engine, ns, "gh")  # gh admitted, queued, not yet written
    put(engine, ns, "ef")
    put(engine, ns, "ij")  # evicts ef: admitted but not written, so dropped
    assert (evicted("demoted"), evicted("not_admitted"), evicted("dropped")) == (2, 2, 2)
    reasons = sum(evicted(reason) for reason in ("demoted", "not_admitted", "dropped"))
    assert reasons == registry.get_sample_value("kvd_tier_evictions_total", {"tier": "host"}) == 6
    assert evicted("demoted_background") == 0


def test_disk_evictions_by_reason(engine_factory):
    engine = engine_factory(4, 64, disk_slot_count=2, disk_slot_bytes=64)
    ns = engine.register_namespace(SPEC).namespace_id
    engine.enable_disk(ns)
    registry, _ = make_registry(engine)
    evicted = evicted_by(registry, "disk")
    put(engine, ns, "a")
    put(engine, ns, "b")
    flush(engine)
    put(engine, ns, "c")
    flush(engine)  # disk full: a leaf goes, its host copy kept
    assert (evicted("host_copy_kept"), evicted("dropped")) == (1, 0)
    put(engine, ns, "d")
    put(engine, ns, "e")
    put(engine, ns, "f")  # host full: some copies demoted, now only on disk
    flush(engine)
    disk = engine.disk.counters
    assert evicted("host_copy_kept") + evicted("dropped") == disk.evictions
    assert evicted("dropped") == disk.dropped
