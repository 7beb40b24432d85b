"""CLOCK over a tier's slot array: the disk tier's eviction policy.

A reference bit per slot, set when the slot's block is read or written, and
a hand that sweeps the slots clearing bits until it finds an evictable block
whose bit is clear. That costs one byte per slot and no per-block links, so
the index stays small however large the drives are.

A search looks at two sweeps of slots at most, and at most what its
`ScanBudget` allows: when most slots hold blocks that may not go (a
block with children on the disk, a pinned one), a search could otherwise
take a whole sweep, a second per million slots. The hand stays where a
search stopped, so the next one goes on from there: a block that may go
is reached within 2 x slots / budget searches, wherever it is.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from kvd.core.block import Block
from kvd.core.policy import ScanBudget
from kvd.invariants import check


class ClockPolicy:
    name = "clock"

    def __init__(self, slot_count: int) -> None:
        check(slot_count > 0, "CLOCK needs slots")
        self.referenced = bytearray(slot_count)
        self.hand = 0

    def touch(self, slot: int) -> None:
        self.referenced[slot] = 1

    def victim(
        self, owners: Sequence[Block | None], busy: Container[int], evictable: Callable[[Block], bool],
        budget: ScanBudget,
    ) -> Block | None:
        """Two sweeps at most (the first may only clear reference bits), and
        no more looks than `budget` has left."""
        check(budget.left >= 0, "a scan budget overdrawn: {}", budget.left)
        referenced = self.referenced
        slot_count = len(referenced)
        looks = min(2 * slot_count, budget.left)
        slot = self.hand
        found = None
        looked = 0
        while looked < looks:
            looked += 1
            block = owners[slot]
            candidate = block is not None and slot not in busy and evictable(block)
            if candidate and referenced[slot]:
                referenced[slot] = 0
            elif candidate:
                found = block
            slot = slot + 1 if slot + 1 < slot_count else 0
            if found is not None:
                break
        self.hand = slot
        budget.left -= looked
        return found

    def verify(self) -> None:
        check(0 <= self.hand < len(self.referenced), "CLOCK hand {} outside the slots", self.hand)
