"""Prefetch: disk reads into host memory ahead of a Get, with no lease.

A client that will Get a prefix soon asks for it to be read in now. Each
block only on disk gets a host slot and a load pinned by its own handle
until the read is over; a Get of it meanwhile finds it loading and waits
for that read. A prefetch is a guess: at most `max_in_flight` of its
loads are outstanding at a time, it never takes a tenant past its host
quota, and to make room it may demote a block that has a disk copy but
never drop one held nowhere else. From the first block it cannot take on,
the rest are refused, and `limit` says why.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvd.core.block import NO_SLOT, Block
from kvd.core.component import EngineComponent
from kvd.core.reads import Reads
from kvd.core.requests import check_keys, match
from kvd.core.transfer import Transfer
from kvd.invariants import check


class PrefetchLimit(enum.IntEnum):
    """Why a prefetch left blocks only on disk; values match kvd.v1.PrefetchLimit."""

    NONE = 0
    IN_FLIGHT = 1  # the bound on prefetch reads in flight was reached
    HOST_FULL = 2  # no host slot could be freed but by dropping a block held nowhere else
    PROMOTION = 3  # the promotion policy declined the block


@dataclass(slots=True)
class PrefetchPlan:
    """A Prefetch: what it found of the stored prefix and the disk reads it queued.

    Every matched block is counted once: in_host, loading (another read of
    it is in flight), queued (one of `loads`) or refused (`limit` says why).
    """

    loads: list[Transfer] = field(default_factory=list)
    matched: int = 0
    missing: int = 0
    in_host: int = 0
    loading: int = 0
    refused: int = 0
    limit: PrefetchLimit = PrefetchLimit.NONE


class Prefetcher(EngineComponent):
    def __init__(self, reads: Reads) -> None:
        super().__init__(reads.limits, reads.namespaces, reads.blocks, reads.allocator, reads.leases)
        self.reads = reads
        self.ledger = self.blocks.ledger
        # Prefetch loads queued or running.
        self.in_flight = 0

    def begin(
        self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes = b"", max_in_flight: int = 0
    ) -> PrefetchPlan:
        """Plan reads into host memory of the blocks of `keys`' stored prefix only on disk.

        Like begin_get, but for a client that will Get the prefix later: no
        lease, no hit counted. Each block read gets a host slot now and is
        pinned by its load's own handle until finish_prefetch. A Get of it
        meanwhile finds it in `loading` and waits for that read. At most
        `max_in_flight` prefetch loads are outstanding at a time; from the
        first disk-only block past that bound, or that no host slot can be
        found for, or that the promotion policy declines, the rest are
        refused (`limit` says why). Without a disk tier every stored block
        is in host memory and nothing is read.
        """
        state = self.namespaces.namespace(namespace_id)
        check_keys(self.limits, keys, "keys")
        check(max_in_flight >= 0, "max_in_flight must not be negative")
        matched = match(state, keys, parent_key)
        plan = PrefetchPlan(matched=len(matched), missing=len(keys) - len(matched))
        # Pinned while slots are found, so that making room never evicts a
        # block of this very prefix; unpinned, they rejoin the eviction
        # order as just used (as after a Get).
        pins = [self.blocks.acquire(block) for block in matched]
        for block in matched:
            if block in self.blocks.loading:
                plan.loading += 1
            elif self.blocks.host_slot(block) != NO_SLOT:
                plan.in_host += 1
            elif plan.limit != PrefetchLimit.NONE or not self.queue_one(block, plan, max_in_flight):
                plan.refused += 1
        for pin in reversed(pins):
            pin.release()
        counters = self.ledger.counters
        counters.queued += len(plan.loads)
        counters.in_host += plan.in_host
        counters.loading += plan.loading
        counters.refused += plan.refused
        counters.missing += plan.missing
        return plan

    def queue_one(self, block: Block, plan: PrefetchPlan, max_in_flight: int) -> bool:
        """Give a disk-only block a host slot and a load in `plan`; False (and plan.limit) if it cannot."""
        if self.in_flight >= max_in_flight:
            plan.limit = PrefetchLimit.IN_FLIGHT
            return False
        source, source_slot = self.blocks.lower_copy(block)
        if not source.promotion.promote(block):
            plan.limit = PrefetchLimit.PROMOTION
            return False
        quota = block.index.quota
        slot_class = self.blocks.host_class(block)
        if quota is not None and quota.host_excess_bytes(1, slot_class.slot_bytes) > 0:
            # A guess never takes its tenant past its host quota.
            plan.limit = PrefetchLimit.HOST_FULL
            return False
        # A prefetch is a guess: to make room it may demote a block that has
        # a copy below, but never drop one that exists in host memory only.
        pool = self.host.pool
        room = pool.free_count_of(slot_class) or pool.free_pages
        victim = None if room else self.host.policy.victim()
        slot = (NO_SLOT if victim is not None and self.blocks.lower_copy(victim) is None
                else self.allocator.allocate(block.index.tenant, prefer_own=False, slot_class=slot_class))
        if slot == NO_SLOT:
            plan.limit = PrefetchLimit.HOST_FULL
            return False
        plan.loads.append(self.reads.start_load(block, source, source_slot, slot))
        self.ledger.queued(block)
        self.in_flight += 1
        return True

    def finish(self, loads: Sequence[Transfer], ok: Sequence[bool]) -> None:
        """Prefetch reads done (as finish_loads), then unpinned: good blocks stay
        in host memory as ordinary eviction candidates, bad ones are lost."""
        check(all(load.handle is not None for load in loads), "a prefetch load without its pin")
        self.reads.finish_loads(loads, ok)  # which releases the pins
        self.in_flight -= len(loads)

    def abandon(self, loads: Sequence[Transfer]) -> None:
        """Drop prefetch loads whose reads never started: slots back (counted
        as wasted), pins released; the blocks stay on disk."""
        for load in loads:
            block = load.block
            check(block in self.blocks.loading and load.handle is not None, "{!r} is no prefetch load", block)
            self.blocks.loading.discard(block)
            self.blocks.clear_host_slot(block, cold_parent=False)
            self.in_flight -= 1
            load.handle.release()
