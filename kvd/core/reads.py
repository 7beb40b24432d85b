"""Reads: Lookup, and Get with the reads from lower tiers it needs first.

A Get pins the longest stored prefix of its keys under one read lease.
Blocks not in host memory get a host slot at once (evicting if needed) and
are listed as loads, each from the block's fastest copy below (a middle
tier, else the disk): the caller reads them into those slots and reports
with `finish_loads`; a block another Get is loading already is waited for.
When the host tier cannot take a block, or the promotion policy declines
it, the prefix is cut before it. `settle_get` then gives the servable
prefix. Hits and misses are counted per namespace and per tier.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvd.core.block import NO_SLOT, Block, BlockHandle, BlockState
from kvd.core.lease import Lease, LeaseKind
from kvd.core.namespaces import NamespaceState
from kvd.core.component import EngineComponent
from kvd.core.requests import KeysRequest, check_client, check_keys, check_lease_room, granted_lease_ms, match
from kvd.core.tier import StorageTier, Tier, TierId
from kvd.core.transfer import Transfer
from kvd.invariants import check


class GetCut(enum.IntEnum):
    """Why a Get served less than the stored prefix it found (values as kvd.v1.GetCut)."""

    NONE = 0  # it served all of it (or all that is still stored: a block may be deleted meanwhile)
    CORRUPT = 1  # the next block failed its checksum when read: it and its descendants are lost
    UNREADABLE = 2  # the drive could not read the next block (an I/O error): lost likewise
    NO_ROOM = 3  # host memory had no slot for the next block (every one pinned), write-back or not
    KEPT_BELOW = 4  # the promotion policy keeps the next block in a lower tier
    LEASE_ENDED = 5  # the Get's lease ended (released, expired) while it read: it serves nothing


class LoadOutcome(enum.IntEnum):
    """How a read from a lower tier into host memory went."""

    OK = 0
    CORRUPT = 1  # read in full, failed its checksum
    UNREADABLE = 2  # the drive returned an error or too few bytes


@dataclass(slots=True)
class GetPlan:
    """A Get in progress: the pinned prefix and the reads from lower tiers it needs first."""

    lease: Lease | None
    matched: list[Block]
    # Reads into host slots given now, each from the block's fastest copy below.
    loads: list[Transfer] = field(default_factory=list)
    # Blocks another Get is loading already; wait for it, then settle.
    waits: list[Block] = field(default_factory=list)
    # Cut short because no host slot could be freed (all pinned).
    starved: bool = False
    # Why begin_get cut the prefix it found (NO_ROOM: starved too; KEPT_BELOW).
    cut: GetCut = GetCut.NONE
    # What begin_get counted (Reads.count_get), taken back by abandon_get
    # so that a Get retried after a starved plan counts its keys once.
    counted: tuple[NamespaceState, int, int, int, dict[Tier, int]] | None = None
    # The request's own pins on every matched block while it reads or waits, whatever
    # becomes of its lease (released, expired): released by settle_get or abandon_get.
    pins: list[BlockHandle] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class InPlace:
    """A prefix pinned where it is (Reads.pin_in_place): per block, its host offset or its disk
    slot (NO_SLOT in the other)."""

    lease: Lease | None
    matched: list[Block]
    host_offsets: list[int]
    disk_slots: list[int]


class Reads(EngineComponent):
    def lookup(self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes = b"") -> list[Block]:
        """Longest stored prefix of `keys` (a chain continuing `parent_key`).

        Marks the prefix as used. An unknown parent matches nothing.
        """
        state = self.namespaces.namespace(namespace_id)
        check_keys(self.limits, keys, "keys")
        matched = match(state, keys, parent_key)
        self.blocks.touch_prefix(matched)
        state.lookup_hits += len(matched)
        state.lookup_misses += len(keys) - len(matched)
        return matched

    def stored(self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes = b"") -> list[Block]:
        """Longest stored prefix of `keys`, with no side effect: not counted
        as a lookup or a Get, no block marked used (a durability wait asks)."""
        state = self.namespaces.namespace(namespace_id)
        check_keys(self.limits, keys, "keys")
        return [block for block in match(state, keys, parent_key) if block.state == BlockState.SEALED]

    def chain_to(self, namespace_id: bytes, key: bytes) -> list[bytes]:
        """The keys of the stored chain from its root to `key`, `key` last; [] when `key` is not
        stored here. What a peer's directory needs to find the rest of a chain that a request
        continues from a local parent (keys are chained: a block's key names its whole prefix)."""
        state = self.namespaces.namespace(namespace_id)
        check_keys(self.limits, [key], "parent_key")
        block = state.index.get(key)
        if block is None or block.state != BlockState.SEALED:
            return []
        chain = []
        while block is not None:
            chain.append(block.key)
            block = block.parent
        chain.reverse()
        return chain

    def begin_get(self, request: KeysRequest) -> GetPlan:
        """Pin the longest stored prefix of `keys` and plan its disk reads.

        Every matched block is pinned under one read lease. Blocks only on
        disk get a host slot now (evicting if needed) and are listed in
        `loads`: the caller reads them into those slots and reports with
        finish_loads. Blocks another Get is already loading are in `waits`.
        If the host tier cannot take a block, the prefix is cut before it.
        """
        lease, matched, counted = self._pin_matched(request)
        plan = GetPlan(lease, matched, counted=counted)
        for position, block in enumerate(matched):
            if block in self.blocks.loading:
                plan.waits.append(block)
                continue
            if self.blocks.host_slot(block) != NO_SLOT:
                continue
            source, source_slot = self.blocks.lower_copy(block)
            if not source.promotion.promote(block):
                self.cut_plan(plan, position)
                plan.cut = GetCut.KEPT_BELOW
                break
            slot = self.allocator.allocate(block.index.tenant, slot_class=self.blocks.host_class(block))
            if slot == NO_SLOT:
                self.cut_plan(plan, position)
                plan.starved = True
                plan.cut = GetCut.NO_ROOM
                break
            plan.loads.append(self.start_load(block, source, source_slot, slot))
        if plan.loads or plan.waits:
            # It settles after awaits: its lease may end before then, its blocks may not move.
            plan.pins = [self.blocks.acquire(block) for block in plan.matched]
        self.blocks.ledger.used(plan.matched)
        return plan

    def _pin_matched(self, request: KeysRequest) -> tuple[Lease | None, list[Block], tuple]:
        """The longest stored prefix of the request's keys, counted as a Get and pinned under a new
        read lease (None when nothing matched)."""
        namespace_id, client_id, keys, now_ms = request.namespace_id, request.client_id, request.keys, request.now_ms
        state = self.namespaces.namespace(namespace_id)
        check_keys(self.limits, keys, "keys")
        check_client(client_id)
        deadline_ms = now_ms + granted_lease_ms(self.limits, request.lease_ms)
        self.leases.expire(now_ms)
        matched = match(state, keys, request.parent_key)
        if matched:
            check_lease_room(self.leases)
            self.leases.check_pin_room(client_id, len(matched))
        counted = self.count_get(state, len(keys), matched)
        if not matched:
            return None, matched, counted
        self.blocks.touch_prefix(matched)
        self.blocks.note_sightings(matched)
        lease = self.leases.open(LeaseKind.READ, client_id, namespace_id, deadline_ms)
        lease.handles = [self.blocks.acquire(block) for block in matched]
        self.leases.charge(lease, len(lease.handles))
        return lease, matched, counted

    def pin_in_place(self, request: KeysRequest) -> InPlace:
        """Pin the longest stored prefix of `keys` under a read lease and take no host slot: a block
        in host memory is served from there, a block only on disk from its disk slot, which the
        lease keeps (the caller reads it straight to where it goes). The prefix stops before a
        block that is neither: being read in by another request, or only in another tier."""
        lease, matched, _ = self._pin_matched(request)
        slots, host_offsets, disk_slots = [], [], []
        for position, block in enumerate(matched):
            slot = self.blocks.host_slot(block)
            disk_slot = NO_SLOT if slot != NO_SLOT else self.blocks.disk_slot(block)
            lower = self.blocks.lower_copy(block) if slot == NO_SLOT else None
            if slot == NO_SLOT and (block in self.blocks.loading or disk_slot == NO_SLOT
                                    or lower is None or lower[0] is not self.blocks.disk):
                self.cut_plan(GetPlan(lease, matched), position)
                break
            slots.append(slot)
            disk_slots.append(disk_slot)
        host = [slot for slot in slots if slot != NO_SLOT]
        offsets = iter(self.host.pool.offsets_of(host))
        host_offsets = [next(offsets) if slot != NO_SLOT else NO_SLOT for slot in slots]
        self.blocks.ledger.used(matched)
        return InPlace(lease if matched else None, matched, host_offsets, disk_slots)

    def start_load(self, block: Block, source: StorageTier, source_slot: int, slot: int) -> Transfer:
        """`block` is read from `source` into host `slot`: the slot is its from
        now on, and the read holds its own pin (a Get's lease may end, expire
        or be released, while the bytes are still landing in this slot)."""
        check(self.blocks.tiers.slot_in(block, source) == source_slot, "{!r} is not in {} slot {}",
              block, source.name, source_slot)
        self.blocks.set_host_slot(block, slot)
        self.blocks.loading.add(block)
        source.eviction.touch(source_slot)
        return Transfer(block, source, source_slot, self.host, slot, self.blocks.acquire(block))

    def finish_loads(self, loads: Sequence[Transfer], ok: Sequence[bool]) -> None:
        """Blocks read from disk: good ones are now in the host tier, bad ones
        are lost; then each read's own pin is released."""
        check(len(loads) == len(ok), "one outcome per load")
        for load, good in zip(loads, ok):
            self._finish_load(load, good)
        for load in loads:
            if load.handle is not None:
                load.handle.release()

    def _finish_load(self, load: Transfer, good: bool) -> None:
        block = load.block
        source = load.source
        if block not in self.blocks.loading:
            # An ancestor loaded in this batch was corrupt: lost already.
            check(block.state in (BlockState.LOST, BlockState.REMOVED), "{!r} was not loading", block)
            return
        check(self.blocks.host_slot(block) == load.target_slot, "{!r} loads into another slot", block)
        check(block.ref_count > 0, "{!r} was read in unpinned", block)
        self.blocks.loading.discard(block)
        if block.state == BlockState.LOST:
            # Lost while this read was in flight (an ancestor's read
            # failed): its host slot is free only now that nothing
            # writes into it any more.
            self.blocks.clear_host_slot(block, cold_parent=False)
            return
        if good:
            source.counters.loaded += 1
            self.blocks.events.tier_changed(block.index.namespace_id, block.key, TierId.HOST)
        else:
            # Corrupt or unreadable: never served, and neither is anything
            # chained under it.
            source.counters.load_failures += 1
            self.blocks.lose(block)

    def give_up_loads(self, loads: Sequence[Transfer]) -> None:
        """Reads that did not happen (their job raised, a bug, or never ran): nothing is lost,
        each block keeps its copy below, its host slot goes back, its read's pin is released."""
        for load in loads:
            if load.block in self.blocks.loading:
                check(self.blocks.host_slot(load.block) == load.target_slot, "{!r} loads into another slot", load.block)
                self.blocks.loading.discard(load.block)
                self.blocks.clear_host_slot(load.block, cold_parent=False)
            if load.handle is not None:
                load.handle.release()

    def abandon_get(self, plan: GetPlan) -> None:
        """Drop a plan whose loads were never started: slots back, pins released."""
        self._release_pins(plan)
        self.give_up_loads(plan.loads)
        plan.loads = []
        if plan.lease is not None and not plan.lease.ended:
            self.leases.close(plan.lease)
        plan.lease = None
        plan.matched = []
        if plan.counted is not None:
            self.tally_get(*plan.counted, sign=-1)
            plan.counted = None

    def settle_get(self, plan: GetPlan) -> list[Block]:
        """The servable prefix of a plan whose loads have all finished; its own pins go.

        A plan whose lease ended meanwhile (released, expired) serves
        nothing: that is a normal end, not an error.
        """
        loading = self.blocks.loading
        check(not any(load.block in loading for load in plan.loads), "settle_get before the loads finished")
        if plan.lease is not None and plan.lease.ended:
            plan.matched = []  # (the caller tells the client why: see plan.lease.ended)
        for position, block in enumerate(plan.matched):
            # No host slot: a prefetch this Get waited for was dropped unread. Loading: and
            # another request has started reading it in again since (its bytes are not there yet).
            if block.state != BlockState.SEALED or self.blocks.host_slot(block) == NO_SLOT or block in loading:
                self.cut_plan(plan, position)
                break
        self._release_pins(plan)
        return plan.matched

    def drop_get(self, plan: GetPlan) -> None:
        """A Get that ends without settling (it failed, or was cancelled), once no read
        into its slots runs: its lease ends, its own pins go."""
        if plan.lease is not None and not plan.lease.ended:
            self.leases.close(plan.lease)
        self._release_pins(plan)

    @staticmethod
    def _release_pins(plan: GetPlan) -> None:
        for handle in reversed(plan.pins):
            handle.release()
        plan.pins = []

    def cut_plan(self, plan: GetPlan, position: int) -> None:
        """Serve only matched[:position]; unpin the rest (tail first)."""
        lease = plan.lease
        for handle in reversed(lease.handles[position:]):
            handle.release()
        self.leases.refund(lease, len(lease.handles) - position)
        del lease.handles[position:]
        del plan.matched[position:]
        if not lease.handles:
            self.leases.close(lease)
            plan.lease = None

    def count_get(self, state: NamespaceState, requested: int,
                  matched: Sequence[Block]) -> tuple[NamespaceState, int, int, int, dict[Tier, int]]:
        """Count a Get's keys per namespace and per tier; returns what it counted.

        A key is looked for in host memory, then in each tier below in
        order: one resident in host memory is a host hit; any other is a
        host miss (a page fault), then a hit in the fastest tier below that
        has it (read back, or being read back for another Get) and a miss
        in each tier it was looked for in before that.
        """
        lower_hits: dict[Tier, int] = {}
        in_host = len(matched)
        if self.blocks.lower:
            in_host = 0
            loading = self.blocks.loading
            for block in matched:
                if self.blocks.host_slot(block) != NO_SLOT and block not in loading:
                    in_host += 1
                else:
                    tier = self.blocks.lower_copy(block)[0]
                    lower_hits[tier] = lower_hits.get(tier, 0) + 1
        counted = (state, requested, len(matched), in_host, lower_hits)
        self.tally_get(*counted, sign=1)
        return counted

    def tally_get(self, state: NamespaceState, requested: int, matched: int, in_host: int,
                  lower_hits: dict[Tier, int], *, sign: int) -> None:
        state.get_hits += sign * matched
        state.get_misses += sign * (requested - matched)
        self.host.counters.hits += sign * in_host
        self.host.counters.misses += sign * (requested - in_host)
        # Keys past host memory: each tier below misses what it was asked
        # for and did not have; what it had goes no further down.
        asked = requested - in_host
        for tier in self.blocks.lower:
            hits = lower_hits.get(tier, 0)
            tier.counters.hits += sign * hits
            tier.counters.misses += sign * (asked - hits)
            asked -= hits
