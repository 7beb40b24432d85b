"""The engine with a disk tier: write-through, demotion, loads, loss, recovery.

Keys come from a one-token-per-block namespace, so a string names a chain
(K("abc") = keys of "a", "ab", "abc"). A small simulated data plane (`Plane`,
built on the simulator's kvd.sim.plane) moves fake block contents between
host slots and disk slots exactly as the daemon moves bytes, so the tests
can check the one property that matters: whatever a Get serves is the block
that was Put under that key.
"""

from __future__ import annotations

import contextlib
import random

import pytest

from kvd.core.block import NO_SLOT, BlockState
from kvd.core.engine import Engine, ReserveStatus, TierId
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.policy import DiskPolicies
from kvd.core.policy.promotion import AlwaysPromote
from kvd.errors import KvdError
from kvd.invariants import InvariantError
from kvd.sim.plane import SlotContents
from kvd.testing import engine_ops
from kvd.core.requests import CommitRequest, KeysRequest

SPEC = NamespaceSpec(model_id="disk-test", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
LONG = 10_000


def K(chain: str) -> list[bytes]:
    return chain_keys(SPEC, [ord(ch) for ch in chain])


def k(chain: str) -> bytes:
    return K(chain)[-1]


class Plane(SlotContents):
    """Fake bytes (kvd.sim.plane) behind one namespace with a disk tier."""

    def __init__(self, engine: Engine) -> None:
        super().__init__(engine)
        self.ns = engine.register_namespace(SPEC).namespace_id
        engine.enable_disk(self.ns)
        self.corrupt: set[int] = set()

    def put(self, chain: str, client: str = "w") -> int:
        keys = K(chain)
        result = self.engine.reserve(KeysRequest(self.ns, client, keys, LONG, 0))
        self.fill(keys, result.slots)
        if result.lease is None:
            return 0
        sealed, _, _ = self.engine.commit(CommitRequest(self.ns, client, result.lease.lease_id, 0))
        return sealed

    def flush(self, limit: int = 100, fail: set[bytes] = frozenset()) -> int:
        """Run the write-through pipeline once; keys in `fail` fail to write."""
        writes = self.engine.pick_writes(limit)
        # As the daemon must: journal the removals of evicted blocks before
        # new bytes go into their slots.
        self.journal_removals()
        self.engine.finish_writes(writes, self.write(writes, fail))
        self.journal_removals()
        # What the engine accepted as durable (a child whose parent failed
        # in the same batch is not, whatever its own write said).
        return sum(self.engine.disk_slot(write.block) == write.target_slot for write in writes)

    def get(self, chain: str, client: str = "r") -> list[bytes]:
        """A whole Get: plan, load from 'disk', settle, copy out, release."""
        plan = self.engine.begin_get(KeysRequest(self.ns, client, K(chain), LONG, 0))
        self.engine.finish_loads(plan.loads, self.load(plan.loads, self.corrupt))
        self.journal_removals()
        contents = self.served(self.engine.settle_get(plan))
        if plan.lease is not None:
            self.engine.release(client, [plan.lease.lease_id])
        return contents


@pytest.fixture
def plane(engine_factory):
    engine = engine_factory(4, 64, disk_slot_count=6, disk_slot_bytes=64)
    return Plane(engine)


def tiers(plane: Plane, chain: str) -> list[TierId]:
    return [plane.engine.tier_of(block) for block in plane.engine.lookup(plane.ns, K(chain))]


def test_write_through_makes_blocks_durable_parents_first(plane):
    assert plane.put("abc") == 3
    writes = plane.engine.pick_writes(10)
    assert [write.block.key for write in writes] == K("abc")
    # Slots are handed out in order, which stripes them over the drives.
    assert [write.target_slot for write in writes] == [0, 1, 2]
    plane.engine.finish_writes(writes, [True] * 3)
    plane.engine.verify()
    assert [plane.engine.disk_slot(block) for block in plane.engine.lookup(plane.ns, K("abc"))] == [0, 1, 2]
    assert tiers(plane, "abc") == [TierId.HOST] * 3


def test_host_eviction_demotes_durable_blocks_and_get_brings_them_back(plane):
    plane.put("abcd")
    plane.flush()
    plane.put("wxyz")  # 4 host slots: abcd's copies are demoted, not lost
    plane.engine.verify()
    assert tiers(plane, "abcd") == [TierId.DISK] * 4
    assert plane.engine.host.counters.demotions == 4
    assert plane.get("abcd") == K("abcd")
    plane.engine.verify()
    assert tiers(plane, "abcd") == [TierId.HOST] * 4
    assert plane.engine.disk.counters.loaded == 4


def test_dirty_blocks_are_dropped_from_the_tail(plane):
    plane.put("abcd")  # never flushed
    plane.put("wx")
    plane.engine.verify()
    # The two oldest leaves went: abcd lost its tail, nothing went to disk.
    assert len(plane.engine.lookup(plane.ns, K("abcd"))) == 2
    assert plane.engine.disk.pool.resident_blocks == 0


def test_a_corrupt_block_is_never_served_and_takes_its_descendants(plane):
    plane.put("abcd")
    plane.flush()
    plane.put("wxyz")
    corrupt = plane.engine.disk_slot(plane.engine.lookup(plane.ns, K("ab"))[-1])
    plane.corrupt.add(corrupt)
    assert plane.get("abcd") == K("a")
    plane.engine.verify()
    assert len(plane.engine.lookup(plane.ns, K("abcd"))) == 1
    assert plane.engine.disk.counters.load_failures == 1
    # The bad block and its descendants were removed; their disk slots were
    # journalled as removed and are free again.
    assert plane.engine.namespace(plane.ns).index.get(k("abc")) is None
    assert len(plane.engine.disk.pool.free_slots) == 6 - 1  # only "a" keeps its copy (wxyz never flushed)
    assert plane.put("abcd") == 3


def test_a_failed_write_is_retried_never_and_its_children_stay_host_only(plane):
    plane.put("abc")
    assert plane.flush(fail={k("ab")}) == 1
    plane.engine.verify()
    blocks = plane.engine.lookup(plane.ns, K("abc"))
    assert [plane.engine.disk_slot(block) != NO_SLOT for block in blocks] == [True, False, False]
    # Nothing durable hangs under a non-durable parent.
    assert plane.engine.disk.counters.write_failures == 2


def test_disk_eviction_is_clock_over_index_leaves(plane):
    for chain in ("ab", "cd", "ef"):
        plane.put(chain)
        plane.flush()
    assert plane.engine.disk.pool.resident_blocks == 6
    plane.put("gh")
    plane.flush()
    plane.engine.verify()
    # Two leaves made room; every durable block still has a durable parent.
    assert plane.engine.disk.counters.evictions == 2
    assert plane.engine.disk.pool.resident_blocks == 6


def test_a_disk_full_of_one_chain_gives_its_tail_up_for_another_while_the_host_keeps_it(engine_factory):
    """A block whose children have no disk copy may lose its own disk copy
    if it has another: a full disk of one long chain makes room for the next
    chain from its tail inward, and never frees a slot that a write in the
    same batch needs as a parent."""
    plane = Plane(engine_factory(16, 64, disk_slot_count=4, disk_slot_bytes=64))
    assert plane.put("abcd") == 4 and plane.flush() == 4
    assert plane.put("wxyz") == 4 and plane.flush() == 4
    engine = plane.engine
    assert [engine.disk_slot(block) != NO_SLOT for block in engine.lookup(plane.ns, K("wxyz"))] == [True] * 4
    # "abcd" left the disk from its tail, and is whole in host memory.
    assert [engine.disk_slot(block) != NO_SLOT for block in engine.lookup(plane.ns, K("abcd"))] == [False] * 4
    assert plane.get("abcd") == K("abcd") and plane.get("wxyz") == K("wxyz")
    assert engine.disk.counters.evictions == 4 and engine.disk.counters.write_failures == 0
    engine.verify()


def test_tier_bytes_say_what_tier_of_says_while_blocks_are_read_in(plane):
    """Lookup's tier report for a whole prefix in one pass: a block whose host
    copy is still being read in is reported in the tier it is read from."""
    engine = plane.engine
    for chain in ("ab", "cd", "ef"):
        plane.put(chain)
        plane.flush()
    plan = engine.begin_get(KeysRequest(plane.ns, "r", K("ab"), LONG, 0))
    assert plan.loads and all(load.block in engine.loading for load in plan.loads)
    everything = [block for chain in ("ab", "cd", "ef") for block in engine.lookup(plane.ns, K(chain))]
    per_block = [engine.tier_of(block) for block in everything]
    assert engine.tier_bytes(everything) == bytes(int(tier) for tier in per_block)
    assert TierId.DISK in per_block and TierId.HOST in per_block
    engine.finish_loads(plan.loads, plane.load(plan.loads, set()))
    engine.settle_get(plan)
    engine.release("r", [plan.lease.lease_id])
    assert engine.tier_bytes(engine.lookup(plane.ns, K("ab"))) == bytes([int(TierId.HOST)] * 2)


def test_recovery_rebuilds_the_index_and_drops_orphans(engine_factory):
    engine = engine_factory(4, 64, disk_slot_count=8, disk_slot_bytes=64)
    ns = engine.register_namespace(SPEC).namespace_id
    keys = K("abcd")
    records = [
        (keys[3], keys[2], 3),
        (keys[1], keys[0], 1),
        (keys[0], b"", 0),
        (keys[2], keys[1], 2),
        (k("x" * 2), k("x"), 5),  # parent never written: an orphan
        (k("q"), b"", 99),  # slot out of range
    ]
    assert engine.recover(ns, records) == 4
    engine.verify()
    assert [engine.tier_of(block) for block in engine.lookup(ns, keys)] == [TierId.DISK] * 4
    removals = engine.take_disk_removals()
    assert [(key, slot) for _, key, slot in removals] == [(k("xx"), 5)]
    engine.disk_removals_journalled([5])
    assert sorted(engine.disk.pool.free_slots) == [4, 5, 6, 7]
    assert engine.disk.counters.recovery_dropped == 2


POLICY_VARIANTS = {
    "lru": {},
    "s3fifo": {"policy": "s3fifo"},
    "admit-after-2": {"disk_policies": DiskPolicies(admission_min_hits=2)},
}


@pytest.mark.parametrize("variant", POLICY_VARIANTS)
@pytest.mark.parametrize("seed", range(25))
def test_random_operations_never_serve_a_wrong_block(engine_factory, seed, variant):
    """Puts, flushes (some failing), Gets (some loads corrupt), deletes and
    lease expiry in random order: every served block is the one put under
    its key, and the engine's invariants hold after every step."""
    rng = random.Random(seed)
    engine = engine_factory(5, 64, disk_slot_count=7, disk_slot_bytes=64, **POLICY_VARIANTS[variant])
    plane = Plane(engine)
    chains = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 5))) for _ in range(12)]
    for _ in range(120):
        chain = rng.choice(chains)
        action = rng.random()
        try:
            if action < 0.35:
                plane.put(chain, client=f"w{rng.randint(0, 2)}")
            elif action < 0.55:
                fail = {key for key in K(chain) if rng.random() < 0.2}
                plane.flush(rng.randint(1, 4), fail)
            elif action < 0.85:
                if rng.random() < 0.3 and plane.disk:
                    plane.corrupt.add(rng.choice(sorted(plane.disk)))
                served = plane.get(chain)
                assert served == K(chain)[: len(served)]
            elif action < 0.95:
                engine.delete(plane.ns, [rng.choice(K(chain))])
                plane.journal_removals()
            else:
                lease_holder = engine.begin_get(KeysRequest(plane.ns, "sleeper", K(chain), 5, 0))
                if lease_holder.loads:
                    engine.finish_loads(lease_holder.loads, [True] * len(lease_holder.loads))
                    for load in lease_holder.loads:
                        plane.host[load.target_slot] = plane.disk[load.source_slot]
                if lease_holder.loads or lease_holder.waits:
                    engine.settle_get(lease_holder)  # (as the daemon's Get task always does)
                engine.expire(10)
        except KvdError:
            pass  # e.g. the host tier full of pins: a refusal, checked elsewhere
        engine.verify()
        # Corrupt slots that were dropped may be rewritten with good data.
        plane.corrupt &= {engine.disk_slot(block) for block in engine.namespace(plane.ns).index} - {NO_SLOT}
    engine.close_all_leases()
    engine.verify()
    assert engine.live_handles == 0 and engine.pinned_blocks == 0
    assert all(block.state != BlockState.LOST for block in engine.namespace(plane.ns).index)


# ----------------------------------------------------------------------
# Disk admission (disk.admission_min_hits) and promotion (disk.promotion)


@pytest.fixture
def picky(engine_factory):
    """Blocks go to disk only once seen twice."""
    engine = engine_factory(4, 64, disk_slot_count=6, disk_slot_bytes=64,
                            disk_policies=DiskPolicies(admission_min_hits=2))
    return Plane(engine)


def durable(plane: Plane, chain: str) -> list[bool]:
    return [plane.engine.disk_slot(block) != NO_SLOT for block in plane.engine.lookup(plane.ns, K(chain))]


def test_with_min_hits_2_a_block_is_written_once_it_is_used_again(picky):
    assert picky.put("abc") == 3
    assert list(picky.engine.write_queue) == [] and picky.flush() == 0
    picky.engine.lookup(picky.ns, K("abc"))  # a Lookup is not a use
    assert picky.flush() == 0
    assert picky.get("ab") == K("ab")  # a Get is: a and ab qualify, parents first
    assert [block.key for block in picky.engine.write_queue] == K("ab")
    assert picky.flush() == 2
    assert durable(picky, "abc") == [True, True, False]
    # A Put of a stored block is a use too.
    assert picky.engine.reserve(KeysRequest(picky.ns, "w", K("abc"), LONG, 0)).statuses[-1] == ReserveStatus.EXISTS
    assert picky.flush() == 1
    assert durable(picky, "abc") == [True, True, True]
    assert picky.engine.disk.counters.admission_rejected == 0


def test_blocks_the_filter_turned_away_are_dropped_by_eviction_and_counted(picky):
    picky.put("ab")
    picky.put("xy")
    assert picky.flush() == 0
    picky.put("pq")  # the host tier is full: ab goes, tail first, unwritten
    assert picky.engine.lookup(picky.ns, K("ab")) == []
    assert picky.engine.disk.counters.admission_rejected == 2
    assert picky.engine.host.counters.demotions == 0 and picky.engine.disk.pool.resident_blocks == 0


def test_dirty_blocks_the_filter_admitted_are_not_counted_as_turned_away(plane):
    plane.put("abcd")  # admitted (min_hits 1) but never flushed
    plane.put("wx")
    assert len(plane.engine.lookup(plane.ns, K("abcd"))) == 2
    assert plane.engine.disk.counters.admission_rejected == 0


def test_a_durable_request_writes_what_the_filter_turned_away(picky):
    picky.put("abc")
    assert picky.flush() == 0
    leaf = picky.engine.lookup(picky.ns, K("abc"))[-1]
    picky.engine.require_durable([leaf])  # ACK_DURABLE: the whole prefix, parents first
    assert [block.key for block in picky.engine.write_queue] == K("abc")
    assert picky.flush() == 3
    picky.engine.require_durable([leaf])  # durable already: nothing to queue
    assert list(picky.engine.write_queue) == []


def test_a_block_queued_twice_is_written_once(picky):
    picky.put("a")
    picky.engine.require_durable(picky.engine.lookup(picky.ns, K("a")))
    assert picky.get("a") == K("a")  # qualifies now: queued again
    assert [block.key for block in picky.engine.write_queue] == K("a") * 2
    assert picky.flush() == 1
    assert picky.engine.disk.pool.resident_blocks == 1 and not picky.engine.write_queue


def test_require_durable_queues_nothing_with_the_filter_off(plane):
    plane.put("abc")  # queued at seal
    plane.engine.require_durable(plane.engine.lookup(plane.ns, K("abc")))
    assert [block.key for block in plane.engine.write_queue] == K("abc")


class NeverPromote:
    name = "never"

    def promote(self, block) -> bool:
        return False


def test_a_declined_promotion_cuts_the_get_before_the_block(plane):
    plane.put("abcd")
    plane.flush()
    plane.put("wx")  # c and d demoted: only on disk
    assert tiers(plane, "abcd") == [TierId.HOST, TierId.HOST, TierId.DISK, TierId.DISK]
    plane.engine.disk.promotion = NeverPromote()
    plan = plane.engine.begin_get(KeysRequest(plane.ns, "r", K("abcd"), LONG, 0))
    assert plan.matched == plane.engine.lookup(plane.ns, K("ab")) and not plan.loads and not plan.starved
    plane.engine.release("r", [plan.lease.lease_id])
    plane.engine.disk.promotion = AlwaysPromote()
    assert plane.get("abcd") == K("abcd")


def test_watermarks_reclaim_with_hysteresis_and_puts_then_evict_nothing(engine_factory):
    """10 host slots, watermarks 0.8 / 0.5: from 8 resident blocks on the
    host reclaims (writes back, demotes durable blocks) down to 5, and stays
    reclaiming until it gets there; a Put after that takes free slots."""
    plane = Plane(engine_factory(10, 64, disk_slot_count=32, disk_slot_bytes=64,
                                 high_watermark=0.8, low_watermark=0.5))
    engine = plane.engine
    plane.put("abcdefg")  # 7 of 10
    assert not engine.host_reclaiming()
    plane.put("abcdefgh")  # 8: the high watermark
    assert engine.host_reclaiming()
    # Nothing is durable yet: demotion stops at the first dirty candidate.
    assert engine.demote_to_low_watermark() == 0 and engine.host_reclaiming()
    assert plane.flush() == 8
    assert engine.demote_to_low_watermark() == 3  # 8 -> 5, from the tail of the chain inward
    assert engine.host.pool.resident_blocks == 5 and not engine.host_reclaiming()
    assert tiers(plane, "abcdefgh") == [TierId.HOST] * 5 + [TierId.DISK] * 3
    assert engine.host.counters.background_demotions == 3
    # Back below high: no reclaiming at 7 resident, though above low.
    plane.put("xy")
    assert engine.host.pool.resident_blocks == 7 and not engine.host_reclaiming()
    evictions = engine.host.counters.evictions
    plane.put("xyz")
    assert engine.host.counters.evictions == evictions  # a free slot, no eviction on demand
    plane.flush()
    assert plane.get("abcdefgh") == K("abcdefgh")  # demoted blocks come back bit-exact
    engine.verify()


def test_demote_all_drops_every_durable_unpinned_host_copy_and_keeps_the_rest(engine_factory):
    """A tree (abcd and abxy share "ab"): with every block durable, both
    branches go and then their common prefix, root included. A lease keeps
    its blocks and their ancestors; a block not yet written keeps its copy
    and its ancestors theirs. Every demoted block comes back bit-exact."""
    plane = Plane(engine_factory(12, 64, disk_slot_count=32, disk_slot_bytes=64))
    engine = plane.engine
    plane.put("abcd")
    plane.put("abxy")
    assert plane.flush() == 6
    plane.put("pq")  # never written: its only copy is in host memory
    lease, held = engine_ops.get(engine, KeysRequest(plane.ns, "holder", K("abxy")[:3], LONG, 0))
    assert len(held) == 3
    each = engine.namespace(plane.ns).block_bytes
    assert engine_ops.demote_all(engine) == (3, 3 * each)  # d, c and y; x is held, so a and b stay too
    assert tiers(plane, "abcd") == [TierId.HOST, TierId.HOST, TierId.DISK, TierId.DISK]
    assert tiers(plane, "abxy") == [TierId.HOST] * 3 + [TierId.DISK]
    assert tiers(plane, "pq") == [TierId.HOST] * 2
    engine.release("holder", [lease.lease_id])
    assert engine_ops.demote_all(engine) == (3, 3 * each)  # x, then b and a once neither branch holds them
    assert tiers(plane, "abxy") == [TierId.DISK] * 4 and tiers(plane, "abcd") == [TierId.DISK] * 4
    assert engine.host.pool.resident_blocks == 2 and engine.host.counters.requested_demotions == 6
    assert engine_ops.demote_all(engine) == (0, 0)
    engine.verify()
    assert plane.get("abcd") == K("abcd") and plane.get("abxy") == K("abxy")
    engine.verify()


def test_watermarks_are_checked(engine_factory):
    with pytest.raises(InvariantError, match="watermarks"):
        engine_factory(10, 64, high_watermark=0.5, low_watermark=0.5)


def test_a_get_lease_that_expires_during_its_disk_reads_leaves_their_slots_pinned():
    """Found in review: the blocks a Get reads in were pinned by its lease
    only. When the lease expired (or was released) while the reads were in
    flight, those blocks became eviction candidates, and a Put could take
    their host slots while the disk thread was still writing into them. Each
    read now holds its own pin until it ends."""
    engine = Engine(host_slot_count=4, host_slot_bytes=1 << 10, disk_slot_count=16, disk_slot_bytes=1 << 10)
    plane = Plane(engine)
    plane.put("abcd")
    plane.flush()
    plane.put("wxyz")  # the host tier is full of these: abcd is on disk only
    plane.flush()
    assert [engine.tier_of(block) for block in engine.lookup(plane.ns, K("abcd"))] == [TierId.DISK] * 4
    plan = engine.begin_get(KeysRequest(plane.ns, "r", K("abcd"), 10, 0))
    assert len(plan.loads) == 4
    slots = {load.target_slot for load in plan.loads}
    engine.expire(1_000)  # the Get's lease runs out while its reads are in flight
    assert plan.lease.ended
    engine.verify()
    # No Put can take those slots now: every host slot is being read into.
    with pytest.raises(KvdError):
        engine.reserve(KeysRequest(plane.ns, "w", K("q"), LONG, 1_000))
    engine.finish_loads(plan.loads, plane.load(plan.loads))
    engine.verify()
    # Settling after the lease ended is a normal end: nothing served, the request's pins go.
    assert engine.settle_get(plan) == [] and plan.lease.ended
    engine.verify()
    # Read in and unpinned: ordinary candidates now, still holding their own bytes.
    assert {engine.host_slot(block) for block in engine.lookup(plane.ns, K("abcd"))} == slots
    assert plane.served(engine.lookup(plane.ns, K("abcd"))) == K("abcd")


def test_a_get_whose_lease_ends_while_it_waits_keeps_its_blocks_until_it_settles(plane):
    """Get B waits on a block Get A is reading in; A finishes; B's lease then
    ends (its client released it, or it expired) before B settles. The block
    must stay put until B settles: before, B's lease was its only pin, so the
    block was evicted and read in again for Get C, and B's settle found it
    loading (InvariantError: settle_get before the loads finished)."""
    engine = plane.engine
    plane.put("ab")
    plane.flush()
    plane.put("wxyz")  # 4 host slots: ab is on disk only
    assert tiers(plane, "ab") == [TierId.DISK] * 2
    a = engine.begin_get(KeysRequest(plane.ns, "a", K("ab"), LONG, 0))
    b = engine.begin_get(KeysRequest(plane.ns, "b", K("ab"), 10, 0))
    assert len(a.loads) == 2 and b.waits == [load.block for load in a.loads]
    engine.finish_loads(a.loads, plane.load(a.loads, set()))
    assert engine.settle_get(a) == a.matched
    engine.release("a", [a.lease.lease_id])
    engine.expire(1_000)  # B's lease runs out while B is still waiting to settle
    assert b.lease.ended
    # Host pressure, and another Get of the same blocks: nothing may move them now.
    with contextlib.suppress(KvdError):
        plane.put("pqrs")
    c = engine.begin_get(KeysRequest(plane.ns, "c", K("ab"), LONG, 1_000))
    assert not c.loads
    engine.verify()
    assert engine.settle_get(b) == []  # settling after the lease ended: a normal end, nothing served
    engine.verify()
    assert engine.settle_get(c) == c.matched and plane.served(c.matched) == K("ab")
    engine.release("c", [c.lease.lease_id])
    engine.verify()


def test_a_get_whose_prefetch_was_dropped_and_read_again_for_another_get_settles_short(plane):
    """Get B waits on a prefetch of its blocks; the prefetch is dropped unread
    (shutdown of its job, or a read job given up) and Get C starts reading the
    same blocks in before B resumes. B's settle must not serve them (their
    bytes are not there yet) and must not fail a check: it serves the prefix
    before them. The soak test found this with GetLayers under Demote churn."""
    engine = plane.engine
    plane.put("ab")
    plane.flush()
    plane.put("wxyz")
    engine.delete(plane.ns, K("wxyz")[1:2])  # frees x, y, z: room for a prefetch, which never evicts
    plane.journal_removals()
    prefetch = engine.begin_prefetch(plane.ns, K("ab"), b"", 16)
    assert len(prefetch.loads) == 2
    b = engine.begin_get(KeysRequest(plane.ns, "b", K("ab"), LONG, 0))
    assert b.waits == [load.block for load in prefetch.loads] and not b.loads
    engine.abandon_prefetch(prefetch.loads)
    c = engine.begin_get(KeysRequest(plane.ns, "c", K("ab"), LONG, 0))
    assert len(c.loads) == 2  # pinned by B, but on disk only: read in again, for C
    engine.verify()
    assert engine.settle_get(b) == []
    engine.finish_loads(c.loads, plane.load(c.loads, set()))
    assert plane.served(engine.settle_get(c)) == K("ab")
    engine.release("c", [c.lease.lease_id])
    engine.verify()
