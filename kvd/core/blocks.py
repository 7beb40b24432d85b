"""The block lifecycle over the tier stack: every change to a block's state is made here.

`BlockLifecycle` is the handle owner (kvd.core.block.HandleOwner): it pins and
unpins blocks, seals them, aborts unsealed ones, and takes blocks out of
the index (removed) or out of service (lost, tombstones while pinned). It
moves residency (host memory and the tiers below it) with the tier stack
and keeps the host tier's eviction candidates in step: a block is a
candidate exactly while it is sealed, unpinned, resident in host memory
and without a child resident there. Sealed blocks a lower tier's admission
filter accepts go on that tier's write-back queue here; the write-back
module (kvd.core.writeback) drains each.

Everything else in the core decides *what* to change and calls this.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

import numpy as np

from kvd.core.block import NO_SLOT, Block, BlockHandle, BlockState
from kvd.core.events import EventLog
from kvd.core.prefetch_ledger import PrefetchLedger
from kvd.core.residency import TierStack
from kvd.core.slot_pool import SlotClass
from kvd.core.tier import MemoryTier, StorageTier, Tier, TierId
from kvd.core.write_queue import WriteQueue
from kvd.invariants import InvariantError, check

_SLOT_OF = attrgetter("slot")


class BlockLifecycle:
    def __init__(self, host: MemoryTier, lower: Sequence[StorageTier], events: EventLog, ledger: PrefetchLedger,
                 write_queue_max: int) -> None:
        # The stack: host memory first, at global slot id 0; then the tiers
        # below it, fastest first (a middle memory tier, the disk).
        self.host = host
        self.lower: list[StorageTier] = list(lower)
        self.tiers = TierStack([host, *self.lower])
        check(host.rank == 0 and host.pool.base == 0, "host memory heads the stack at slot id 0")
        persistent = [tier for tier in self.lower if tier.caps.persistent]
        check(len(persistent) <= 1, "one persistent tier at most")
        # The durable tier: what ACK_DURABLE, tenants' disk quotas and recovery mean.
        self.disk: StorageTier | None = persistent[0] if persistent else None
        self._host_end = host.pool.end
        # Stored / removed / tier-changed events for KV-aware routers.
        self.events = events
        self.ledger = ledger
        # Per lower tier, sealed blocks waiting to be written there, in seal
        # order, so a parent is always written no later than its children.
        self.write_queues: dict[StorageTier, WriteQueue] = {tier: WriteQueue() for tier in self.lower}
        self.write_queue_max = write_queue_max
        self.write_queue_dropped = 0
        # Blocks whose host slot is being filled from a lower tier.
        self.loading: set[Block] = set()
        self.live_handles = 0
        self.leaked_handles = 0
        self.pinned_blocks = 0

    @property
    def write_queue(self) -> WriteQueue:
        """The durable tier's write-back queue (an empty one without a disk)."""
        return self.write_queues[self.disk] if self.disk is not None else WriteQueue()

    def acquire(self, block: Block) -> BlockHandle:
        check(block.state == BlockState.SEALED, "read handle on {!r}", block)
        self.withdraw(block)
        if block.ref_count == 0:
            self.pinned_blocks += 1
        block.ref_count += 1
        self.live_handles += 1
        return BlockHandle(self, block, writer=False)

    def writer_handle(self, block: Block) -> BlockHandle:
        check(block.ref_count == 0 and block.state == BlockState.WRITABLE, "writer handle on a used block")
        block.ref_count = 1
        self.pinned_blocks += 1
        self.live_handles += 1
        return BlockHandle(self, block, writer=True)

    def _seal(self, block: Block) -> None:
        check(block.parent is None or block.parent.state == BlockState.SEALED, "seal before the parent")
        block.state = BlockState.SEALED
        self.host.counters.sealed += 1
        if block.index.disk_enabled:
            for tier in self.lower:
                if tier.admission.record(block.key):
                    self.queue_write(block, tier)

    def queue_write(self, block: Block, tier: StorageTier) -> None:
        queue = self.write_queues[tier]
        if len(queue) < self.write_queue_max:
            queue.append(block)
        else:
            self.write_queue_dropped += 1

    def _drop_reference(self, block: Block, *, writer: bool) -> None:
        self.live_handles -= 1
        check(block.ref_count > 0, "reference count underflow on {!r}", block)
        block.ref_count -= 1
        if block.ref_count == 0:
            self.pinned_blocks -= 1
        if writer and block.state == BlockState.WRITABLE:
            check(block.ref_count == 0, "a writable block has exactly one reference")
            check(block not in self.loading, "abort of a block being loaded")
            check(block.first_child is None, "abort of a writable block with children: abort tail first")
            self.host.counters.aborted += 1
            self.remove(block, cold_parent=False)
            return
        if block.state == BlockState.LOST:
            self.bury(block)
            return
        check(block.state == BlockState.SEALED, "reference dropped on {!r}", block)
        self.maybe_admit(block, cold=False)

    def _count_leak(self) -> None:
        self.leaked_handles += 1

    def host_slot(self, block: Block) -> int:
        """`block`'s slot in host memory, or NO_SLOT.

        Host memory heads this stack at global slot id 0, so a block's
        chain starts with its host copy if it has one (TierStack.slot_in's
        fast path, inlined: this is on every hot path)."""
        slot = block.slot
        return slot if slot < self._host_end else NO_SLOT

    def disk_slot(self, block: Block) -> int:
        """`block`'s slot in the durable tier, or NO_SLOT (also without one)."""
        return NO_SLOT if self.disk is None else self.tiers.slot_in(block, self.disk)

    def lower_copy(self, block: Block) -> tuple[StorageTier, int] | None:
        """`block`'s fastest copy below host memory: (tier, slot), or None."""
        gid = block.slot
        if 0 <= gid < self._host_end:
            gid = self.host.pool.below[gid]
        if gid < 0:
            return None
        tier = self.tiers.tier_at(gid)
        return tier, gid - tier.pool.base  # type: ignore[return-value]

    def has_other_copy(self, block: Block, tier: Tier) -> bool:
        """Whether `block` has a copy in some tier other than `tier`."""
        return any(holder is not tier for holder, _ in self.tiers.copies(block))

    def tier_of(self, block: Block) -> TierId:
        """The tier a Get would serve `block` from now: its fastest copy, not
        counting a host copy whose bytes are still being read in."""
        loading = block in self.loading
        if 0 <= block.slot < self._host_end and not loading:
            return TierId.HOST  # the common case, without a walk
        for tier, _ in self.tiers.copies(block):
            if not (loading and tier is self.host):
                return tier.tier_id
        raise InvariantError(f"{block!r} resides in no tier")

    def tier_bytes(self, blocks: Sequence[Block]) -> bytes:
        """tier_of each block, as one TierId byte each, in one pass (a
        Lookup of thousands of blocks; every block resides somewhere)."""
        gids = np.fromiter(map(_SLOT_OF, blocks), dtype=np.int64, count=len(blocks))
        codes = self.tiers.tier_ids_of(gids)
        if self.loading:
            # A host copy still being read in does not count: those few walk their chain.
            for position in np.flatnonzero(codes == int(TierId.HOST)).tolist():
                if blocks[position] in self.loading:
                    codes[position] = int(self.tier_of(blocks[position]))
        return codes.tobytes()

    @staticmethod
    def block_bytes(block: Block) -> int:
        return block.index.block_bytes

    def host_class(self, block: Block) -> SlotClass:
        """The host pool's slot class `block`'s namespace takes."""
        return self.host.pool.classes[block.index.host_class]

    def set_host_slot(self, block: Block, slot: int) -> None:
        check(self.host_slot(block) == NO_SLOT, "{!r} has a host slot already", block)
        host = self.host
        host.pool.assign(slot, block)
        self.tiers.add_copy(block, host, slot)
        host.pool.used_bytes += self.block_bytes(block)
        if block.index.quota is not None:
            block.index.quota.host_used_bytes += self.host_class(block).slot_bytes
        if block.parent is not None:
            # It has a child in host memory now: no longer a candidate.
            self.withdraw(block.parent)

    def clear_host_slot(self, block: Block, *, cold_parent: bool) -> None:
        slot = self.host_slot(block)
        check(slot != NO_SLOT and self.host.pool.owners[slot] is block, "host slot owner mismatch")
        self.ledger.left_host(block)
        self.withdraw(block)
        host = self.host
        self.tiers.drop_copy(block, host)
        host.pool.release(slot, block)
        host.pool.used_bytes -= self.block_bytes(block)
        if block.index.quota is not None:
            block.index.quota.host_used_bytes -= self.host_class(block).slot_bytes
        if block.parent is not None:
            self.maybe_admit(block.parent, cold=cold_parent)

    def free_slot(self, block: Block, tier: StorageTier) -> None:
        """Drop a block's copy in a lower tier; a persistent tier's slot waits for a durable REMOVE."""
        slot = self.tiers.slot_in(block, tier)
        check(slot != NO_SLOT and tier.pool.owners[slot] is block, "{} slot owner mismatch", tier.name)
        self.tiers.drop_copy(block, tier)
        tier.pool.release(slot, block)
        tier.pool.used_bytes -= self.block_bytes(block)
        if tier is self.disk and block.index.quota is not None:
            block.index.quota.disk_used_bytes -= tier.pool.slot_bytes_of(slot)

    def free_lower_slots(self, block: Block) -> None:
        for tier, _ in self.tiers.copies(block):
            if tier is not self.host:
                self.free_slot(block, tier)  # type: ignore[arg-type]

    def evict_from_host(self, victim: Block) -> None:
        """Free the host slot of `victim`, an eviction candidate."""
        host = self.host
        # Evicting a host leaf may make its parent one: it goes next in line,
        # so a cold prefix leaves the host tier from its tail inward.
        lower = self.lower_copy(victim)
        if lower is not None:
            # A copy below exists: only the host copy goes.
            self.clear_host_slot(victim, cold_parent=True)
            host.counters.demotions += 1
            self.events.tier_changed(victim.index.namespace_id, victim.key, lower[0].tier_id)
        elif victim.first_child is None:
            if self.disk is not None and victim.index.disk_enabled and not self.disk.admission.admits(victim.key):
                # Dropped, never written: the admission filter turned it away.
                self.disk.counters.admission_rejected += 1
            else:
                host.counters.dropped += 1
            self.remove(victim, cold_parent=True)
        else:
            # Dirty with descendants that are gone from every tier but still
            # pinned as tombstones: the whole subtree goes.
            host.counters.dropped += 1
            self.lose(victim)

    def remove(self, block: Block, *, cold_parent: bool) -> None:
        """Take a childless, unpinned block out of its index and its slot."""
        check(block.ref_count == 0, "removal of pinned {!r}", block)
        if block.state == BlockState.SEALED:
            # Writable blocks were never announced; tombstones were when lost.
            self.events.removed(block.index.namespace_id, block.key)
        self.withdraw(block)
        if self.host_slot(block) != NO_SLOT:
            self.clear_host_slot(block, cold_parent=cold_parent)
        self.free_lower_slots(block)
        parent = block.index.remove(block)
        if parent is not None:
            if parent.state == BlockState.LOST:
                self.bury(parent)
            else:
                self.maybe_admit(parent, cold=cold_parent)

    def lose(self, block: Block) -> None:
        """`block` and everything under it can no longer be served.

        Each loses its slots; those nobody pins leave the index at once
        (leaves first), the rest stay as LOST tombstones until released.
        Costs two walks of the subtree (kvd.core.radix's child links), not
        of the index.
        """
        for member in block.index.subtree(block):
            if member.state == BlockState.LOST:
                continue
            if member.state == BlockState.SEALED:
                self.events.removed(member.index.namespace_id, member.key)
            self.withdraw(member)
            # A member being loaded keeps its host slot until its read is
            # over (finish_loads frees it): the disk thread may still be
            # writing into it, so handing it to another block now could
            # corrupt that block. Its loader pins it, so it stays a tombstone.
            # Likewise a writable member: its writer is filling the slot and
            # keeps it until it lets the block go (commit seals nothing LOST).
            if self.host_slot(member) != NO_SLOT and member not in self.loading and member.state != BlockState.WRITABLE:
                self.clear_host_slot(member, cold_parent=False)
            self.free_lower_slots(member)
            member.state = BlockState.LOST
        for member in block.index.subtree(block):
            if member.state == BlockState.LOST and member.ref_count == 0 and member.first_child is None:
                self.remove(member, cold_parent=False)

    def bury(self, block: Block) -> None:
        """Remove a tombstone once nothing pins it and nothing hangs under it."""
        if block.state == BlockState.LOST and block.ref_count == 0 and block.first_child is None:
            self.remove(block, cold_parent=False)

    def maybe_admit(self, block: Block, *, cold: bool) -> None:
        if (
            block.state == BlockState.SEALED
            and block.ref_count == 0
            and self.tiers.resident_children(block, self.host) == 0
            and self.host_slot(block) != NO_SLOT
            and block not in self.host.policy
        ):
            self.host.policy.admit(block, cold=cold)
            quota = block.index.quota
            if quota is not None and quota.tracks_candidates:
                quota.candidates[block] = None
                if cold:
                    quota.candidates.move_to_end(block, last=False)

    def withdraw(self, block: Block) -> None:
        if block in self.host.policy:
            self.host.policy.remove(block)
            quota = block.index.quota
            if quota is not None and quota.tracks_candidates:
                del quota.candidates[block]

    def touch_prefix(self, matched: Sequence[Block]) -> None:
        # Only a prefix's last block can be a leaf, so only it can be a
        # candidate: touching it is O(1) however long the prefix.
        if matched:
            last = matched[-1]
            if last in self.host.policy:
                self.host.policy.touch(last)
                quota = last.index.quota
                if quota is not None and quota.tracks_candidates:
                    quota.candidates.move_to_end(last)

    def note_sightings(self, matched: Sequence[Block]) -> None:
        """A Get or a repeated Put saw these blocks (one chain): tell each lower
        tier's admission filter, and queue for writing those that just qualified."""
        if not matched or not matched[0].index.disk_enabled:
            return
        for tier in self.lower:
            if not tier.admission.active:
                continue
            for position in tier.admission.record_many([block.key for block in matched]):
                block = matched[position]
                if self.host_slot(block) != NO_SLOT and self.tiers.slot_in(block, tier) == NO_SLOT:
                    self.queue_write(block, tier)

