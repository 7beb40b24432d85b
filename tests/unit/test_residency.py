"""The residency stack: one chain per block through any number of tiers.

A model (block -> {tier: slot}) is kept beside a real TierStack of three
or four tiers; after every random add or drop the chain must give back the
model's slots, in tier order, with the resident-children counts (strays
included) that a recount finds.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.block import NO_SLOT, Block
from kvd.core.policy import make_policy
from kvd.core.radix import PrefixIndex
from kvd.core.residency import TierStack
from kvd.core.slot_pool import SlotPool
from kvd.core.tier import MemoryTier, StorageTier, TierId
from kvd.invariants import InvariantError

SLOTS = 6


def stack_of(ids: list[TierId]) -> TierStack:
    """Tiers in the order given, pools laid out in the reverse order (bases need not follow rank)."""
    tiers = []
    base = SLOTS * len(ids)
    for tier_id in ids:
        base -= SLOTS
        if tier_id == TierId.DISK:
            tiers.append(StorageTier(tier_id, SlotPool(SLOTS, 64, base=base, persistent=True)))
        else:
            tiers.append(MemoryTier(tier_id, SlotPool(SLOTS, 64, base=base), make_policy("lru", SLOTS),
                                    client_mappable=tier_id == TierId.HOST))
    return TierStack(tiers)


def chain(length: int) -> list[Block]:
    index = PrefixIndex("m", 64)
    blocks, parent = [], None
    for position in range(length):
        parent = index.insert(bytes([position]) * 32, parent)
        blocks.append(parent)
    return blocks


def add(stack: TierStack, block: Block, tier) -> int:
    slot = tier.pool.take_free()
    tier.pool.assign(slot, block)
    stack.add_copy(block, tier, slot)
    return slot


def drop(stack: TierStack, block: Block, tier) -> None:
    slot = stack.drop_copy(block, tier)
    tier.pool.release(slot, block)
    if tier.pool.persistent:
        tier.pool.removals_journalled([slot])


def recount(stack: TierStack, blocks: list[Block]) -> None:
    resident = {tier: {} for tier in stack}
    for block in blocks:
        stack.verify_block(block, resident)
    stack.verify_children(resident)
    stack.verify()


def test_copies_are_kept_in_tier_order_whatever_order_they_arrive_in():
    stack = stack_of([TierId.DEVICE, TierId.HOST, TierId.DISK])
    device, host, disk = stack.tiers
    [block] = chain(1)
    disk_slot = add(stack, block, disk)
    device_slot = add(stack, block, device)
    host_slot = add(stack, block, host)
    assert stack.copies(block) == [(device, device_slot), (host, host_slot), (disk, disk_slot)]
    assert stack.top(block) is device
    drop(stack, block, host)  # the middle of the chain
    assert stack.copies(block) == [(device, device_slot), (disk, disk_slot)]
    assert stack.slot_in(block, host) == NO_SLOT
    drop(stack, block, device)
    assert stack.top(block) is disk and stack.slot_in(block, disk) == disk_slot
    # The head is the pool's own id object: no int is made per block.
    assert block.slot is disk.pool.ids[disk_slot]
    drop(stack, block, disk)
    assert block.slot == NO_SLOT and stack.copies(block) == []
    recount(stack, [block])


def test_a_second_copy_in_one_tier_and_a_drop_of_a_missing_copy_are_refused():
    stack = stack_of([TierId.HOST, TierId.DISK])
    host, disk = stack.tiers
    [block] = chain(1)
    add(stack, block, host)
    with pytest.raises(InvariantError):
        add(stack, block, host)
    with pytest.raises(InvariantError):
        stack.drop_copy(block, disk)


def test_a_child_resident_where_its_parent_is_not_waits_as_a_stray():
    stack = stack_of([TierId.HOST, TierId.DISK])
    host, disk = stack.tiers
    parent, child = chain(2)
    add(stack, parent, disk)
    add(stack, child, host)  # a Put extending a prefix that is on disk only
    assert stack.resident_children(parent, host) == 1 and host.pool.stray_children == {parent: 1}
    recount(stack, [parent, child])
    add(stack, parent, host)  # the parent is read back: the count moves into its slot
    assert host.pool.stray_children == {} and stack.resident_children(parent, host) == 1
    recount(stack, [parent, child])
    drop(stack, parent, host)
    assert host.pool.stray_children == {parent: 1}
    drop(stack, child, host)
    assert host.pool.stray_children == {} and stack.resident_children(parent, host) == 0
    recount(stack, [parent, child])


STACKS = [[TierId.HOST, TierId.DISK], [TierId.HOST, TierId.REMOTE, TierId.DISK],
          [TierId.DEVICE, TierId.HOST, TierId.REMOTE, TierId.DISK]]


@settings(max_examples=150, deadline=None)
@given(layout=st.sampled_from(STACKS), steps=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), max_size=60))
def test_random_adds_and_drops_match_a_model(layout, steps):
    stack = stack_of(layout)
    blocks = chain(4)
    model: dict[int, dict[int, int]] = {position: {} for position in range(len(blocks))}
    for position, tier_number in steps:
        tier = stack.tiers[tier_number % len(stack)]
        block = blocks[position]
        if tier.rank in model[position]:
            drop(stack, block, tier)
            del model[position][tier.rank]
        elif tier.pool.free_count:
            model[position][tier.rank] = add(stack, block, tier)
        expected = [(stack.tiers[rank], slot) for rank, slot in sorted(model[position].items())]
        assert stack.copies(block) == expected
        for other in stack:
            assert stack.slot_in(block, other) == model[position].get(other.rank, NO_SLOT)
        recount(stack, blocks)
