"""Write-back bookkeeping for one tier below host memory: which sealed blocks go there next, into which slots.

Each lower tier (the disk; a middle memory tier) has its own `WriteBack`
over its own queue (kvd.core.blocks), in seal order, so a parent is always
written no later than its children. `pick_writes` takes the next batch,
pins each block and gives it a slot in the tier (a free one, or the
tier's eviction victim's); for a persistent tier the caller journals the
removals of evicted blocks before it writes any bytes (so no replay after
a crash pairs an old record with new bytes), writes the batch and reports
each block's outcome to `finish_writes`. In every lower tier a block's
whole prefix is there too: a block whose parent has no copy in the tier is
never written to it, and a block leaves it only when no child has a copy
there (and, if it has no copy elsewhere, when it has no child at all).

Tenants' disk quotas apply to the durable tier only.

Bounded turns. Each `pick_writes` call (a writer turn) lets the tier's
eviction policy look at no more than `scan_slots_per_turn` slots in all,
however many slots the tier has; a search cut short gives NO_SLOT (full
for now), `cut_short` tells the writer to take its next turn at once,
and that turn's search goes on where the hand stopped. What each search
looked at without finding a victim is added up across turns: once it
covers two sweeps of the tier, nothing it wants may go (for now), as a
single search of two sweeps used to conclude, and the writer waits
before its next turn (a tenant at its disk quota with nothing of its own
to give up is refused; a slot class with no block of its own to evict
takes a page of another class).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

from kvd.core.block import NO_SLOT, Block, BlockState
from kvd.core.blocks import BlockLifecycle
from kvd.core.policy import ScanBudget
from kvd.core.quota import TenantQuota
from kvd.core.slot_pool import SlotClass
from kvd.core.tier import StorageTier
from kvd.core.transfer import Transfer
from kvd.invariants import check

# Slots a writer turn's victim searches may look at in all. On a full disk
# of chains of 32 blocks (bench/bench_loop_time.py), a turn of 64 writes
# (the daemon's default batch) looks at 550-1,900 slots (median, 10k to 1M
# slots) and 2,000 at the 99th percentile, until a stretch of slots with
# nothing that may go comes under the hand: that took a whole sweep (1.5 s
# at a million slots), and now takes turns of this many looks, whatever
# the disk's size. A look costs about 1 us at 10k slots and 2 us at 1M
# (cache misses), so a larger budget would make a 1M disk's capped turns
# slower than a small one's by more than the 1.5x issue 35 allows.
SCAN_SLOTS_PER_TURN = 2048
# The search for any evictable block (allocate_slot), as the searches are counted.
ANY_BLOCK = "any block"


class WriteBack:
    def __init__(self, blocks: BlockLifecycle, tier: StorageTier, scan_slots_per_turn: int = SCAN_SLOTS_PER_TURN) -> None:
        check(tier in blocks.lower, "write-back goes to a tier below host memory")
        check(scan_slots_per_turn > 0, "a writer turn must be able to look at a slot")
        self.blocks = blocks
        self.host = blocks.host
        self.tier = tier
        self.queue = blocks.write_queues[tier]
        # Tenants' disk quotas bind in the durable tier only.
        self.quotas = tier is blocks.disk
        # Parents of the blocks being written here, with how many: their
        # copies here stay until those writes end (a child needs its parent).
        self.writing_parents: dict[Block | None, int] = {}  # None: roots
        self.scan_slots_per_turn = scan_slots_per_turn
        # What this turn's victim searches may still look at.
        self.scan = ScanBudget(0)
        # Per search (any block, a slot class's own, a tenant's own): slots
        # looked at since it last found a victim.
        self.fruitless: dict[Hashable, int] = {}
        # Whether this turn's budget ran out before some search could tell.
        self.cut_short = False

    def pick_writes(self, limit: int) -> list[Transfer]:
        """The next sealed blocks to write to this tier, parents before children.

        Each is pinned (so it stays in the host tier while its bytes are
        read) and gets a slot here, possibly one just taken from an evicted
        block: for a persistent tier the caller must make take_removals()
        durable before it writes any of these blocks, so no replay pairs an
        old record with new bytes. A block whose parent has no copy here and
        is not in this batch is skipped for good: a block's whole prefix is
        always in the tier with it, so recovery never finds orphans.
        """
        picks: list[Transfer] = []
        picked: set[Block] = set()
        full_tenants: set[TenantQuota] = set()
        queue = self.queue
        self.scan = ScanBudget(self.scan_slots_per_turn)
        self.cut_short = False
        while queue and len(picks) < limit:
            block = queue[0]
            if self._skip(block, picked):
                queue.popleft()
                continue
            # The block's parent keeps its copy here while a slot is found for it.
            self._mark_parent(block.parent)
            try:
                slot = self._slot_for(block, full_tenants)
            finally:
                self._unmark_parent(block.parent)
            if slot is None:
                queue.popleft()  # its tenant is at its disk quota with nothing of its own to give up
                continue
            if slot == NO_SLOT:
                break  # full until evictions' removals are journalled, or until the next turn's search
            queue.popleft()
            picks.append(self._start_write(block, slot))
            picked.add(block)
        return picks

    def _skip(self, block: Block, picked: set[Block]) -> bool:
        """Whether the queue's head is dropped unwritten: gone, there already,
        without bytes in host memory, queued twice, too large for this tier's
        slots, or its parent has no copy in the tier (counted)."""
        tier = self.tier
        if (block.state != BlockState.SEALED or self.blocks.tiers.slot_in(block, tier) != NO_SLOT
                or self.blocks.host_slot(block) == NO_SLOT or block in picked
                or block.index.block_bytes > tier.slot_bytes):
            return True
        parent = block.parent
        if parent is None or self.blocks.tiers.slot_in(parent, tier) != NO_SLOT or parent in picked:
            return False
        quota = block.index.quota
        if self.quotas and quota is not None and quota.disk_full(tier.pool.class_for(block.index.block_bytes).slot_bytes):
            quota.counters.disk_refused += 1  # most likely its parent was, for the same reason
        else:
            tier.counters.write_failures += 1
        return True

    def _slot_for(self, block: Block, full_tenants: set[TenantQuota]) -> int | None:
        """A slot for `block`; NO_SLOT when none may be had now; None when its
        tenant's disk quota refuses it (the tenant joins `full_tenants`)."""
        quota = block.index.quota
        slot_class = self.tier.pool.class_for(block.index.block_bytes)
        if not (self.quotas and quota is not None and quota.disk_full(slot_class.slot_bytes)):
            return self.allocate_slot(slot_class)
        # The tenant's own block makes room, never another tenant's; or it is not written.
        # A tenant found with nothing to give up is not searched again in this call.
        slot = NO_SLOT if quota in full_tenants else self.take_own_slot(quota, slot_class)
        if slot != NO_SLOT:
            return slot
        if quota not in full_tenants and not self.searched_all(self._tenant_search(quota, slot_class)):
            return NO_SLOT  # the searches so far looked at too few slots to tell: a later turn goes on
        full_tenants.add(quota)
        quota.counters.disk_refused += 1
        return None

    def _start_write(self, block: Block, slot: int) -> Transfer:
        tier = self.tier
        tier.pool.assign(slot, block)
        if self.quotas and block.index.quota is not None:
            block.index.quota.disk_used_bytes += tier.pool.slot_bytes_of(slot)
        tier.pool.incoming.add(slot)
        self._mark_parent(block.parent)
        return Transfer(block, self.host, self.blocks.host_slot(block), tier, slot, self.blocks.acquire(block))

    def finish_writes(self, writes: Sequence[Transfer], ok: Sequence[bool]) -> None:
        """Record which writes landed. Failed slots of a persistent tier need a
        REMOVE first: their record may have reached the manifest."""
        tier = self.tier
        check(len(writes) == len(ok), "one outcome per write")
        for write, good in zip(writes, ok):
            block = write.block
            check(write.target is tier and write.target_slot in tier.pool.incoming
                  and tier.pool.owners[write.target_slot] is block, "unknown write to {}", tier.name)
            tier.pool.incoming.discard(write.target_slot)
            parent = block.parent
            self._unmark_parent(parent)
            whole_prefix = parent is None or self.blocks.tiers.slot_in(parent, tier) != NO_SLOT
            if good and whole_prefix and block.state == BlockState.SEALED:
                self.blocks.tiers.add_copy(block, tier, write.target_slot)
                tier.pool.used_bytes += self.blocks.block_bytes(block)
                tier.eviction.touch(write.target_slot)
                tier.counters.written += 1
            else:
                tier.pool.release(write.target_slot, block)
                if self.quotas and block.index.quota is not None:
                    block.index.quota.disk_used_bytes -= tier.pool.slot_bytes_of(write.target_slot)
                tier.counters.write_failures += 1
            write.handle.release()

    def _mark_parent(self, parent: Block | None) -> None:
        self.writing_parents[parent] = self.writing_parents.get(parent, 0) + 1

    def _unmark_parent(self, parent: Block | None) -> None:
        left = self.writing_parents.pop(parent) - 1
        if left:
            self.writing_parents[parent] = left

    def verify(self) -> None:
        pool = self.tier.pool
        writing: dict[Block | None, int] = {}
        for slot in pool.incoming:
            parent = pool.owners[slot].parent
            writing[parent] = writing.get(parent, 0) + 1
        check(writing == self.writing_parents, "{}: the parents of the writes in flight drifted", self.tier.name)
        check(self.scan.left >= 0, "{}: scan budget overdrawn ({})", self.tier.name, self.scan.left)
        check(all(looked >= 0 for looked in self.fruitless.values()), "{}: a negative count of looks", self.tier.name)

    def take_removals(self) -> list[tuple[bytes, bytes, int]]:
        """(namespace id, key, slot) whose REMOVE must be journalled (persistent tiers)."""
        return self.tier.pool.take_removals()

    def removals_journalled(self, slots: Sequence[int]) -> None:
        self.tier.pool.removals_journalled(slots)

    def require_durable(self, blocks: Iterable[Block]) -> None:
        """A client asked for these blocks to be durable (ACK_DURABLE, a
        durable retry, MakeDurable): queue the blocks of their chains that
        have no copy in this tier and are not queued, parents first, whatever
        the admission filter said and however full the queue is (bounded by
        the pins the waiting calls hold). A block is queued again after its
        parent when the parent had to be, because the writer never writes a
        child ahead of its parent; the copy further ahead is skipped."""
        tier = self.tier
        seen: set[Block] = set()
        # Appended by this call: a child of one of them goes again too, even
        # when an earlier block of the call walked that parent's chain.
        appended: set[Block] = set()
        for block in blocks:
            chain = []
            node: Block | None = block
            while node is not None and self.blocks.tiers.slot_in(node, tier) == NO_SLOT and node not in seen:
                seen.add(node)
                chain.append(node)
                node = node.parent
            if not chain:
                continue
            again = False
            for member in reversed(chain):
                if (member.state != BlockState.SEALED or self.blocks.host_slot(member) == NO_SLOT
                        or not member.index.disk_enabled):
                    continue
                again = again or member not in self.queue or member.parent in appended
                if again:
                    self.queue.append(member)
                    appended.add(member)

    def allocate_slot(self, slot_class: SlotClass | None = None) -> int:
        """A free slot of `slot_class` (default: the largest), or the slot of the
        tier's eviction victim; NO_SLOT if none may go (yet)."""
        pool = self.tier.pool
        if slot_class is not None and len(pool.classes) > 1:
            return self.class_slot(slot_class)
        slot = pool.take_free()
        if slot != NO_SLOT:
            return slot
        victim = self.victim(self.evictable, ANY_BLOCK)
        return NO_SLOT if victim is None else self.evict(victim)

    def class_slot(self, slot_class: SlotClass) -> int:
        """With slot classes: a free slot of the class, else a free page, else
        the slot of the class's own eviction victim; failing those, the
        eviction policy's victim of any class has its whole page emptied
        (the page's evictable blocks, leaves first) and, if that empties
        it, the page goes to this class. NO_SLOT when nothing was freed for
        the class this time (a later round goes on where this one stopped)."""
        pool = self.tier.pool
        slot = pool.take_free(slot_class)
        if slot != NO_SLOT:
            return slot
        if pool.take_page(slot_class):
            return pool.take_free(slot_class)
        own = ("class", slot_class.index)
        if not self.searched_all(own):
            victim = self.victim(lambda block: self.evictable(block) and self.class_index(block) == slot_class.index,
                                 own)
            if victim is not None:
                return self.evict(victim)
            if not self.searched_all(own):
                return NO_SLOT  # a later turn's search goes on
        # None of the class's own blocks may go: a page of any class (searched
        # again from the next turn on if this one's budget is spent).
        victim = self.victim(self.evictable, ANY_BLOCK)
        if victim is None:
            return NO_SLOT
        page = pool.page_of(self.blocks.tiers.slot_in(victim, self.tier))
        if not self.empty_page(page):
            return NO_SLOT
        pool.take_over_page(page, slot_class)
        # Once this page is full, the class's own blocks are searched again.
        self.fruitless.pop(own, None)
        return pool.take_free(slot_class)

    def evictable(self, block: Block) -> bool:
        """Whether the block's copy here may go: unpinned and sealed, and no
        child has a copy here (a block's prefix stays in the tier with it);
        a block with no other copy leaves the index with it, so it must
        have no child at all (an index leaf)."""
        if block.ref_count or block.state != BlockState.SEALED:
            return False
        if block.first_child is None:
            return True
        blocks = self.blocks
        return (block not in self.writing_parents and blocks.tiers.resident_children(block, self.tier) == 0
                and blocks.has_other_copy(block, self.tier))

    def class_index(self, block: Block) -> int:
        pool = self.tier.pool
        return pool.class_of(self.blocks.tiers.slot_in(block, self.tier)).index

    def empty_page(self, page: int) -> bool:
        """Evict the page's evictable blocks, leaves first; whether none is left on it."""
        pool = self.tier.pool
        slots = pool.page_slots(page, pool.classes[pool.page_class[page]])
        while True:
            residents = [(slot, pool.owners[slot]) for slot in slots if pool.owners[slot] is not None]
            ready = [block for slot, block in residents if slot not in pool.incoming and self.evictable(block)]
            if not ready:
                return not residents
            for block in ready:
                self.drop_copy(block)

    def victim(self, evictable: Callable[[Block], bool], search: Hashable) -> Block | None:
        """The eviction policy's victim among the `evictable` blocks, within
        this turn's scan budget; None if it found none. `search` keeps count
        of the slots it looked at in vain (see searched_all)."""
        pool = self.tier.pool
        before = self.scan.left
        victim = self.tier.eviction.victim(pool.owners, pool.incoming, evictable, self.scan)
        check(0 <= self.scan.left <= before, "the eviction policy overdrew its scan budget")
        if victim is not None:
            self.fruitless.pop(search, None)
            return victim
        self.fruitless[search] = self.fruitless.get(search, 0) + before - self.scan.left
        if self.scan.left == 0 and not self.searched_all(search):
            self.cut_short = True
        return None

    def searched_all(self, search: Hashable) -> bool:
        """Whether `search`'s looks since it last found a victim add up to two
        sweeps of the tier: then nothing it wants may go (its looks spread
        over turns, so this is a count, not a proof; it stays so until the
        search finds one)."""
        return self.fruitless.get(search, 0) >= 2 * self.tier.pool.slot_count

    def _tenant_search(self, quota: TenantQuota, slot_class: SlotClass | None) -> Hashable:
        index = None if slot_class is None or len(self.tier.pool.classes) == 1 else slot_class.index
        return (quota, index)

    def take_own_slot(self, quota: TenantQuota, slot_class: SlotClass | None = None) -> int:
        """The slot of one of the tenant's own blocks (the eviction policy's
        pick among them, of `slot_class` if given), evicted for a newer one;
        NO_SLOT if none may go, or none was found within this turn's budget."""
        search = self._tenant_search(quota, slot_class)
        index = search[1]  # type: ignore[index]
        victim = self.victim(lambda block: block.index.quota is quota and self.evictable(block)
                             and (index is None or self.class_index(block) == index), search)
        if victim is None:
            return NO_SLOT
        quota.counters.disk_evicted += 1
        return self.evict(victim)

    def evict(self, victim: Block) -> int:
        """Evict `victim`'s copy here (the block too, if it has no other) and hand out its slot."""
        slot = self.blocks.tiers.slot_in(victim, self.tier)
        self.drop_copy(victim)
        # Reused at once: for a persistent tier the caller journals
        # take_removals() before it writes the new bytes (see pick_writes).
        self.tier.pool.reuse(slot)
        return slot

    def drop_copy(self, victim: Block) -> None:
        """Evict `victim`'s copy here, and the block too if it has no other (counted)."""
        tier = self.tier
        tier.counters.evictions += 1
        if self.blocks.has_other_copy(victim, tier):
            self.blocks.free_slot(victim, tier)
        else:
            tier.counters.dropped += 1
            self.blocks.remove(victim, cold_parent=False)
