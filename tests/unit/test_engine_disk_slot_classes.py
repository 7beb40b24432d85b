"""Slot size classes in the disk tier's bookkeeping: write-back puts each
block in a slot of its namespace's class, a class short of slots takes a
free page, then its own oldest block's slot, then a page of another class
emptied leaves first (its old slots' REMOVEs journalled before the new
bytes); recovery gives each page the class its records name; tenants'
disk quotas count the bytes of their slots.

Host memory is large here: only the disk runs short. Disk: 8 pages of
64 KiB with classes of 64, 32 and 16 KiB.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvd.core.block import NO_SLOT
from kvd.core.engine import CommitRequest, Engine, KeysRequest
from kvd.core.keys import NamespaceSpec
from kvd.core.quota import TenantQuota
from kvd.core.slot_pool import NO_CLASS
from kvd.testing.chains import text_chain as keys
from tests.unit.test_engine_slot_classes import BIG, LONG, PAGE, PAGES, SMALL


class Rig:
    def __init__(self, quotas=()) -> None:
        self.engine = Engine(host_slot_count=256, host_slot_bytes=PAGE, host_min_slot_bytes=16 << 10,
                             disk_slot_count=PAGES, disk_slot_bytes=PAGE, disk_min_slot_bytes=16 << 10,
                             tenant_quotas=quotas)
        self.ns = {}
        for spec in (BIG, SMALL):
            tenant = spec.model_id if quotas else ""
            self.ns[spec.model_id] = self.engine.register_namespace(
                dataclasses.replace(spec, tenant=tenant)).namespace_id
            self.engine.enable_disk(self.ns[spec.model_id])
        self.journal: list[tuple[str, object]] = []

    def put(self, spec: NamespaceSpec, chain: str) -> int:
        request = KeysRequest(self.ns[spec.model_id], "w", keys(spec, chain), LONG, 0)
        result = self.engine.reserve(request)
        if result.lease is None:
            return 0  # stored already
        sealed, _, _ = self.engine.commit(CommitRequest(request.namespace_id, "w", result.lease.lease_id, 0))
        return sealed

    def write_back(self) -> int:
        """One write round as the disk plane runs it: removals journalled, then the bytes written."""
        engine = self.engine
        writes = engine.pick_writes(64)
        removals = engine.take_disk_removals()
        self.journal.append(("remove", [slot for _, _, slot in removals]))
        engine.disk_removals_journalled([slot for _, _, slot in removals])
        self.journal.append(("write", [write.target_slot for write in writes]))
        engine.finish_writes(writes, [True] * len(writes))
        return len(writes)

    def on_disk(self, spec: NamespaceSpec, chain: str) -> int:
        engine = self.engine
        state = engine.namespace(self.ns[spec.model_id])
        return sum(engine.disk_slot(state.index.nodes[key]) != NO_SLOT
                   for key in keys(spec, chain) if key in state.index.nodes)

    def check(self) -> None:
        """verify(), each disk copy in a slot of its namespace's class, no two overlapping."""
        engine = self.engine
        engine.verify()
        pool = engine.disk.pool
        spans = []
        for state in engine.namespaces():
            wanted = pool.class_for(state.block_bytes)
            for block in state.index:
                slot = engine.disk_slot(block)
                if slot != NO_SLOT:
                    assert pool.class_of(slot) is wanted
                    spans.append((pool.offset_of(slot), pool.offset_of(slot) + pool.slot_bytes_of(slot)))
        spans.sort()
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "two blocks share bytes"


def test_small_blocks_pack_four_to_a_disk_page():
    rig = Rig()
    assert rig.put(SMALL, "abcdefgh") == 8 and rig.put(BIG, "abc") == 3
    while rig.write_back():
        pass
    assert rig.on_disk(SMALL, "abcdefgh") == 8 and rig.on_disk(BIG, "abc") == 3
    pool = rig.engine.disk.pool
    assert pool.page_class.tolist().count(2) == 2 and pool.page_class.tolist().count(0) == 3  # 2 + 3 of 8 pages
    rig.check()


def test_a_full_disk_gives_a_page_of_another_class_emptied_leaves_first_with_removals_before_writes():
    rig = Rig()
    rig.put(BIG, "abcdefgh")  # eight whole pages: the disk is full
    while rig.write_back():
        pass
    assert rig.on_disk(BIG, "abcdefgh") == 8
    rig.put(SMALL, "wxyz")
    rounds = 0
    while rig.write_back() or rig.engine.write_queue_of(rig.engine.disk):
        rounds += 1
        assert rounds < 20
    assert rig.on_disk(SMALL, "wxyz") == 4
    # The leaf of the big chain gave its page up (its host copy stays: only the disk copy went).
    assert rig.on_disk(BIG, "abcdefgh") == 7
    big = rig.engine.namespace(rig.ns["big"]).index.nodes[keys(BIG, "abcdefgh")[-1]]
    assert rig.engine.host_slot(big) != NO_SLOT
    # The page's old slot had its REMOVE journalled before (or in the same round as) the new writes there.
    removed = [slot for kind, slots in rig.journal if kind == "remove" for slot in slots]
    assert len(removed) == 1
    first_small_write = next(index for index, (kind, slots) in enumerate(rig.journal) if kind == "write" and slots
                             and index > 0 and any(rig.engine.disk.pool.class_of(slot).index == 2 for slot in slots))
    removal_at = next(index for index, (kind, slots) in enumerate(rig.journal) if kind == "remove" and slots)
    assert removal_at < first_small_write
    rig.check()


def test_recovery_gives_each_page_the_class_of_its_records_and_drops_a_conflict():
    rig = Rig()
    pool = rig.engine.disk.pool
    big_slot = pool.slot_at(3, 0, 0)
    small_slots = [pool.slot_at(5, 2, position) for position in (0, 1)]
    clash = pool.slot_at(3, 2, 1)  # inside page 3, which the big block's record gives to the 64 KiB class
    small = keys(SMALL, "ab")
    recovered = rig.engine.recover(rig.ns["small"], [(small[0], b"", small_slots[0]),
                                                     (small[1], small[0], small_slots[1])])
    recovered += rig.engine.recover(rig.ns["big"], [(keys(BIG, "a")[0], b"", big_slot)])
    assert recovered == 3
    assert rig.engine.recover(rig.ns["small"], [(keys(SMALL, "q")[0], b"", clash)]) == 0
    assert pool.page_class[3] == 0 and pool.page_class[5] == 2
    assert sum(page_class == NO_CLASS for page_class in pool.page_class) == PAGES - 2
    # The clashing record's REMOVE is journalled, but its slot was never this pool's to hold.
    assert [slot for _, _, slot in rig.engine.take_disk_removals()] == [clash]
    rig.engine.disk_removals_journalled([clash])
    assert rig.engine.disk.pool.free_count_of(pool.classes[2]) == 2  # the rest of page 5
    rig.check()


def test_tenant_disk_quotas_count_the_bytes_of_their_slots():
    quotas = [TenantQuota("small", 0, 4 * (16 << 10)), TenantQuota("big", 0, 0)]
    rig = Rig(quotas)
    rig.put(SMALL, "abcdef")
    while rig.write_back():
        pass
    assert rig.on_disk(SMALL, "abcdef") == 4  # a quota of four 16 KiB slots holds four blocks, not one
    assert rig.engine.tenants["small"].disk_used_bytes == 4 * (16 << 10)
    rig.check()


@pytest.mark.parametrize("seed", range(6))
def test_a_random_two_model_workload_through_a_small_disk_keeps_every_invariant(seed):
    """Phases in which one model or the other writes most, so disk pages change class often."""
    rng = random.Random(seed)
    rig = Rig()
    for step in range(300):
        favoured = (BIG, SMALL)[step // 25 % 2]
        spec = favoured if rng.random() < 0.85 else rng.choice((BIG, SMALL))
        rig.put(spec, "".join(rng.choice("abcdef") for _ in range(rng.randint(1, 5))) + str(step % 11))
        if rng.random() < 0.5:
            rig.write_back()
        if step % 10 == 0:
            rig.check()
    while rig.write_back():
        pass
    rig.check()


def test_a_class_short_of_slots_empties_another_class_page_once_its_bounded_searches_cover_the_disk():
    rig = Rig()
    rig.put(BIG, "abcdefgh")  # eight whole pages: the disk is full
    while rig.write_back():
        pass
    writeback = rig.engine.writebacks[rig.engine.disk]
    slots = rig.engine.disk.pool.slot_count
    writeback.scan_slots_per_turn = 5
    rig.put(SMALL, "wxyz")
    # Each round looks at 5 slots: no small block may go anywhere, and once
    # two sweeps' worth were looked at, a page of another class is emptied
    # (its leaf's reference bit cleared on one sweep, taken on the next).
    rounds = 0
    while not rig.write_back():
        rounds += 1
        assert writeback.scan.left == 0 and rounds <= 2 * -(-2 * slots // 5) + 2
    assert rounds > 2 * slots // 5
    while rig.write_back() or rig.engine.write_queue_of(rig.engine.disk):
        pass
    assert rig.on_disk(SMALL, "wxyz") == 4 and rig.on_disk(BIG, "abcdefgh") == 7
    rig.check()
