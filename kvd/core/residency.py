"""Where each block's copies are: one chain per block through the tiers' slot pools.

A block may have a copy in several tiers at once (in host memory and on
disk; later in device memory too). Its record holds one integer for all of
them, `Block.slot`: the global slot id (kvd.core.slot_pool) of its copy in
the fastest tier that has one, or NO_SLOT. That pool's `below` array holds
the global id of the next copy down, and so on: a chain ordered by tier,
fastest first. Adding a tier therefore adds no field to `Block`: its pool
brings its own `below` and `resident_children` arrays, one entry per slot.

Each tier also counts, per resident block, how many of its children have a
copy in the same tier (`resident_children`): a memory tier's eviction
candidates are the blocks with none, so a cached prefix leaves from its
tail inward and what stays is reachable by a prefix match. A child may be
resident where its parent is not (a Put extending a prefix that is on disk
only); its count waits in the pool's `stray_children` until the parent
arrives.

With host memory first at global id 0 (the daemon's stack), a block whose
`slot` is below the host pool's end is in host memory at that very slot:
`host_slot` answers that without walking.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvd.core.block import NO_SLOT, Block
from kvd.core.tier import Tier, TierId
from kvd.invariants import check


class TierStack:
    """The tiers, fastest first, and every block's residency chain through them."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        check(bool(tiers), "a stack needs a tier")
        check(len({tier.tier_id for tier in tiers}) == len(tiers), "a tier id appears twice in the stack")
        spans = sorted((tier.pool.base, tier.pool.end) for tier in tiers)
        check(all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "tiers' slot ids overlap")
        self.tiers: list[Tier] = list(tiers)
        for rank, tier in enumerate(self.tiers):
            tier.rank = rank
        self.by_id: dict[TierId, Tier] = {tier.tier_id: tier for tier in self.tiers}
        # Lookup order for a global id: by base.
        self._by_base = sorted(self.tiers, key=lambda tier: tier.pool.base)
        first = self.tiers[0]
        # Fast path: the fastest tier's pool starts at global id 0.
        self._top_end = first.pool.end if first.pool.base == 0 else 0
        # For tier_ids_of: each tier's end and id byte, by base.
        self._ends = np.array([tier.pool.end for tier in self._by_base], dtype=np.int64)
        self._id_bytes = np.array([int(tier.tier_id) for tier in self._by_base], dtype=np.uint8)

    def __iter__(self):
        return iter(self.tiers)

    def __len__(self) -> int:
        return len(self.tiers)

    def tier_ids_of(self, gids: np.ndarray) -> np.ndarray:
        """The TierId byte of the tier owning each global slot id (one numpy pass)."""
        if len(gids):
            check(int(gids.min()) >= self._by_base[0].pool.base and int(gids.max()) < int(self._ends[-1]),
                  "a global slot id belongs to no tier")
        return self._id_bytes[np.searchsorted(self._ends, gids, side="right")]

    def copies_by_tier(self, gids: np.ndarray) -> list[np.ndarray]:
        """The local slots of every copy of the blocks whose chains start at `gids`
        (NO_SLOT: no copy), one array per tier in stack order: each block's copies
        in all its tiers, not only the fastest. One numpy pass per tier a chain
        goes through (a chain only goes down the stack), never a loop per block."""
        found: list[list[np.ndarray]] = [[] for _ in self.tiers]
        current = gids[gids >= 0]
        while len(current):
            check(int(current.min()) >= self._by_base[0].pool.base and int(current.max()) < int(self._ends[-1]),
                  "a global slot id belongs to no tier")
            positions = np.searchsorted(self._ends, current, side="right")
            below = []
            for position in np.unique(positions).tolist():
                pool = self._by_base[position].pool
                slots = current[positions == position] - pool.base
                found[self._by_base[position].rank].append(slots)
                # The pool's `below` links, read in place (int64, like array "q").
                nexts = np.frombuffer(pool.below, dtype=np.int64)[slots]
                below.append(nexts[nexts >= 0])
            current = np.concatenate(below)
        return [np.concatenate(parts) if parts else np.empty(0, dtype=np.int64) for parts in found]

    def tier_at(self, gid: int) -> Tier:
        for tier in self._by_base:
            if gid < tier.pool.end:
                check(gid >= tier.pool.base, "global slot id {} belongs to no tier", gid)
                return tier
        raise AssertionError(f"global slot id {gid} belongs to no tier")

    # -- reading -----------------------------------------------------------

    def slot_in(self, block: Block, tier: Tier) -> int:
        """`block`'s slot in `tier`, or NO_SLOT if it has no copy there."""
        gid = block.slot
        if tier.rank == 0 and self._top_end:
            # The first tier's copy, if any, heads the chain (NO_SLOT is below 0).
            return gid if gid < self._top_end else NO_SLOT
        while gid >= 0:
            holder = self.tier_at(gid)
            if holder is tier:
                return gid - holder.pool.base
            if holder.rank > tier.rank:
                break
            gid = holder.pool.below[gid - holder.pool.base]
        return NO_SLOT

    def top(self, block: Block) -> Tier | None:
        """The fastest tier holding a copy of `block`, if any."""
        return self.tier_at(block.slot) if block.slot >= 0 else None

    def copies(self, block: Block) -> list[tuple[Tier, int]]:
        """(tier, slot) of every copy, fastest first."""
        found = []
        gid = block.slot
        while gid >= 0:
            holder = self.tier_at(gid)
            slot = gid - holder.pool.base
            found.append((holder, slot))
            gid = holder.pool.below[slot]
        return found

    def resident_children(self, block: Block, tier: Tier) -> int:
        """How many of `block`'s children have a copy in `tier`."""
        slot = self.slot_in(block, tier)
        if slot == NO_SLOT:
            return tier.pool.stray_children.get(block, 0)
        return tier.pool.resident_children[slot]

    # -- changing ------------------------------------------------------------

    def add_copy(self, block: Block, tier: Tier, slot: int) -> None:
        """`block` now has a copy in `slot` of `tier` (which it owns already)."""
        pool = tier.pool
        check(pool.owners[slot] is block and slot not in pool.incoming, "{!r} does not own slot {}", block, slot)
        above: Tier | None = None
        above_slot = NO_SLOT
        gid = block.slot
        # The first tier's copy goes at the head: no walk.
        check(tier.rank or not pool.base <= gid < pool.end, "{!r} has a copy in {} already", block, tier.name)
        while gid >= 0 and tier.rank:
            holder = self.tier_at(gid)
            check(holder is not tier, "{!r} has a copy in {} already", block, tier.name)
            if holder.rank > tier.rank:
                break
            above, above_slot = holder, gid - holder.pool.base
            gid = holder.pool.below[above_slot]
        pool.below[slot] = gid
        if above is None:
            block.slot = pool.ids[slot]
        else:
            above.pool.below[above_slot] = pool.ids[slot]
        pool.resident_children[slot] = pool.stray_children.pop(block, 0)
        parent = block.parent
        if parent is not None:
            parent_slot = self.slot_in(parent, tier)
            if parent_slot != NO_SLOT:
                pool.resident_children[parent_slot] += 1
            else:
                pool.stray_children[parent] = pool.stray_children.get(parent, 0) + 1

    def drop_copy(self, block: Block, tier: Tier) -> int:
        """`block` no longer has a copy in `tier`; returns the slot it had (still owned)."""
        pool = tier.pool
        above: Tier | None = None
        above_slot = NO_SLOT
        gid = block.slot
        while gid >= 0 and not (gid < self._top_end and tier.rank == 0):
            holder = self.tier_at(gid)
            if holder is tier:
                break
            check(holder.rank < tier.rank, "{!r} has no copy in {}", block, tier.name)
            above, above_slot = holder, gid - holder.pool.base
            gid = holder.pool.below[above_slot]
        check(gid >= 0, "{!r} has no copy in {}", block, tier.name)
        slot = gid - pool.base
        below = self._canonical(pool.below[slot])
        if above is None:
            block.slot = below
        else:
            above.pool.below[above_slot] = below
        pool.below[slot] = NO_SLOT
        children = pool.resident_children[slot]
        if children:
            pool.stray_children[block] = children
            pool.resident_children[slot] = 0
        parent = block.parent
        if parent is not None:
            parent_slot = self.slot_in(parent, tier)
            if parent_slot != NO_SLOT:
                check(pool.resident_children[parent_slot] > 0, "resident child count underflow")
                pool.resident_children[parent_slot] -= 1
            else:
                left = pool.stray_children[parent] - 1
                if left:
                    pool.stray_children[parent] = left
                else:
                    del pool.stray_children[parent]
        return slot

    def _canonical(self, gid: int) -> int:
        """The pool's own int object for `gid` (what the free list holds), so no block owns a copy."""
        if gid < 0:
            return NO_SLOT
        holder = self.tier_at(gid)
        return holder.pool.ids[gid - holder.pool.base]

    # -- checking --------------------------------------------------------------

    def verify_block(self, block: Block, resident: dict[Tier, dict[Block, int]]) -> None:
        """One block's chain: ordered, owned; counts each copy's parent in `resident`."""
        rank = -1
        for holder, slot in self.copies(block):
            check(holder.rank > rank, "{!r}: copies out of tier order", block)
            rank = holder.rank
            check(holder.pool.owners[slot] is block, "{!r} does not own its slot {} in {}", block, slot, holder.name)
            check(slot not in holder.pool.incoming, "{!r} resident in an incoming slot", block)
            if block.parent is not None:
                counts = resident[holder]
                counts[block.parent] = counts.get(block.parent, 0) + 1

    def verify_children(self, resident: dict[Tier, dict[Block, int]]) -> None:
        """Every tier's resident-children counts, against what verify_block counted."""
        for tier in self.tiers:
            pool = tier.pool
            counted = resident[tier]
            strays = {}
            for parent, count in counted.items():
                slot = self.slot_in(parent, tier)
                if slot == NO_SLOT:
                    strays[parent] = count
                else:
                    check(pool.resident_children[slot] == count, "{!r}: {} children in {}, counted {}",
                          parent, pool.resident_children[slot], tier.name, count)
            check(strays == pool.stray_children, "stray child counts in {} drifted", tier.name)
            for slot, owner in enumerate(pool.owners):
                if owner is not None and pool.resident_children[slot]:
                    check(owner in counted, "{!r} counts children in {} it does not have", owner, tier.name)

    def verify(self) -> None:
        for tier in self.tiers:
            tier.verify()
            pool = tier.pool
            for slot, owner in enumerate(pool.owners):
                if owner is not None and slot not in pool.incoming:
                    check(self.slot_in(owner, tier) == slot, "{!r} does not know its slot {} in {}",
                          owner, slot, tier.name)
                elif owner is None:
                    check(pool.below[slot] == NO_SLOT and pool.resident_children[slot] == 0,
                          "free slot {} of {} has residency left", slot, tier.name)
