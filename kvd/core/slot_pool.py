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
  durable (`confirm_removals`), so a replay after a crash never pairs an
  old record with new bytes;
* retired: out of service for good (its drive could not be read at start).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import TYPE_CHECKING

from kvd.core.block import NO_SLOT
from kvd.invariants import check

if TYPE_CHECKING:
    from kvd.core.block import Block


class SlotPool:
    def __init__(self, slot_count: int, slot_bytes: int, *, base: int = 0, persistent: bool = False) -> None:
        check(slot_count > 0 and slot_bytes > 0, "a slot pool needs slots")
        check(base >= 0, "global slot ids are not negative")
        self.slot_count = slot_count
        self.slot_bytes = slot_bytes
        self.base = base
        self.persistent = persistent
        # The global id of each slot, one int object each, made once.
        self.ids: list[int] = list(range(base, base + slot_count))
        # Global ids of the free slots, popped from the end: the lowest
        # slot is handed out first.
        self._free: list[int] = self.ids[::-1]
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
        # (namespace id, key, slot) freed but not yet journalled as removed.
        self.removals: list[tuple[bytes, bytes, int]] = []
        # Payload bytes of resident blocks (each block's own size).
        self.used_bytes = 0

    @property
    def end(self) -> int:
        """One past the last global id of this pool."""
        return self.base + self.slot_count

    @property
    def free_slots(self) -> list[int]:
        """The free slots, next to be handed out last (a copy, for tests and snapshots)."""
        return [gid - self.base for gid in self._free]

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def capacity_bytes(self) -> int:
        """What the slots in service can hold (retired slots count for nothing)."""
        return (self.slot_count - len(self.retired)) * self.slot_bytes

    @property
    def resident_blocks(self) -> int:
        return (self.slot_count - len(self._free) - len(self.quarantine) - len(self.incoming)
                - len(self.retired))

    @property
    def occupied_bytes(self) -> int:
        """Capacity taken: whole slots, however small the blocks in them."""
        return self.resident_blocks * self.slot_bytes

    def take_free(self) -> int:
        """A free slot (the lowest), or NO_SLOT if none is free."""
        return self._free.pop() - self.base if self._free else NO_SLOT

    def assign(self, slot: int, block: Block) -> None:
        """`block` owns `slot` from now on (a free slot just taken, or one being reused)."""
        check(self.owners[slot] is None and slot not in self.retired, "slot {} is not free to assign", slot)
        self.owners[slot] = block

    def give_back(self, slot: int) -> None:
        """Return an unowned slot to the free list."""
        check(self.owners[slot] is None and slot not in self.quarantine, "slot {} returned while in use", slot)
        self._free.append(self.ids[slot])

    def release(self, slot: int, block: Block) -> None:
        """`block` gives up `slot`. A persistent tier's slot is quarantined
        until the REMOVE of its record is durable; any other is free at once."""
        check(self.owners[slot] is block, "slot {} released by a block that does not own it", slot)
        self.owners[slot] = None
        if self.persistent:
            self.quarantine.add(slot)
            self.removals.append((block.index.namespace_id, block.key, slot))
        else:
            self._free.append(self.ids[slot])

    def forget(self, slot: int, namespace_id: bytes, key: bytes) -> None:
        """A persistent slot with no owner may still hold a record of `key`
        (a failed write, a record dropped at recovery): quarantine it until
        a REMOVE for it is durable."""
        check(self.persistent and self.owners[slot] is None, "slot {} forgotten while owned", slot)
        if slot not in self.quarantine:
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
            check(bool(self._free) and self._free[-1] == self.ids[slot], "slot {} was not just released", slot)
            self._free.pop()

    def take_removals(self) -> list[tuple[bytes, bytes, int]]:
        removals, self.removals = self.removals, []
        return removals

    def confirm_removals(self, slots: Iterable[int]) -> None:
        """The REMOVE records of these slots are durable: they may be reused."""
        for slot in slots:
            if slot in self.quarantine:
                self.quarantine.discard(slot)
                self._free.append(self.ids[slot])
            else:
                # Taken straight over by a new write after its eviction.
                check(self.owners[slot] is not None, "slot {} was not awaiting removal", slot)

    def retire(self, slots: Iterable[int]) -> None:
        """Take free slots out of service for good (a quarantined drive's)."""
        retired = set(slots)
        check(all(self.owners[slot] is None and slot not in self.quarantine for slot in retired),
              "retiring a slot in use")
        self.retired |= retired
        self.rebuild_free()

    def rebuild_free(self) -> None:
        """Free list = every slot with no owner, not quarantined, not retired (after recovery)."""
        busy = self.quarantine | self.retired
        self._free = [self.ids[slot] for slot in range(self.slot_count - 1, -1, -1)
                           if self.owners[slot] is None and slot not in busy]

    def verify(self) -> None:
        free = [gid - self.base for gid in self._free]
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
