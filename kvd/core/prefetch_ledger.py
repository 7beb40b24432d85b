"""Whether prefetching paid: each prefetched block ends up used by a Get or wasted.

A block joins the ledger when its prefetch read is queued and leaves it
when a Get matches it (used) or when it leaves host memory first (wasted:
evicted, demoted, deleted, or dropped because its read failed). A side set
rather than a flag on Block: one more field costs 16 B per block. Every
member has a host slot, so the set holds at most the host tier's slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvd.core.block import Block
from kvd.invariants import check


@dataclass(slots=True)
class PrefetchCounters:
    """Per-block outcomes of Prefetch requests, then of the blocks they read."""

    queued: int = 0
    in_host: int = 0
    loading: int = 0
    missing: int = 0
    refused: int = 0
    # Prefetched blocks a Get then matched, and those that left host memory
    # first (evicted, demoted, deleted, or dropped because their read failed).
    used: int = 0
    wasted: int = 0


class PrefetchLedger:
    def __init__(self) -> None:
        self.blocks: set[Block] = set()
        self.counters = PrefetchCounters()

    def queued(self, block: Block) -> None:
        self.blocks.add(block)

    def used(self, matched: Sequence[Block]) -> None:
        """A Get matched these blocks: prefetched ones were worth it."""
        blocks = self.blocks
        if not blocks:
            return
        for block in matched:
            if block in blocks:
                blocks.remove(block)
                self.counters.used += 1

    def left_host(self, block: Block) -> None:
        """`block` left host memory: if no Get used it, its prefetch was wasted."""
        if self.blocks and block in self.blocks:
            self.blocks.remove(block)
            self.counters.wasted += 1

    def verify(self) -> None:
        counters = self.counters
        check(counters.queued == counters.used + counters.wasted + len(self.blocks),
              "every prefetched block is used, wasted, or still waiting for a Get")
