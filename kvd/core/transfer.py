"""Transfers: one block's bytes on their way from a slot of one tier to a slot of another.

Every move between tiers is a `Transfer`: a Get's or a prefetch's read
from disk into host memory, a write-back from host memory to disk, and,
as tiers are added, a device copy or a fetch from a peer. A Get of a
block held only in a slow tier is then a chain of hops, one transfer per
hop (remote -> disk -> host -> device).

The engine prepares a transfer when it gives the block its target slot
(owned by the block from then on, so nothing else is put there) and
completes it with the data plane's outcome (`Engine.finish_loads`,
`Engine.finish_writes`: the copy becomes resident, or the block is lost,
or the slot waits for its REMOVE). A transfer that nothing else pins (a
write-back, a prefetch) holds its own pin on the block while it runs.
The data planes read only the slots: a transfer is plain data to them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.core.block import Block, BlockHandle
from kvd.core.tier import Tier
from kvd.invariants import check


@dataclass(slots=True, eq=False)
class Transfer:
    block: Block
    source: Tier
    source_slot: int
    target: Tier
    target_slot: int
    # The transfer's own pin on the block, where nothing else pins it.
    handle: BlockHandle | None = None

    def __post_init__(self) -> None:
        check(self.source is not self.target, "a transfer moves between two tiers")
        check(0 <= self.source_slot < self.source.slot_count and 0 <= self.target_slot < self.target.slot_count,
              "transfer of {!r} between slots out of range", self.block)

    def __repr__(self) -> str:
        return (f"Transfer({self.block.key[:6].hex()}, {self.source.name}[{self.source_slot}] -> "
                f"{self.target.name}[{self.target_slot}])")
