"""Slot size classes in a SlotPool: pages carved into slots of one class each.

A model keeps, per page, its class and which of its slots are taken; the
pool must agree after every step, its free lists must hold exactly the
free slots of each class's pages, and no two taken slots may overlap in
bytes or leave their page.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvd.core.block import NO_SLOT
from kvd.core.slot_pool import NO_CLASS, SlotPool, class_sizes
from kvd.invariants import InvariantError

PAGES = 4
PAGE_BYTES = 64 << 10
SIZES = class_sizes(PAGE_BYTES, 16 << 10)


class Owner:
    """Stands in for a block: only its identity matters to the pool."""


def test_class_sizes_halve_down_to_the_minimum_and_stay_aligned():
    assert class_sizes(2 << 20, 64 << 10) == (2 << 20, 1 << 20, 512 << 10, 256 << 10, 128 << 10, 64 << 10)
    assert class_sizes(2 << 20, 2 << 20) == (2 << 20,)
    # 12 KiB halves to 6 KiB, which is not a whole number of 4 KiB pages.
    assert class_sizes(12 << 10, 4 << 10) == (12 << 10,)


def test_one_class_is_the_pool_as_it_always_was():
    pool = SlotPool(4, 4096, base=10)
    assert pool.slot_count == 4 and pool.available == 4 and not pool.free_pages
    assert [pool.take_free() for _ in range(5)] == [0, 1, 2, 3, NO_SLOT]
    assert [pool.offset_of(slot) for slot in range(4)] == [0, 4096, 8192, 12288]
    pool.verify()


def test_a_pages_slots_are_handed_out_lowest_first_at_their_own_offsets():
    pool = SlotPool(PAGES, PAGE_BYTES, class_bytes=SIZES)
    small = pool.classes[-1]
    assert small.slot_bytes == 16 << 10 and small.per_page == 4
    assert pool.take_free(small) == NO_SLOT  # no page yet
    assert pool.take_page(small)
    slots = [pool.take_free(small) for _ in range(4)]
    assert [pool.offset_of(slot) for slot in slots] == [0, 16 << 10, 32 << 10, 48 << 10]
    assert pool.take_free(small) == NO_SLOT
    assert pool.take_page(pool.classes[0])
    big = pool.take_free(pool.classes[0])
    assert pool.offset_of(big) == PAGE_BYTES  # the next page
    assert pool.class_for(20 << 10).slot_bytes == 32 << 10
    assert pool.class_for(PAGE_BYTES) is pool.classes[0]


def test_a_page_with_a_slot_in_use_cannot_be_released():
    pool = SlotPool(PAGES, PAGE_BYTES, class_bytes=SIZES)
    small = pool.classes[-1]
    pool.take_page(small)
    slot = pool.take_free(small)
    pool.assign(slot, Owner())
    try:
        pool.release_page(0)
    except InvariantError:
        pass
    else:
        raise AssertionError("a page with an owned slot was released")


class PagedPool(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = SlotPool(PAGES, PAGE_BYTES, class_bytes=SIZES)
        # page -> class index; slot -> owner; free slots per class in the order they come out.
        self.page_class: dict[int, int] = {}
        self.owned: dict[int, Owner] = {}

    @rule(index=st.integers(0, len(SIZES) - 1))
    def take_page(self, index):
        slot_class = self.pool.classes[index]
        took = self.pool.take_page(slot_class)
        free_pages = [page for page in range(PAGES) if page not in self.page_class]
        assert took == bool(free_pages)
        if took:
            self.page_class[min(free_pages)] = index

    @rule(index=st.integers(0, len(SIZES) - 1))
    def allocate(self, index):
        slot_class = self.pool.classes[index]
        slot = self.pool.take_free(slot_class)
        pages = [page for page, held in self.page_class.items() if held == index]
        capacity = len(pages) * slot_class.per_page
        taken = sum(1 for slot_ in self.owned if self.pool.class_of(slot_) is slot_class)
        if slot == NO_SLOT:
            assert taken == capacity
            return
        assert self.pool.class_of(slot) is slot_class and self.pool.page_of(slot) in pages
        owner = Owner()
        self.pool.assign(slot, owner)
        self.owned[slot] = owner

    @precondition(lambda self: self.owned)
    @rule(pick=st.integers(0, 1000))
    def release(self, pick):
        slot = sorted(self.owned)[pick % len(self.owned)]
        self.pool.release(slot, self.owned.pop(slot))

    @precondition(lambda self: self.page_class)
    @rule(pick=st.integers(0, 1000))
    def release_page(self, pick):
        page = sorted(self.page_class)[pick % len(self.page_class)]
        busy = any(self.pool.page_of(slot) == page and self.pool.class_of(slot).index == self.page_class[page]
                   for slot in self.owned)
        assert self.pool.page_is_free(page) == (not busy)
        if not busy:
            self.pool.release_page(page)
            del self.page_class[page]

    @invariant()
    def pool_agrees_with_the_model(self):
        pool = self.pool
        pool.verify()
        assert {page: pool.page_class[page] for page in range(PAGES) if pool.page_class[page] != NO_CLASS} \
            == self.page_class
        assert pool.available == sum(pool.classes[index].per_page for index in self.page_class.values())
        assert pool.resident_blocks == len(self.owned)
        # Taken slots never overlap in bytes and stay inside their page.
        spans = sorted((pool.offset_of(slot), pool.offset_of(slot) + pool.slot_bytes_of(slot), slot)
                       for slot in self.owned)
        for (start, end, slot), (next_start, _, _) in zip(spans, spans[1:]):
            assert end <= next_start, f"slot {slot} overlaps the next"
        for start, end, slot in spans:
            page = pool.page_of(slot)
            assert page * PAGE_BYTES <= start < end <= (page + 1) * PAGE_BYTES


PagedPool.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPagedPool = PagedPool.TestCase
