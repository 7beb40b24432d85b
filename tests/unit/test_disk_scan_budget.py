"""A writer turn's victim searches are bounded (issue 35 item 7): CLOCK with a scan budget.

A disk search used to sweep up to twice the whole disk in one call when
most slots held blocks that may not go (1.5 s at a million slots). Now a
turn may look at `scan_slots_per_turn` slots in all; a search cut short
gives "full for now", and the next turn goes on where the hand stopped.
Checked here: the bound, that nothing that may not go is ever evicted,
that a lone evictable block far from the hand is still reached within a
few turns, and that a tenant at its disk quota is refused only once its
searches have covered the disk.
"""

from __future__ import annotations

import random

from kvd.core.block import NO_SLOT
from kvd.core.engine import Engine
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.policy import ScanBudget
from kvd.core.policy.clock import ClockPolicy
from kvd.core.quota import TenantQuota
from kvd.core.requests import CommitRequest, KeysRequest

SLOT = 64
LONG = 10_000


def K(chain: str) -> list[bytes]:
    return chain_keys(SPEC, [ord(ch) for ch in chain])


SPEC = NamespaceSpec(model_id="scan-test", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)


# ----------------------------------------------------------------------
# The policy alone


class Looks:
    """An evictable() that counts its calls and wants only some owners."""

    def __init__(self, wanted) -> None:
        self.wanted = wanted
        self.calls = 0

    def __call__(self, block) -> bool:
        self.calls += 1
        return block in self.wanted


def test_a_search_looks_at_no_more_than_its_budget_and_the_next_goes_on_from_there():
    policy = ClockPolicy(1000)
    owners = [f"block {slot}" for slot in range(1000)]
    looks = Looks({owners[900]})
    found = []
    for _ in range(4):
        budget = ScanBudget(256)
        found.append(policy.victim(owners, set(), looks, budget))
        assert budget.left == (0 if found[-1] is None else 1024 - 901)
    # Slots 0..899 in three and a half searches; the fourth reaches 900.
    assert found == [None, None, None, owners[900]]
    assert looks.calls == 901 and policy.hand == 901


def test_a_referenced_block_far_from_the_hand_is_taken_on_the_next_sweep_within_a_few_searches():
    policy = ClockPolicy(1000)
    owners = [f"block {slot}" for slot in range(1000)]
    policy.touch(900)
    looks = Looks({owners[900]})
    searches = 0
    victim = None
    while victim is None:
        searches += 1
        assert searches <= 2 * 1000 // 256 + 1
        victim = policy.victim(owners, set(), looks, ScanBudget(256))
    # Its bit is cleared on the first pass, it goes on the second: 1,901 looks.
    assert victim == owners[900] and looks.calls == 1901 and searches == 8


def test_a_whole_budget_finds_what_two_sweeps_find_and_an_empty_one_looks_at_nothing():
    policy = ClockPolicy(10)
    owners = [None, "a", "b", None, "c", "d", "e", "f", "g", "h"]
    looks = Looks({"e"})
    assert policy.victim(owners, {6}, looks, ScanBudget(0)) is None and looks.calls == 0
    budget = ScanBudget(1000)
    assert policy.victim(owners, {6}, looks, budget) is None  # "e" is busy
    assert budget.left == 1000 - 20 and policy.hand == 0
    assert policy.victim(owners, set(), looks, ScanBudget(1000)) == "e"


def test_random_searches_never_return_what_may_not_go():
    rng = random.Random(7)
    policy = ClockPolicy(64)
    for _ in range(2000):
        owners = [rng.choice([None, *range(8)]) for _ in range(64)]
        busy = set(rng.sample(range(64), rng.randint(0, 8)))
        wanted = set(rng.sample(range(8), rng.randint(0, 2)))
        if rng.random() < 0.3:
            policy.touch(rng.randrange(64))
        hand = policy.hand
        budget = ScanBudget(rng.randint(0, 160))
        left = budget.left
        victim = policy.victim(owners, busy, Looks(wanted), budget)
        looked = left - budget.left
        assert 0 <= looked <= min(left, 128)
        assert policy.hand == (hand + looked) % 64
        if victim is not None:
            slot = (policy.hand - 1) % 64
            assert owners[slot] == victim and victim in wanted and slot not in busy
        policy.verify()


# ----------------------------------------------------------------------
# The writer's turns over a disk where almost nothing may go


class Disk:
    """An engine with a full disk, and the writer's turns as the daemon runs them."""

    def __init__(self, disk_slots: int, quotas=()) -> None:
        self.engine = Engine(host_slot_count=4 * disk_slots, host_slot_bytes=SLOT, disk_slot_count=disk_slots,
                             disk_slot_bytes=SLOT, tenant_quotas=quotas)
        self.writeback = self.engine.writebacks[self.engine.disk]
        self.looks = 0
        evictable = self.writeback.evictable

        def counted(block) -> bool:
            self.looks += 1
            return evictable(block)

        self.writeback.evictable = counted

    def namespace(self, tenant: str = "") -> bytes:
        spec = NamespaceSpec(model_id="scan-test", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1,
                             tenant=tenant)
        namespace_id = self.engine.register_namespace(spec).namespace_id
        self.engine.enable_disk(namespace_id)
        return namespace_id

    def put(self, namespace_id: bytes, keys: list[bytes], parent_key: bytes = b"") -> None:
        result = self.engine.reserve(KeysRequest(namespace_id, "w", keys, LONG, 0, parent_key=parent_key))
        self.engine.commit(CommitRequest(namespace_id, "w", result.lease.lease_id, 0))

    def turn(self, limit: int = 64) -> list[bytes]:
        """One writer turn: its picks' removals journalled, the writes landed; the keys written."""
        self.looks = 0
        writes = self.engine.pick_writes(limit)
        removals = self.engine.take_disk_removals()
        self.engine.finish_writes(writes, [True] * len(writes))
        self.engine.disk_removals_journalled([slot for _, _, slot in removals])
        self.engine.verify()
        return [write.block.key for write in writes]


def full_of_one_chain(slots: int):
    """A disk filled by one chain (each block has a child on it but the last, which is pinned), a
    search budget of 300 slots a turn, and block "b" waiting to be written: (disk, namespace, the chain,
    the tail's pin)."""
    disk = Disk(disk_slots=slots)
    ns = disk.namespace()
    chain = K("a" * slots)
    disk.put(ns, chain)
    while disk.turn(limit=500):
        pass
    assert disk.engine.disk.pool.resident_blocks == slots
    tail = disk.engine.pin(disk.engine.namespace(ns).index.get(chain[-1]))
    disk.writeback.scan_slots_per_turn = 300
    disk.put(ns, K("b"))
    return disk, ns, chain, tail


def test_a_turn_looks_at_no_more_slots_than_its_budget_and_a_lone_victim_far_away_still_goes():
    disk, ns, chain, tail = full_of_one_chain(2000)
    for _ in range(20):
        assert disk.turn() == []
        assert disk.looks == 300  # the old search looked at all 4,000 twice-swept slots in one turn
    # Unpinned, the tail (the slot before the hand's start) may go: it is found within a few turns.
    tail.release()
    turns = 1
    while not (written := disk.turn()):
        turns += 1
        assert turns <= 2 * 2000 // 300 + 1
    assert written == K("b")
    assert disk.engine.disk_slot(disk.engine.namespace(ns).index.get(chain[-1])) == NO_SLOT
    assert disk.engine.disk.counters.evictions == 1


def test_a_tenant_at_its_disk_quota_is_refused_only_once_its_searches_covered_the_disk():
    quota = TenantQuota("a", disk_limit_bytes=1000 * SLOT)
    disk = Disk(disk_slots=1000, quotas=[quota])
    ns = disk.namespace("a")
    chain = K("a" * 1000)
    disk.put(ns, chain)
    while disk.turn(limit=500):
        pass
    assert quota.disk_used_bytes == 1000 * SLOT
    pinned = disk.engine.pin(disk.engine.namespace(ns).index.get(chain[-1]))
    disk.writeback.scan_slots_per_turn = 300
    disk.put(ns, K("b"))
    # Its own blocks may not go: the block waits at the queue's head while the
    # searches go on (2 x 1,000 slots at 300 a turn), and is then refused.
    refusals = []
    for _ in range(8):
        assert disk.turn() == []
        refusals.append(quota.counters.disk_refused)
    assert refusals == [0, 0, 0, 0, 0, 0, 1, 1]
    assert len(disk.engine.write_queue) == 0
    # Known to be full, the tenant's next block is refused after one turn's search...
    disk.put(ns, K("c"))
    assert disk.turn() == [] and quota.counters.disk_refused == 2
    # ... and so are its blocks while the searches go on, until one finds a block that may go.
    pinned.release()
    turns = 0
    while True:
        disk.put(ns, K(chr(0x100 + turns)))  # one new root block a turn
        if written := disk.turn():
            break
        turns += 1
        assert turns <= 2 * 1000 // 300 + 1
    assert written == K(chr(0x100 + turns))
    assert quota.counters.disk_refused == 2 + turns and quota.counters.disk_evicted == 1


def test_the_writer_is_told_to_go_on_at_once_while_searches_are_cut_short_and_to_wait_once_they_cover_the_disk():
    from kvd.core.mover import Mover, MoverSettings

    disk, _, _, pinned = full_of_one_chain(1000)
    mover = Mover(disk.engine, MoverSettings(write_mode="through"))
    searching = []
    for _ in range(9):
        assert mover.next_round() is None
        mover.verify()
        searching.append(mover.searching())
    # 300 looks a turn: after 7 turns (2,100 looks) two sweeps of 1,000 slots found nothing.
    assert searching == [True] * 6 + [False] * 3
    # Nothing to write (write-back, no pressure): not searching either.
    mover.settings = MoverSettings(write_mode="back")
    assert mover.next_round() is None and not mover.searching()
    pinned.release()
