"""The slots of one tier: which are free, which block owns each, bytes in use.

Every tier (host memory, disk; device and remote later) carves its
capacity into numbered slots and keeps them in one `SlotPool`. The pool
holds bookkeeping only; the bytes live in the tier's data plane
(kvd.tiers). Slot numbers are the tier's own (`0 .. slot_count - 1`, what
its plane addresses). Each pool also owns a range of *global* slot ids,
`base .. base + slot_count - 1`, disjoint from every other tier's, so one
integer names a tier and a slot at once: that is what a block's residency
chain holds (kvd.core.residency).

The global id objects are made once, here, and only ever move between the
free list and the residency fields, so a resident block costs no int
object of its own (see bench/bench_index_memory.py).

Slot states:

* free: in `free_slots`, no owner;
* incoming: owned by a block whose copy is not there yet (a write to disk
  in flight); in `incoming`;
* resident: owned, and the owner's residency chain names the slot;
* quarantined (persistent tiers only): freed, but the tier's journal still
  has the old block's record; reused only once a REMOVE record for it is
  durable (`removals_journalled`), so a replay after a crash never pairs an
  old record with new bytes;
* retired: out of service for good (its drive could not be read at start).

Slot size classes. A pool may carve its capacity into several slot sizes
so that blocks of different sizes (two models on one node) do not each
take a whole large slot. Its capacity is `page_count` pages of
`page_bytes`; a class of `slot_bytes = page_bytes / 2**k` has
`per_page` slots in each page it holds. Every class owns a contiguous
range of local slot numbers, one per slot it could ever have
(`page_count * per_page`): slot `start + page * per_page + j` is the j-th
slot of that page, at byte `page * page_bytes + j * slot_bytes` of the
tier. A page belongs to at most one class at a time (`assign_page`,
`release_page`); only the slots of the pages a class holds are in use or
free, the others are unavailable. With one class (the default), every
page is one slot of that class from the start, which is the pool as it
always was.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvd.core.block import NO_SLOT
from kvd.invariants import check

if TYPE_CHECKING:
    from kvd.core.block import Block


ALIGN_BYTES = 4096
NO_CLASS = -1


def class_sizes(page_bytes: int, min_slot_bytes: int) -> tuple[int, ...]:
    """Slot sizes from `page_bytes` down by halves while at least `min_slot_bytes`
    and a whole number of `ALIGN_BYTES`, largest first."""
    check(0 < min_slot_bytes <= page_bytes, "min slot size must be positive and at most the page size")
    sizes = [page_bytes]
    while sizes[-1] % 2 == 0 and sizes[-1] // 2 >= min_slot_bytes and (sizes[-1] // 2) % ALIGN_BYTES == 0:
        sizes.append(sizes[-1] // 2)
    return tuple(sizes)


@dataclass(frozen=True, slots=True)
class SlotClass:
    """One slot size of a pool: its local slots are `start .. start + page_count * per_page - 1`."""

    index: int
    slot_bytes: int
    per_page: int
    start: int


class SlotPool:
    def __init__(self, slot_count: int, slot_bytes: int, *, base: int = 0, persistent: bool = False,
                 class_bytes: Sequence[int] = ()) -> None:
        """`slot_count` pages of `slot_bytes`; with `class_bytes` (sizes that divide
        `slot_bytes`), each page is carved into slots of one class when it is assigned."""
        check(slot_count > 0 and slot_bytes > 0, "a slot pool needs slots")
        check(base >= 0, "global slot ids are not negative")
        sizes = sorted(set(class_bytes or (slot_bytes,)), reverse=True)
        check(sizes[0] == slot_bytes and all(slot_bytes % size == 0 for size in sizes),
              "slot classes must divide the page size, the largest being the page")
        self.page_count = slot_count
        self.page_bytes = slot_bytes
        self.classes: list[SlotClass] = []
        start = 0
        for index, size in enumerate(sizes):
            self.classes.append(SlotClass(index, size, slot_bytes // size, start))
            start += slot_count * (slot_bytes // size)
        # Local slot numbers of every class, available or not.
        self.slot_count = start
        self.slot_bytes = slot_bytes
        self.base = base
        self.persistent = persistent
        self._init_slots()

    def _init_slots(self) -> None:
        slot_count = self.slot_count
        single = len(self.classes) == 1
        # The global id of each slot, one int object each, made once (for a
        # class's slots, when the class first gets their page).
        self.ids: list[int | None] = list(range(self.base, self.base + slot_count)) if single else [None] * slot_count
        # Per class, the global ids of its free slots, popped from the end:
        # the lowest slot is handed out first.
        self._free_by_class: list[list[int]] = [[] for _ in self.classes]
        # The page's class, or NO_CLASS; the unassigned pages, lowest last.
        self.page_class = array("b", [0 if single else NO_CLASS]) * self.page_count
        self.free_pages: list[int] = [] if single else list(range(self.page_count - 1, -1, -1))
        # Slots of assigned pages (in use, free, quarantined, retired or incoming).
        self.available = slot_count if single else 0
        if single:
            self._free_by_class[0] = self.ids[::-1]
        self._free = self._free_by_class[0]
        self.owners: list[Block | None] = [None] * slot_count
        # Residency chains (kvd.core.residency): the global id of the
        # owner's next copy in a slower tier, and how many of the owner's
        # children have a copy in this tier.
        self.below = array("q", [NO_SLOT]) * slot_count
        self.resident_children = array("i", [0]) * slot_count
        # Children with a copy here whose parent has none: parent -> count.
        self.stray_children: dict[Block, int] = {}
        self.incoming: set[int] = set()
        self.quarantine: set[int] = set()
        self.retired: set[int] = set()
        # Pages out of service (pools with classes; one class retires slots).
        self.retired_pages: set[int] = set()
        # Quarantined slots whose page went to another class before their
        # REMOVE was durable (take_over_page), until removals_journalled.
        self.handed_over: set[int] = set()
        # (namespace id, key, slot) freed but not yet journalled as removed.
        self.removals: list[tuple[bytes, bytes, int]] = []
        # Payload bytes of resident blocks (each block's own size), and the
        # bytes of the slots that have an owner (whole slots).
        self.used_bytes = 0
        self.owned_bytes = 0

    # -- classes and pages -------------------------------------------------------

    def class_of(self, slot: int) -> SlotClass:
        classes = self.classes
        if len(classes) == 1:
            return classes[0]
        for slot_class in reversed(classes):
            if slot >= slot_class.start:
                return slot_class
        raise AssertionError(f"slot {slot} belongs to no class")

    def class_for(self, block_bytes: int) -> SlotClass:
        """The smallest class whose slots hold `block_bytes`."""
        check(0 < block_bytes <= self.page_bytes, "a block of {} bytes fits no slot of {}", block_bytes,
              self.page_bytes)
        return next(slot_class for slot_class in reversed(self.classes) if slot_class.slot_bytes >= block_bytes)

    def slot_bytes_of(self, slot: int) -> int:
        return self.class_of(slot).slot_bytes

    def slots_bytes(self, slots: np.ndarray) -> int:
        """The bytes of the local `slots` together, each its class's size (slot_bytes_of, in one
        numpy pass)."""
        if len(self.classes) == 1:
            return len(slots) * self.slot_bytes
        starts = np.array([slot_class.start for slot_class in self.classes], dtype=np.int64)
        sizes = np.array([slot_class.slot_bytes for slot_class in self.classes], dtype=np.int64)
        return int(sizes[np.searchsorted(starts, slots, side="right") - 1].sum())

    def page_of(self, slot: int) -> int:
        slot_class = self.class_of(slot)
        return (slot - slot_class.start) // slot_class.per_page

    def place_of(self, slot: int) -> tuple[int, SlotClass, int]:
        """(page, class, place in the page) of a slot; slot_at is the inverse."""
        slot_class = self.class_of(slot)
        page, position = divmod(slot - slot_class.start, slot_class.per_page)
        return page, slot_class, position

    def offset_of(self, slot: int) -> int:
        """Where the slot's bytes start in the tier (its page's, plus its place in the page)."""
        page, slot_class, position = self.place_of(slot)
        return page * self.page_bytes + position * slot_class.slot_bytes

    def offsets_of(self, slots: Sequence[int]) -> list[int]:
        """offset_of each slot (one multiplication each when the pool has one class)."""
        if len(self.classes) == 1:
            page_bytes = self.page_bytes
            return [slot * page_bytes for slot in slots]
        return [self.offset_of(slot) for slot in slots]

    def slot_at(self, page: int, class_index: int, position: int) -> int:
        """The local slot of class `class_index` at `position` in `page` (inverse of place_of)."""
        slot_class = self.classes[class_index]
        check(0 <= page < self.page_count and 0 <= position < slot_class.per_page,
              "no slot {} of class {} in page {}", position, class_index, page)
        return slot_class.start + page * slot_class.per_page + position

    def page_slots(self, page: int, slot_class: SlotClass) -> range:
        first = slot_class.start + page * slot_class.per_page
        return range(first, first + slot_class.per_page)

    def assign_page(self, page: int, slot_class: SlotClass) -> None:
        """Carve an unassigned page into free slots of `slot_class`."""
        check(self.page_class[page] == NO_CLASS, "page {} is assigned already", page)
        self.page_class[page] = slot_class.index
        self.free_pages.remove(page)
        slots = self.page_slots(page, slot_class)
        ids = self.ids
        if ids[slots.start] is None:
            ids[slots.start:slots.stop] = range(self.base + slots.start, self.base + slots.stop)
        # The page's lowest slot goes out first.
        self._free_by_class[slot_class.index].extend(ids[slot] for slot in reversed(slots))
        self.available += slot_class.per_page

    def take_page(self, slot_class: SlotClass) -> bool:
        """Assign the lowest unassigned page to `slot_class`; False if none is left."""
        if not self.free_pages:
            return False
        self.assign_page(self.free_pages[-1], slot_class)
        return True

    def page_is_free(self, page: int) -> bool:
        """Whether every slot of an assigned page is free (nothing owns, fills or quarantines it)."""
        index = self.page_class[page]
        check(index != NO_CLASS, "page {} is not assigned", page)
        busy = self.quarantine | self.incoming | self.retired
        return all(self.owners[slot] is None and slot not in busy
                   for slot in self.page_slots(page, self.classes[index]))

    def release_page(self, page: int) -> None:
        """Give back a page whose slots are all free: its slots become unavailable."""
        check(len(self.classes) > 1 and self.page_is_free(page), "page {} is not free to release", page)
        slot_class = self.classes[self.page_class[page]]
        slots = self.page_slots(page, slot_class)
        low, high = self.base + slots.start, self.base + slots.stop
        free = self._free_by_class[slot_class.index]
        free[:] = [gid for gid in free if not low <= gid < high]
        self.page_class[page] = NO_CLASS
        self.free_pages.append(page)
        self.free_pages.sort(reverse=True)
        self.available -= slot_class.per_page

    def take_over_page(self, page: int, slot_class: SlotClass) -> None:
        """Give a persistent tier's page, whose blocks were all just evicted, to
        `slot_class` at once: like `reuse`, the caller journals the pending
        removals (take_removals) of its old slots before it writes new bytes."""
        held = self.classes[self.page_class[page]]
        slots = self.page_slots(page, held)
        check(all(self.owners[slot] is None and slot not in self.incoming for slot in slots),
              "page {} taken over while in use", page)
        for slot in slots:
            if slot in self.quarantine:
                self.quarantine.discard(slot)
                self.handed_over.add(slot)
        self.release_page(page)
        self.assign_page(page, slot_class)

    def retire_pages(self, pages: Iterable[int]) -> None:
        """Take whole pages out of service for good (a quarantined drive's), before any is assigned."""
        if len(self.classes) == 1:
            self.retire(pages)
            return
        retired = set(pages)
        check(all(self.page_class[page] == NO_CLASS for page in retired), "retiring a page in use")
        self.retired_pages |= retired
        self.free_pages[:] = [page for page in self.free_pages if page not in retired]

    @property
    def end(self) -> int:
        """One past the last global id of this pool."""
        return self.base + self.slot_count

    @property
    def free_slots(self) -> list[int]:
        """The free slots, next to be handed out last, class by class (a copy, for tests and snapshots)."""
        return [gid - self.base for free in self._free_by_class for gid in free]

    @property
    def free_count(self) -> int:
        return sum(len(free) for free in self._free_by_class)

    def free_count_of(self, slot_class: SlotClass) -> int:
        return len(self._free_by_class[slot_class.index])

    @property
    def capacity_bytes(self) -> int:
        """What the pages in service can hold (retired slots count for nothing)."""
        return (self.page_count - len(self.retired) - len(self.retired_pages)) * self.page_bytes

    @property
    def resident_blocks(self) -> int:
        return self.available - self.free_count - len(self.quarantine) - len(self.incoming) - len(self.retired)

    @property
    def occupied_bytes(self) -> int:
        """Capacity taken: whole slots, however small the blocks in them (not counting those being filled)."""
        return self.owned_bytes - sum(self.slot_bytes_of(slot) for slot in self.incoming)

    def take_free(self, slot_class: SlotClass | None = None) -> int:
        """A free slot of `slot_class` (default: the largest), the lowest; NO_SLOT if none is free."""
        free = self._free if slot_class is None else self._free_by_class[slot_class.index]
        return free.pop() - self.base if free else NO_SLOT

    def _free_list(self, slot: int) -> list[int]:
        return self._free_by_class[self.class_of(slot).index]

    def assign(self, slot: int, block: Block) -> None:
        """`block` owns `slot` from now on (a free slot just taken, or one being reused)."""
        check(self.owners[slot] is None and slot not in self.retired, "slot {} is not free to assign", slot)
        self.owners[slot] = block
        self.owned_bytes += self.slot_bytes_of(slot)

    def give_back(self, slot: int) -> None:
        """Return an unowned slot to the free list."""
        check(self.owners[slot] is None and slot not in self.quarantine, "slot {} returned while in use", slot)
        self._free_list(slot).append(self.ids[slot])

    def release(self, slot: int, block: Block) -> None:
        """`block` gives up `slot`. A persistent tier's slot is quarantined
        until the REMOVE of its record is durable; any other is free at once."""
        check(self.owners[slot] is block, "slot {} released by a block that does not own it", slot)
        self.owners[slot] = None
        self.owned_bytes -= self.slot_bytes_of(slot)
        if self.persistent:
            self.quarantine.add(slot)
            self.removals.append((block.index.namespace_id, block.key, slot))
        else:
            self._free_list(slot).append(self.ids[slot])

    def forget(self, slot: int, namespace_id: bytes, key: bytes) -> None:
        """A persistent slot with no owner may still hold a record of `key`
        (a failed write, a record dropped at recovery): quarantine it until
        a REMOVE for it is durable."""
        check(self.persistent and self.owners[slot] is None, "slot {} forgotten while owned", slot)
        if self.page_class[self.page_of(slot)] != self.class_of(slot).index:
            # A record of a slot whose page is not (or not now) of its class:
            # journal its REMOVE, but the slot is not this pool's to hold.
            self.handed_over.add(slot)
            self.removals.append((namespace_id, key, slot))
        elif slot not in self.quarantine:
            self.quarantine.add(slot)
            self.removals.append((namespace_id, key, slot))

    def reuse(self, slot: int) -> None:
        """Take a slot just released straight over for a new block. A
        persistent tier's caller journals the pending removals
        (take_removals) before it writes new bytes there; a volatile tier's
        slot went back to the free list on release and leaves it again."""
        if self.persistent:
            self.quarantine.discard(slot)
        else:
            free = self._free_list(slot)
            check(bool(free) and free[-1] == self.ids[slot], "slot {} was not just released", slot)
            free.pop()

    def take_removals(self) -> list[tuple[bytes, bytes, int]]:
        removals, self.removals = self.removals, []
        return removals

    def removals_journalled(self, slots: Iterable[int]) -> None:
        """The REMOVE records of these slots are durable: they may be reused."""
        for slot in slots:
            if slot in self.quarantine:
                self.quarantine.discard(slot)
                self._free_list(slot).append(self.ids[slot])
            elif slot in self.handed_over:
                self.handed_over.discard(slot)  # its page serves another class now
            else:
                # Taken straight over by a new write after its eviction.
                check(self.owners[slot] is not None, "slot {} was not awaiting removal", slot)

    def retire(self, slots: Iterable[int]) -> None:
        """Take free slots out of service for good (a quarantined drive's; one-class pools only)."""
        check(len(self.classes) == 1, "retiring slots of a pool with slot classes")
        retired = set(slots)
        check(all(self.owners[slot] is None and slot not in self.quarantine for slot in retired),
              "retiring a slot in use")
        self.retired |= retired
        self.rebuild_free()

    def rebuild_free(self) -> None:
        """Free lists = every available slot with no owner, not quarantined, not retired (after recovery)."""
        busy = self.quarantine | self.retired
        for slot_class in self.classes:
            free = self._free_by_class[slot_class.index]
            free[:] = [self.ids[slot] for page in range(self.page_count - 1, -1, -1)
                       if self.page_class[page] == slot_class.index
                       for slot in reversed(self.page_slots(page, slot_class))
                       if self.owners[slot] is None and slot not in busy]

    def verify(self) -> None:
        check(self._free is self._free_by_class[0], "the largest class's free list was replaced")
        self._verify_pages()
        free = self.free_slots
        check(all(0 <= slot < self.slot_count for slot in free), "a free slot id is out of range")
        free_set = set(free)
        check(len(free_set) == len(free), "slot listed free twice")
        check(not (free_set & self.quarantine), "slot both free and quarantined")
        check(not (self.retired & (free_set | self.quarantine | self.incoming)), "a retired slot is in use")
        check(self.persistent or not (self.quarantine or self.removals), "a volatile tier quarantines slots")
        for slot in free_set | self.quarantine | self.retired:
            check(self.owners[slot] is None, "free slot {} has an owner", slot)
        for slot in self.incoming:
            check(self.owners[slot] is not None, "slot {} is filled for nobody", slot)
        check(all(count > 0 for count in self.stray_children.values()), "a stray child count is not positive")
        owned = sum(self.slot_bytes_of(slot) for slot, owner in enumerate(self.owners) if owner is not None)
        check(owned == self.owned_bytes, "owned bytes {} but owned slots hold {}", self.owned_bytes, owned)

    def _verify_pages(self) -> None:
        """Each class's free slots lie in its own pages; slots of unassigned pages are unused."""
        assigned = 0
        free_pages = set(self.free_pages)
        check(len(free_pages) == len(self.free_pages) and not free_pages & self.retired_pages,
              "a page is listed unassigned twice")
        for page in range(self.page_count):
            index = self.page_class[page]
            unassigned = page in free_pages or page in self.retired_pages
            check((index == NO_CLASS) == unassigned, "page {} free-page bookkeeping drifted", page)
            if index != NO_CLASS:
                assigned += self.classes[index].per_page
        check(assigned == self.available, "available slots {} but pages hold {}", self.available, assigned)
        for slot_class in self.classes:
            for gid in self._free_by_class[slot_class.index]:
                slot = gid - self.base
                check(self.class_of(slot) is slot_class and self.page_class[self.page_of(slot)] == slot_class.index,
                      "free slot {} is not in a page of its class", slot)
        if len(self.classes) > 1:
            for slot, owner in enumerate(self.owners):
                if owner is not None:
                    check(self.page_class[self.page_of(slot)] == self.class_of(slot).index,
                          "slot {} is owned outside its class's pages", slot)
