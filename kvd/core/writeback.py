"""Write-back bookkeeping: which sealed blocks go to disk next, into which slots.

Sealed blocks wait on the write-back queue (kvd.core.blocks) in seal order,
so a parent is always written no later than its children. `pick_writes`
takes the next batch, pins each block and gives it a disk slot (a free
one, or the disk policy's victim's); the caller journals the removals of
evicted blocks before it writes any bytes (so no replay after a crash pairs
an old record with new bytes), writes the batch and reports each block's
outcome to `finish_writes`. On disk a block's whole prefix is always on
disk too: a block whose parent has no durable copy is never written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvd.core.block import NO_SLOT, Block, BlockState
from kvd.core.blocks import BlockBook
from kvd.core.quota import TenantQuota
from kvd.core.transfer import Transfer
from kvd.invariants import check


def _disk_evictable(block: Block) -> bool:
    # An index leaf only, so a durable block's prefix stays durable.
    return block.ref_count == 0 and block.children == 0 and block.state == BlockState.SEALED


class WriteBack:
    def __init__(self, blocks: BlockBook) -> None:
        self.blocks = blocks
        self.host = blocks.host
        self.disk = blocks.disk

    def pick_writes(self, limit: int) -> list[Transfer]:
        """The next sealed blocks to write to disk, parents before children.

        Each is pinned (so it stays in the host tier while its bytes are
        read) and gets a disk slot, possibly one just taken from an evicted
        block: the caller must make take_disk_removals() durable before it
        writes any of these blocks, so no replay pairs an old record with
        new bytes. A block whose parent has no durable copy
        and is not in this batch is skipped for good: on disk, a block's
        whole prefix is always on disk too, so recovery never finds orphans.
        """
        disk = self.disk
        if disk is None:
            return []
        picks: list[Transfer] = []
        picked: set[Block] = set()
        full_tenants: set[TenantQuota] = set()
        queue = self.blocks.write_queue
        while queue and len(picks) < limit:
            block = queue[0]
            if (
                block.state != BlockState.SEALED
                or self.blocks.disk_slot(block) != NO_SLOT
                or self.blocks.host_slot(block) == NO_SLOT
                or block in picked
            ):
                queue.popleft()  # gone, already durable, no bytes to write, or queued twice
                continue
            quota = block.index.quota
            at_quota = quota is not None and quota.disk_full(disk.slot_bytes)
            parent = block.parent
            if parent is not None and self.blocks.disk_slot(parent) == NO_SLOT and parent not in picked:
                queue.popleft()
                if at_quota:
                    quota.counters.disk_refused += 1  # most likely its parent was, for the same reason
                else:
                    disk.counters.write_failures += 1
                continue
            if at_quota:
                # The tenant's own block makes room, never another tenant's; or it is not written.
                # A tenant found with nothing to give up is not searched again in this call:
                # each search may sweep every disk slot.
                slot = NO_SLOT if quota in full_tenants else self.take_own_disk_slot(quota)
                if slot == NO_SLOT:
                    full_tenants.add(quota)
                    queue.popleft()
                    quota.counters.disk_refused += 1
                    continue
            else:
                slot = self.allocate_disk_slot()
                if slot == NO_SLOT:
                    break  # full until evictions' removals are journalled
            queue.popleft()
            disk.pool.assign(slot, block)
            if quota is not None:
                quota.disk_used_bytes += disk.slot_bytes
            disk.pool.incoming.add(slot)
            picks.append(Transfer(block, self.host, self.blocks.host_slot(block), disk, slot, self.blocks.acquire(block)))
            picked.add(block)
        return picks

    def finish_writes(self, writes: Sequence[Transfer], ok: Sequence[bool]) -> None:
        """Record which writes are durable. Failed slots need a REMOVE first:
        their record may have reached the manifest."""
        disk = self.disk
        check(disk is not None and len(writes) == len(ok), "one outcome per write")
        for write, good in zip(writes, ok):
            block = write.block
            check(write.target_slot in disk.pool.incoming and disk.pool.owners[write.target_slot] is block, "unknown disk write")
            disk.pool.incoming.discard(write.target_slot)
            parent = block.parent
            durable_prefix = parent is None or self.blocks.disk_slot(parent) != NO_SLOT
            if good and durable_prefix and block.state == BlockState.SEALED:
                self.blocks.tiers.add_copy(block, disk, write.target_slot)
                disk.pool.used_bytes += self.blocks.block_bytes(block)
                disk.eviction.touch(write.target_slot)
                disk.counters.written += 1
            else:
                disk.pool.release(write.target_slot, block)
                if block.index.quota is not None:
                    block.index.quota.disk_used_bytes -= disk.slot_bytes
                disk.counters.write_failures += 1
            write.handle.release()

    def take_removals(self) -> list[tuple[bytes, bytes, int]]:
        """(namespace id, key, disk slot) whose REMOVE must be journalled."""
        if self.disk is None:
            return []
        return self.disk.pool.take_removals()

    def confirm_removals(self, slots: Sequence[int]) -> None:
        self.disk.pool.confirm_removals(slots)

    def require_durable(self, blocks: Iterable[Block]) -> None:
        """A client asked for these blocks to be durable (ACK_DURABLE, a
        durable retry, MakeDurable): queue the blocks of their chains that
        have no disk copy and are not queued, parents first, whatever the
        admission filter said and however full the queue is (bounded by the
        pins the waiting calls hold). A block is queued again after its
        parent when the parent had to be, because the writer never writes a
        child ahead of its parent; the copy further ahead is skipped."""
        disk = self.disk
        if disk is None:
            return
        seen: set[Block] = set()
        queued: set[Block] | None = None
        # Appended by this call: a child of one of them goes again too, even
        # when an earlier block of the call walked that parent's chain.
        appended: set[Block] = set()
        for block in blocks:
            chain = []
            node: Block | None = block
            while node is not None and self.blocks.disk_slot(node) == NO_SLOT and node not in seen:
                seen.add(node)
                chain.append(node)
                node = node.parent
            if not chain:
                continue
            if queued is None:
                queued = set(self.blocks.write_queue)
            again = False
            for member in reversed(chain):
                if (member.state != BlockState.SEALED or self.blocks.host_slot(member) == NO_SLOT
                        or not member.index.disk_enabled):
                    continue
                again = again or member not in queued or member.parent in appended
                if again:
                    self.blocks.write_queue.append(member)
                    queued.add(member)
                    appended.add(member)

    def allocate_disk_slot(self) -> int:
        """A free disk slot, or the slot of the disk policy's victim; NO_SLOT if none may go."""
        slot = self.disk.pool.take_free()
        if slot != NO_SLOT:
            return slot
        victim = self.disk_victim(_disk_evictable)
        return NO_SLOT if victim is None else self.evict_disk_block(victim)

    def disk_victim(self, evictable: Callable[[Block], bool]) -> Block | None:
        pool = self.disk.pool
        return self.disk.eviction.victim(pool.owners, pool.incoming, evictable)

    def take_own_disk_slot(self, quota: TenantQuota) -> int:
        """The disk slot of one of the tenant's own blocks (the disk policy's
        pick among them), evicted for a newer one; NO_SLOT if none may go."""
        victim = self.disk_victim(lambda block: block.index.quota is quota and _disk_evictable(block))
        if victim is None:
            return NO_SLOT
        quota.counters.disk_evicted += 1
        return self.evict_disk_block(victim)

    def evict_disk_block(self, victim: Block) -> int:
        """Evict `victim`'s disk copy (the block too, if no host copy) and hand out its slot."""
        disk = self.disk
        disk.counters.evictions += 1
        slot = self.blocks.disk_slot(victim)
        if self.blocks.host_slot(victim) != NO_SLOT:
            self.blocks.free_disk_slot(victim)
        else:
            disk.counters.dropped += 1
            self.blocks.remove(victim, cold_parent=False)
        # Reused at once: the caller journals take_disk_removals() before it
        # writes the new bytes (see pick_writes).
        disk.pool.reuse(slot)
        return slot

