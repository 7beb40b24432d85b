"""How much of each tier one namespace takes, counted a bounded step at a time.

ListNamespaces reports, per namespace and per tier of the stack, how many
of its blocks have a copy there and the bytes they take. A namespace may
hold a million blocks and the daemon answers on its event loop, so
`UsageCount` counts at most `step_blocks` blocks per `step()`: their
residency chains (kvd.core.residency) are followed as arrays of global slot
ids, one numpy pass per tier (`TierStack.copies_by_tier`), never a Python
loop per block.

It counts the blocks the namespace held when the count began. A block
removed before its step is counted nowhere (its chain is empty by then),
and one stored after the count began is not counted, so the figures are
exact for a namespace nobody changes meanwhile and off by at most what
changed during the count otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from kvd.core.block import Block
from kvd.core.radix import PrefixIndex
from kvd.core.residency import TierStack
from kvd.core.tier import TierId
from kvd.invariants import check

_SLOT_OF = attrgetter("slot")


@dataclass(slots=True)
class TierUsage:
    """One tier's share of one namespace."""

    tier_id: TierId
    # Blocks with a copy in this tier (a block in two tiers counts in both).
    blocks: int = 0
    # Their own bytes, and the bytes of the slots they take (whole slots).
    payload_bytes: int = 0
    slot_bytes: int = 0


class UsageCount:
    """A namespace's blocks and bytes in each tier of `tiers`, counted by repeated step() calls."""

    def __init__(self, index: PrefixIndex, tiers: TierStack) -> None:
        # A list of the blocks, not an iterator over the index: the index may
        # change between steps, the list does not.
        self._blocks: list[Block] = list(index.nodes.values())
        self._next = 0
        self._block_bytes = index.block_bytes
        self._tiers = tiers
        self.usage = [TierUsage(tier.tier_id) for tier in tiers]

    @property
    def done(self) -> bool:
        return self._next >= len(self._blocks)

    def step(self, step_blocks: int) -> None:
        """Count the next `step_blocks` blocks (at most)."""
        check(step_blocks > 0, "a usage step of {} blocks", step_blocks)
        chunk = self._blocks[self._next:self._next + step_blocks]
        self._next += len(chunk)
        gids = np.fromiter(map(_SLOT_OF, chunk), dtype=np.int64, count=len(chunk))
        for usage, tier, slots in zip(self.usage, self._tiers, self._tiers.copies_by_tier(gids)):
            usage.blocks += len(slots)
            usage.payload_bytes += len(slots) * self._block_bytes
            usage.slot_bytes += tier.pool.slots_bytes(slots)
        if self.done:
            self._blocks = []  # counted: the blocks may go
