"""The engine's cross-structure invariants, checked over every block (tests call them after each step).

Each structure checks itself (`verify()` on pools, policies, leases,
events, namespaces); what is checked here holds *between* them: every
block against the tiers that hold it, the host policy's candidates, the
pin and handle counts, and each tenant's usage.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvd.core.block import NO_SLOT, Block, BlockState
from kvd.core.blocks import BlockBook
from kvd.core.namespaces import NamespaceState
from kvd.core.quota import TenantQuota
from kvd.invariants import check


class _Tally:
    """What a walk over every block counted, to compare with the pools and counters."""

    def __init__(self, blocks: BlockBook) -> None:
        self.resident_children: dict = {tier: {} for tier in blocks.tiers}
        self.host_blocks = self.disk_blocks = self.host_bytes = self.disk_bytes = 0
        self.pinned = self.refs = 0


def verify_blocks(blocks: BlockBook, states: Iterable[NamespaceState], prefetch_in_flight: int) -> None:
    tally = _Tally(blocks)
    for state in states:
        state.index.verify()
        for block in state.index:
            _verify_block(blocks, block, state.block_bytes, tally)
    blocks.tiers.verify_children(tally.resident_children)
    host, disk = blocks.host, blocks.disk
    check(tally.host_blocks == host.pool.resident_blocks, "resident blocks disagree with free slots")
    check(tally.host_bytes == host.pool.used_bytes, "host used bytes drifted")
    if disk is not None:
        check(tally.disk_bytes == disk.pool.used_bytes, "disk used bytes drifted")
        check(tally.disk_blocks == disk.pool.resident_blocks, "disk resident blocks disagree with its slots")
    check(tally.pinned == blocks.pinned_blocks, "pinned count {} but {} pinned", blocks.pinned_blocks, tally.pinned)
    check(tally.refs == blocks.live_handles, "{} live handles but {} references", blocks.live_handles, tally.refs)
    check(0 <= prefetch_in_flight <= len(blocks.loading), "{} prefetch loads in flight", prefetch_in_flight)
    blocks.ledger.verify()
    for block in blocks.ledger.blocks:
        # A lost block being read still has its slot, until the read ends.
        check(blocks.host_slot(block) != NO_SLOT and (block.state == BlockState.SEALED or block in blocks.loading),
              "prefetched {!r} not in host memory", block)


def _verify_block(blocks: BlockBook, block: Block, block_bytes: int, tally: _Tally) -> None:
    blocks.tiers.verify_block(block, tally.resident_children)
    host_slot, disk_slot = blocks.host_slot(block), blocks.disk_slot(block)
    if block.state == BlockState.LOST:
        # Only a pinned tombstone (a load or a writer still using its host slot) keeps that slot.
        check((host_slot == NO_SLOT or block.ref_count > 0) and disk_slot == NO_SLOT, "tombstone {!r} has slots",
              block)
        check(block.ref_count > 0 or block.children > 0, "tombstone {!r} should be gone", block)
    else:
        check(host_slot != NO_SLOT or disk_slot != NO_SLOT, "{!r} resides nowhere", block)
    if host_slot != NO_SLOT:
        tally.host_blocks += 1
        tally.host_bytes += block_bytes
    if disk_slot != NO_SLOT:
        # A durable block's whole prefix is durable (FORMAT.md).
        check(block.parent is None or blocks.disk_slot(block.parent) != NO_SLOT, "{!r} durable, parent not", block)
        tally.disk_blocks += 1
        tally.disk_bytes += block_bytes
    if block in blocks.loading:
        check(block.ref_count > 0 and host_slot != NO_SLOT, "loading {!r} unpinned", block)
    tally.refs += block.ref_count
    tally.pinned += block.ref_count > 0
    host = blocks.host
    candidate = (block.state == BlockState.SEALED and block.ref_count == 0 and host_slot != NO_SLOT
                 and blocks.tiers.resident_children(block, host) == 0)
    check((block in host.policy) == candidate, "{!r} candidate={} but policy membership disagrees", block, candidate)
    if candidate and disk_slot == NO_SLOT:
        # What host eviction drops must be droppable.
        check(block.children == 0 or blocks.disk is not None, "dirty candidate {!r} has children", block)


def verify_quotas(blocks: BlockBook, tenants: dict[str, TenantQuota]) -> None:
    """Each tenant's usage is the slots its blocks hold; its candidates are the host policy's."""
    if not tenants:
        return
    quotas = list(tenants.values())
    used = {tier: dict.fromkeys(quotas, 0) for tier in blocks.tiers}
    for tier in blocks.tiers:
        for owner in tier.pool.owners:
            if owner is not None and owner.index.quota is not None:
                used[tier][owner.index.quota] += tier.slot_bytes
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
