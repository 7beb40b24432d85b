"""The engine's cross-structure invariants, checked over every block (tests call them after each step).

Each structure checks itself (`verify()` on pools, policies, leases,
events, namespaces); what is checked here holds *between* them: every
block against the tiers that hold it, the host policy's candidates, the
pin and handle counts, and each tenant's usage.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvd.core.block import NO_SLOT, Block, BlockState
from kvd.core.blocks import BlockLifecycle
from kvd.core.namespaces import NamespaceState
from kvd.core.quota import TenantQuota
from kvd.core.tier import Tier
from kvd.invariants import check


class _Tally:
    """What a walk over every block counted, to compare with the pools and counters."""

    def __init__(self, blocks: BlockLifecycle) -> None:
        self.resident_children: dict = {tier: {} for tier in blocks.tiers}
        # Per tier: resident blocks and their bytes.
        self.resident: dict[Tier, list[int]] = {tier: [0, 0] for tier in blocks.tiers}
        self.pinned = self.refs = 0


def verify_blocks(blocks: BlockLifecycle, states: Iterable[NamespaceState], prefetch_in_flight: int) -> None:
    tally = _Tally(blocks)
    for state in states:
        state.index.verify()
        for block in state.index:
            _verify_block(blocks, block, state.block_bytes, tally)
    blocks.tiers.verify_children(tally.resident_children)
    for tier, (resident, used) in tally.resident.items():
        check(resident == tier.pool.resident_blocks, "{} resident blocks disagree with its slots", tier.name)
        check(used == tier.pool.used_bytes, "{} used bytes drifted", tier.name)
    check(tally.pinned == blocks.pinned_blocks, "pinned count {} but {} pinned", blocks.pinned_blocks, tally.pinned)
    check(tally.refs == blocks.live_handles, "{} live handles but {} references", blocks.live_handles, tally.refs)
    check(0 <= prefetch_in_flight <= len(blocks.loading), "{} prefetch loads in flight", prefetch_in_flight)
    for queue in blocks.write_queues.values():
        queue.verify()
    blocks.ledger.verify()
    for block in blocks.ledger.blocks:
        # A lost block being read still has its slot, until the read ends.
        check(blocks.host_slot(block) != NO_SLOT and (block.state == BlockState.SEALED or block in blocks.loading),
              "prefetched {!r} not in host memory", block)


def _verify_block(blocks: BlockLifecycle, block: Block, block_bytes: int, tally: _Tally) -> None:
    blocks.tiers.verify_block(block, tally.resident_children)
    copies = blocks.tiers.copies(block)
    host_slot = blocks.host_slot(block)
    if block.state == BlockState.LOST:
        # Only a pinned tombstone (a load or a writer still using its host slot) keeps that slot.
        check((host_slot == NO_SLOT or block.ref_count > 0) and len(copies) == (host_slot != NO_SLOT),
              "tombstone {!r} has slots", block)
        check(block.ref_count > 0 or block.first_child is not None, "tombstone {!r} should be gone", block)
    else:
        check(bool(copies), "{!r} resides nowhere", block)
    for tier, _ in copies:
        counts = tally.resident[tier]
        counts[0] += 1
        counts[1] += block_bytes
        if tier is not blocks.host:
            # In every tier below host memory a block's whole prefix is there too (FORMAT.md for the disk).
            check(block.parent is None or blocks.tiers.slot_in(block.parent, tier) != NO_SLOT,
                  "{!r} in {}, its parent not", block, tier.name)
    if block in blocks.loading:
        check(block.ref_count > 0 and host_slot != NO_SLOT, "loading {!r} unpinned", block)
    tally.refs += block.ref_count
    tally.pinned += block.ref_count > 0
    host = blocks.host
    candidate = (block.state == BlockState.SEALED and block.ref_count == 0 and host_slot != NO_SLOT
                 and blocks.tiers.resident_children(block, host) == 0)
    check((block in host.policy) == candidate, "{!r} candidate={} but policy membership disagrees", block, candidate)
    if candidate and len(copies) == 1:
        # What host eviction drops must be droppable.
        check(block.first_child is None or bool(blocks.lower), "dirty candidate {!r} has children", block)


def verify_quotas(blocks: BlockLifecycle, tenants: dict[str, TenantQuota]) -> None:
    """Each tenant's usage is the slots its blocks hold; its candidates are the host policy's."""
    if not tenants:
        return
    quotas = list(tenants.values())
    used = {tier: dict.fromkeys(quotas, 0) for tier in blocks.tiers}
    for tier in blocks.tiers:
        for slot, owner in enumerate(tier.pool.owners):
            if owner is not None and owner.index.quota is not None:
                used[tier][owner.index.quota] += tier.pool.slot_bytes_of(slot)
    candidates: dict[TenantQuota, list[Block]] = {quota: [] for quota in quotas}
    for block in blocks.host.policy.order():
        if block.index.quota is not None:
            candidates[block.index.quota].append(block)
    for quota in quotas:
        check(quota.host_used_bytes == used[blocks.host][quota], "tenant {!r} host usage drifted", quota.name)
        disk_used = used[blocks.disk][quota] if blocks.disk is not None else 0
        check(quota.disk_used_bytes == disk_used, "tenant {!r} disk usage drifted", quota.name)
        if quota.tracks_candidates:
            check(set(quota.candidates) == set(candidates[quota]),
                  "tenant {!r} candidates differ from the host policy's", quota.name)
        else:
            check(not quota.candidates, "tenant {!r} tracks candidates without a host limit", quota.name)
