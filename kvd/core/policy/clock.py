"""CLOCK over a tier's slot array: the disk tier's eviction policy.

A reference bit per slot, set when the slot's block is read or written, and
a hand that sweeps the slots clearing bits until it finds an evictable block
whose bit is clear. That costs one byte per slot and no per-block links, so
the index stays small however large the drives are.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

from kvd.core.block import Block
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
        self, owners: Sequence[Block | None], busy: Container[int], evictable: Callable[[Block], bool]
    ) -> Block | None:
        """Two sweeps at most: the first may only clear reference bits."""
        referenced = self.referenced
        slot_count = len(referenced)
        for _ in range(2 * slot_count):
            slot = self.hand
            self.hand = (slot + 1) % slot_count
            block = owners[slot]
            if block is None or slot in busy or not evictable(block):
                continue
            if referenced[slot]:
                referenced[slot] = 0
                continue
            return block
        return None

    def verify(self) -> None:
        check(0 <= self.hand < len(self.referenced), "CLOCK hand {} outside the slots", self.hand)
