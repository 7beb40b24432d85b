"""Host memory: which slot a new block gets, and which blocks leave to free one.

A Put's reservation, a Get's read from disk and a prefetch each need a
host slot. A free one is handed out first; only when none is left does the
host eviction policy's victim give up its slot (kvd.core.policy), so cached
blocks stay discoverable as long as possible. On top of that:

* tenant affinity: with per-tenant host memory, a slot that changes tenant
  costs a remap, so a tenant's block prefers a victim of its own that is
  nearly next in line (TENANT_AFFINITY_WINDOW);
* tenant quotas: before a tenant's Put, its own least recently used blocks
  make room for it within its host quota, or the Put is refused having
  changed nothing;
* watermarks: above the high watermark the daemon demotes durable blocks
  down to the low one, ahead of need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvd.core.block import NO_SLOT, Block, BlockState
from kvd.core.blocks import BlockLifecycle
from kvd.core.quota import QuotaExceeded, TenantQuota
from kvd.core.slot_pool import SlotClass
from kvd.invariants import check

# How far past the eviction policy's victim, in blocks that would be
# evicted first (at most 1/32 of the host tier), a block of the
# requesting tenant may be taken instead (HostAllocator.free_slot).
TENANT_AFFINITY_WINDOW = 64


class HostAllocator:
    def __init__(self, blocks: BlockLifecycle) -> None:
        self.blocks = blocks
        self.host = blocks.host
        # Per-tenant host memory (kvd.tiers.host.HostArena.claim): called
        # with (slot, tenant name) when a slot is given to a block of
        # another tenant than the one whose memory backs it; None without
        # tenants. See `free_slot` for why that should be rare.
        self.claim_host_slot: Callable[[int, str], None] | None = None
        self.slot_tenants: list[str | None] = [None] * self.host.slot_count
        # Slots the kernel would not switch to another tenant's memory.
        self.claim_failures = 0

    def reclaim_due(self) -> bool:
        """Whether host memory should be reclaimed now (hysteresis between the watermarks).

        True from when the resident blocks reach the high watermark until
        they are back down to the low one. While it is True the daemon
        writes dirty blocks back (pick_writes) and demotes durable ones
        (demote_to_low_watermark), so a Put finds free slots instead of
        evicting, and no block is dropped that the disk could have kept.
        """
        return self.host.reclaim_due()

    def demote_to_low_watermark(self, limit: int | None = None) -> int:
        """Drop host copies of durable blocks, in eviction order, down to the low watermark.

        Stops at the first candidate without a copy below: that one must be
        written back first (or, without a disk tier, be evicted on demand
        when a slot is needed: dropping blocks early would only lose hits).
        Returns the number demoted (at most `limit`).
        """
        host = self.host
        demoted = 0
        while host.above_low() and (limit is None or demoted < limit):
            victim = host.policy.victim()
            if victim is None or self.blocks.lower_copy(victim) is None:
                break
            self.blocks.evict_from_host(victim)  # durable: only its host copy goes
            host.counters.background_demotions += 1
            demoted += 1
        self.reclaim_due()
        return demoted

    def demote(self, candidates: Iterable[Block], *, chains: bool = True) -> tuple[int, int]:
        """Drop the host copy of each of `candidates` that is still an eviction
        candidate and that a lower tier also holds (the Demote RPC); returns
        (blocks, payload bytes).

        Only candidates qualify, as for an eviction: sealed, unpinned (no
        lease, Get, read or write-back holds them) and without a child in
        host memory. Demoting a leaf can make its parent a candidate, so each
        chain is followed towards its root while that holds. A block whose
        only copy is here stays, as does every ancestor above it. Each block
        is checked as it comes, so `candidates` may be a snapshot taken
        before other calls changed the engine (Engine.host_candidates).
        Without `chains`, only the candidates themselves (leaf first, so
        that each is a leaf when its turn comes).
        """
        host, blocks = self.host, self.blocks
        demoted = payload = 0
        for candidate in candidates:
            block: Block | None = candidate
            while block is not None and block in host.policy and blocks.lower_copy(block) is not None:
                blocks.evict_from_host(block)
                host.counters.requested_demotions += 1
                demoted += 1
                payload += blocks.block_bytes(block)
                block = block.parent if chains else None
        self.reclaim_due()
        return demoted, payload

    def allocate(self, tenant: str | None = None, *, prefer_own: bool = True,
                 slot_class: SlotClass | None = None) -> int:
        """A host slot of `slot_class` (default: the largest) for a block of
        `tenant` (see free_slot), backed by the tenant's memory; NO_SLOT if
        none can be had. A slot whose memory cannot be switched to the
        tenant (the kernel refused the mapping) goes back to the free slots,
        and the caller sees NO_SLOT, as when the tier is full."""
        classes = slot_class is not None and len(self.host.pool.classes) > 1
        if classes:
            # Slots of a class share pages, so which tenant backs a slot's bytes
            # is the arena's to know (claim is a no-op when it is this one).
            slot = self.class_slot(slot_class)
        else:
            slot = self.free_slot(tenant if prefer_own else None)
        claim = self.claim_host_slot
        if slot == NO_SLOT or claim is None or tenant is None or (not classes and self.slot_tenants[slot] == tenant):
            return slot
        try:
            claim(slot, tenant)
        except OSError:
            self.host.pool.give_back(slot)
            self.claim_failures += 1
            return NO_SLOT
        if not classes:
            self.slot_tenants[slot] = tenant
        return slot

    def free_slot(self, tenant: str | None = None) -> int:
        """A free host slot, evicting the policy's victim if none is free; NO_SLOT if nothing can go.

        With per-tenant host memory, a slot that changes tenant costs a
        remap and the zeroing of its pages (milliseconds for 2 MiB; see
        bench/bench_tenant_arena.py), so for a block of `tenant` the
        victim may be one of the tenant's own among the candidates that
        would go in the next TENANT_AFFINITY_WINDOW blocks (a chain's leaf
        counts the ancestors that follow it out) instead: a tenant whose
        blocks are all younger than that takes another's slot, and so grows.
        """
        host = self.host
        slot = host.pool.take_free()
        if slot != NO_SLOT:
            return slot
        window = min(TENANT_AFFINITY_WINDOW, host.slot_count // 32)
        if tenant is not None and self.claim_host_slot is not None and window > 0:
            slot_tenants = self.slot_tenants
            victim = host.policy.victim_near(lambda block: slot_tenants[self.blocks.host_slot(block)] == tenant, window,
                                             lambda block: self.eviction_run(block, window))
        else:
            victim = host.policy.victim()
        if victim is None:
            return NO_SLOT
        self.evict(victim)
        slot = host.pool.take_free()
        check(slot != NO_SLOT, "eviction freed no host slot")
        return slot

    def class_slot(self, slot_class: SlotClass) -> int:
        """A free slot of `slot_class`, with slot classes: its own free slot or
        a free page; else, walking the tier's one eviction order from the
        oldest candidate (the first TENANT_AFFINITY_WINDOW of them, then,
        only if none there will do, all of them), the first that is of
        `slot_class` is evicted, or the first whose page can be emptied
        gives up that page (all its blocks evicted). So the class whose
        blocks went unused longest gives up memory. NO_SLOT only if no
        candidate is of the class and no page can be emptied."""
        pool, policy = self.host.pool, self.host.policy
        slot = pool.take_free(slot_class)
        if slot != NO_SLOT:
            return slot
        if pool.take_page(slot_class):
            return pool.take_free(slot_class)
        window = max(1, min(TENANT_AFFINITY_WINDOW, len(policy)))

        def usable(block: Block) -> bool:
            return block.index.host_class == slot_class.index or self.page_reclaimable(self.page_of(block))

        victim = policy.victim_near(usable, window, lambda _: 1)
        if victim is not None and not usable(victim):
            # Nothing near the front of the order: look through all of it (O(candidates), rare) rather
            # than report the tier full while something could still go.
            victim = next((block for block in policy.order() if usable(block)), None)
        if victim is None:
            return NO_SLOT
        if victim.index.host_class == slot_class.index:
            self.evict(victim)
            return pool.take_free(slot_class)
        page = self.page_of(victim)
        self.empty_page(page)
        pool.release_page(page)
        pool.assign_page(page, slot_class)
        return pool.take_free(slot_class)

    def evict(self, victim: Block) -> None:
        """Evict a candidate on demand (counted as an eviction)."""
        self.blocks.evict_from_host(victim)
        self.host.counters.evictions += 1

    def page_of(self, block: Block) -> int:
        return self.host.pool.page_of(self.blocks.host_slot(block))

    def page_residents(self, page: int) -> list[Block]:
        pool = self.host.pool
        held = pool.classes[pool.page_class[page]]
        return [owner for owner in (pool.owners[slot] for slot in pool.page_slots(page, held)) if owner is not None]

    def page_reclaimable(self, page: int) -> bool:
        """Whether evicting leaves first can empty the page: every block on it
        sealed, unpinned, not being read in, and its children in host memory
        all on this page too."""
        residents = self.page_residents(page)
        on_page = set(residents)
        children_here: dict[Block, int] = {}
        for block in residents:
            if block.parent in on_page:
                children_here[block.parent] = children_here.get(block.parent, 0) + 1
        return all(block.state == BlockState.SEALED and block.ref_count == 0 and block not in self.blocks.loading
                   and self.blocks.tiers.resident_children(block, self.host) == children_here.get(block, 0)
                   for block in residents)

    def empty_page(self, page: int) -> None:
        """Evict every block of a reclaimable page, leaves first (each is then a candidate)."""
        while left := self.page_residents(page):
            ready = [block for block in left if block in self.host.policy]
            check(bool(ready), "page {} cannot be emptied: none of its blocks is a candidate", page)
            for block in ready:
                self.evict(block)

    def make_quota_room(self, quota: TenantQuota, slots: int, keep: Block | None, slot_bytes: int = 0) -> None:
        """Before `slots` host slots are reserved for the tenant: evict its own
        least recently used candidates until they fit its host quota, or raise
        QuotaExceeded, having changed nothing, if they cannot be made to fit.

        `keep` (the block the reservation extends) is never a victim, nor is
        a candidate that has children but no copy below: evicting it would
        lose its subtree. Other candidates either are leaves (removed) or
        have a copy below (demoted, still stored).
        """
        # With slot classes, counted in the reserving namespace's slot size
        # (a tenant whose namespaces take several sizes is approximated).
        slot_bytes = slot_bytes or self.host.slot_bytes
        excess_bytes = quota.host_excess_bytes(slots, slot_bytes)
        if excess_bytes <= 0:
            return
        if slots * slot_bytes > quota.host_limit_bytes:
            quota.counters.host_refused += 1
            raise QuotaExceeded(
                f"tenant {quota.name!r} is over its host quota: this Put needs {slots * slot_bytes} bytes "
                f"({slots} slots of {slot_bytes} bytes), more than its whole quota of {quota.host_limit_bytes} "
                "bytes; Put fewer blocks at a time, or raise the tenant's host_bytes quota"
            )
        needed = -(-excess_bytes // slot_bytes)
        evictable = self.quota_evictable(quota, keep, needed)
        if evictable < needed:
            quota.counters.host_refused += 1
            raise QuotaExceeded(
                f"tenant {quota.name!r} is over its host quota: its blocks take {quota.host_used_bytes} of its "
                f"{quota.host_limit_bytes} bytes of host memory, this Put needs {slots * slot_bytes} more "
                f"({slots} slots of {slot_bytes} bytes) and only {evictable * slot_bytes} bytes of its "
                "blocks can be evicted (the rest are pinned); release leases, Put fewer blocks at a time, "
                "Delete blocks, or raise the tenant's host_bytes quota"
            )
        # One at a time, least recently used first: evicting a chain's leaf
        # makes its parent a candidate, at the front.
        for _ in range(needed):
            victim = next((block for block in quota.candidates if self.quota_victim(block, keep)), None)
            check(victim is not None, "the tenant's evictable blocks were miscounted")
            self.blocks.evict_from_host(victim)
            quota.counters.host_evicted += 1

    def quota_evictable(self, quota: TenantQuota, keep: Block | None, needed: int) -> int:
        """How many of the tenant's host blocks (up to `needed`) evicting its
        candidates would free: each candidate, and the ancestors that
        become candidates once it is gone (counted only where that is
        certain, so the count never exceeds what eviction frees)."""
        count = 0
        counted: set[Block] = set()
        for block in quota.candidates:
            if not self.quota_victim(block, keep):
                continue
            count += 1
            child, parent = block, block.parent
            while count < needed and parent is not None and parent not in counted:
                # Whether the parent keeps a child once `child` is gone: a durable
                # child stays in the index, a non-durable one leaves it.
                children_left = (self.blocks.lower_copy(child) is not None or parent.first_child is not child
                                 or child.next_sibling is not None)
                if not (self.blocks.host_slot(parent) != NO_SLOT and self.blocks.tiers.resident_children(parent, self.host) == 1 and parent.ref_count == 0
                        and parent.state == BlockState.SEALED and parent.index.quota is quota
                        and self.quota_victim(parent, keep, children_left)):
                    break
                counted.add(parent)
                count += 1
                child, parent = parent, parent.parent
            if count >= needed:
                break
        return count

    def eviction_run(self, block: Block, limit: int) -> int:
        """Host blocks that leave, at most `limit`, when candidate `block` is
        evicted: it and the ancestors that become candidates after it, up the
        chain while each has no other child in host memory."""
        run = 1
        parent = block.parent
        while (run < limit and parent is not None and self.blocks.host_slot(parent) != NO_SLOT
               and self.blocks.tiers.resident_children(parent, self.host) == 1):
            run += 1
            parent = parent.parent
        return run

    def quota_victim(self, block: Block, keep: Block | None, has_children: bool | None = None) -> bool:
        """Whether a tenant's candidate may go to keep it within its host quota:
        not the block a reservation extends, and not one with children but no
        copy below (evicting it would lose its subtree). `has_children`: what
        to assume instead of the block's own child list."""
        if has_children is None:
            has_children = block.first_child is not None
        return block is not keep and not (has_children and self.blocks.lower_copy(block) is None)


    def verify(self) -> None:
        if self.claim_host_slot is None:
            return
        for slot, owner in enumerate(self.host.pool.owners):
            check(owner is None or self.slot_tenants[slot] == owner.index.tenant,
                  "a block sits in another tenant's host memory")
