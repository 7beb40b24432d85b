"""The engine: the one owner of kvd's block state.

Everything that decides which block lives where is here and is synchronous:
namespaces and their prefix indexes, the host tier's slot bookkeeping and
eviction policy, block handles and client leases. The engine never touches
payload bytes, never reads a clock (callers pass `now_ms`) and never does
I/O, so the daemon, the tests and a simulator drive exactly the same code.

Concurrency: the daemon calls the engine only from its event-loop thread
and never awaits in the middle of an engine call, so every call is atomic
with respect to every other; no locks exist to get wrong.

Errors: bad client input raises a `kvd.errors.KvdError` *before* any state
changes, so a rejected request never alters stored data. Inconsistent
internal state raises `InvariantError` and is never caught.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvd.core.block import NO_SLOT, Block, BlockHandle, BlockState
from kvd.core.events import EventLog
from kvd.core.keys import KEY_BYTES, NamespaceSpec
from kvd.core.lease import Lease, LeaseKind, LeaseTable
from kvd.core.policy import DiskPolicies, make_policy
from kvd.core.quota import QuotaExceeded, TenantQuota
from kvd.core.radix import PrefixIndex
from kvd.core.residency import TierStack
from kvd.core.slot_pool import SlotPool
from kvd.core.tier import MemoryTier, StorageTier, TierId
from kvd.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvd.invariants import check


class ReserveStatus(enum.IntEnum):
    """Outcome of reserving one key; values match kvd.v1.ReserveStatus."""

    RESERVED = 1
    EXISTS = 2
    IN_FLIGHT = 3
    NO_SPACE = 4


class PrefetchLimit(enum.IntEnum):
    """Why a prefetch left blocks only on disk; values match kvd.v1.PrefetchLimit."""

    NONE = 0
    IN_FLIGHT = 1  # the bound on prefetch reads in flight was reached
    HOST_FULL = 2  # no host slot could be freed but by dropping a block held nowhere else
    PROMOTION = 3  # the promotion policy declined the block


# The longest client id: a client's own id has at most 128 characters; the
# server puts its tenant's name (64 at most) and a separator in front, and
# an inline Get's private prefix in front of that (kvd.server.auth).
MAX_CLIENT_ID_CHARS = 256
# How far past the eviction policy's victim, in blocks that would be
# evicted first (at most 1/32 of the host tier), a block of the
# requesting tenant may be taken instead (Engine._allocate_host_slot).
TENANT_AFFINITY_WINDOW = 64


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_batch_keys: int = 65536
    lease_ms_default: int = 30_000
    lease_ms_max: int = 600_000
    max_leases: int = 65536
    max_namespaces: int = 1024
    # Blocks one client may pin through its open leases at once.
    max_pins_per_client: int = 65536


@dataclass(slots=True, eq=False)
class NamespaceState:
    namespace_id: bytes
    spec: NamespaceSpec
    block_bytes: int
    index: PrefixIndex
    lookup_hits: int = 0
    lookup_misses: int = 0
    get_hits: int = 0
    get_misses: int = 0
    # The id its clients know it by: the digest of the spec they sent,
    # without the tenant (== namespace_id for a namespace of no tenant).
    public_id: bytes = b""
    # Its tenant's usage and quota (None: no tenant).
    quota: TenantQuota | None = None


@dataclass(slots=True)
class ReserveResult:
    lease: Lease | None
    statuses: list[ReserveStatus]
    # Host slot of each key; NO_SLOT where the status is not RESERVED.
    slots: list[int]


@dataclass(slots=True)
class DiskWrite:
    """One block on its way to the disk tier; the handle pins it meanwhile."""

    block: Block
    handle: BlockHandle
    disk_slot: int
    host_slot: int


@dataclass(slots=True)
class DiskLoad:
    """One block being read from the disk tier into a host slot."""

    block: Block
    host_slot: int
    disk_slot: int
    # A prefetch's own pin on the block while it loads (a Get's loads are
    # pinned by its lease); finish_prefetch releases it.
    handle: BlockHandle | None = None


@dataclass(slots=True)
class GetPlan:
    """A Get in progress: the pinned prefix and the disk reads it needs first."""

    lease: Lease | None
    matched: list[Block]
    loads: list[DiskLoad] = field(default_factory=list)
    # Blocks another Get is loading already; wait for it, then settle.
    waits: list[Block] = field(default_factory=list)
    # Cut short because no host slot could be freed (all pinned).
    starved: bool = False
    # What begin_get counted (Engine._count_get), taken back by abandon_get
    # so that a Get retried after a starved plan counts its keys once.
    counted: tuple[NamespaceState, int, int, int] | None = None


@dataclass(slots=True)
class PrefetchPlan:
    """A Prefetch: what it found of the stored prefix and the disk reads it queued.

    Every matched block is counted once: in_host, loading (another read of
    it is in flight), queued (one of `loads`) or refused (`limit` says why).
    """

    loads: list[DiskLoad] = field(default_factory=list)
    matched: int = 0
    missing: int = 0
    in_host: int = 0
    loading: int = 0
    refused: int = 0
    limit: PrefetchLimit = PrefetchLimit.NONE


@dataclass(slots=True)
class PrefetchCounters:
    """Per-block outcomes of Prefetch requests, then of the blocks they read."""

    queued: int = 0
    in_host: int = 0
    loading: int = 0
    missing: int = 0
    refused: int = 0
    # Prefetched blocks a Get then matched, and those that left host memory
    # first (evicted, demoted, deleted, or dropped because their read failed).
    used: int = 0
    wasted: int = 0


def namespace_not_found(namespace_id: bytes) -> NotFound:
    """The one error for a namespace the caller cannot use, whether or not anyone registered it."""
    return NotFound(f"namespace {namespace_id.hex()[:16]}... is not registered; call RegisterNamespace first")


def _disk_evictable(block: Block) -> bool:
    # An index leaf only, so a durable block's prefix stays durable.
    return block.ref_count == 0 and block.children == 0 and block.state == BlockState.SEALED


class Engine:
    def __init__(
        self,
        *,
        host_slot_count: int,
        host_slot_bytes: int,
        policy: str = "lru",
        limits: EngineLimits | None = None,
        disk_slot_count: int = 0,
        disk_slot_bytes: int = 0,
        write_queue_max: int = 65536,
        events: EventLog | None = None,
        disk_policies: DiskPolicies | None = None,
        high_watermark: float = 0.9,
        low_watermark: float = 0.8,
        tenant_quotas: Sequence[TenantQuota] = (),
    ) -> None:
        self.limits = limits or EngineLimits()
        # The stack: host memory first, at global slot id 0; then the disk.
        self.host = MemoryTier(TierId.HOST, SlotPool(host_slot_count, host_slot_bytes),
                               make_policy(policy, host_slot_count), client_mappable=True,
                               high_watermark=high_watermark, low_watermark=low_watermark)
        self.disk = (StorageTier(TierId.DISK, SlotPool(disk_slot_count, disk_slot_bytes, base=host_slot_count,
                                                       persistent=True), disk_policies)
                     if disk_slot_count else None)
        self.tiers = TierStack([self.host] + ([self.disk] if self.disk is not None else []))
        check(self.host.rank == 0 and self.host.pool.base == 0, "host memory heads the stack at slot id 0")
        self._host_end = self.host.pool.end
        # Sealed blocks waiting to be written to disk, in seal order, so a
        # parent is always written no later than its children.
        self.write_queue: deque[Block] = deque()
        self.write_queue_max = write_queue_max
        self.write_queue_dropped = 0
        # Blocks whose host slot is being filled from disk.
        self.loading: set[Block] = set()
        # Prefetched blocks no Get has used yet, from the moment their read
        # is queued until a Get matches them (used) or they leave host
        # memory (wasted). A side set rather than a flag on Block: one more
        # field costs 16 B per block.
        # Each member has a host slot, so it holds at most host.slot_count.
        self.prefetched: set[Block] = set()
        self.prefetch_in_flight = 0
        self.prefetch_counters = PrefetchCounters()
        self.leases = LeaseTable(self.limits.max_leases, self.limits.max_pins_per_client)
        self._namespaces: dict[bytes, NamespaceState] = {}
        # (tenant, the id its clients know) -> namespace: how the daemon
        # finds a tenant's namespace, and only that tenant's.
        self._public: dict[tuple[str, bytes], NamespaceState] = {}
        # Usage and quotas of the configured tenants (and of tenants whose
        # namespaces were recovered from disk: those have no limits).
        self.tenants: dict[str, TenantQuota] = {quota.name: quota for quota in tenant_quotas}
        self.live_handles = 0
        self.leaked_handles = 0
        self.pinned_blocks = 0
        # Stored / removed / tier-changed events for KV-aware routers.
        self.events = events if events is not None else EventLog()
        # Per-tenant host memory (kvd.tiers.host.HostArena.claim): called
        # with (slot, tenant name) when a slot is given to a block of
        # another tenant than the one whose memory backs it; None without
        # tenants. See `_allocate_host_slot` for why that should be rare.
        self.claim_host_slot: Callable[[int, str], None] | None = None
        self.slot_tenants: list[str | None] = [None] * host_slot_count
        # Slots the kernel would not switch to another tenant's memory.
        self.claim_failures = 0

    # ------------------------------------------------------------------
    # Namespaces

    def register_namespace(self, spec: NamespaceSpec) -> NamespaceState:
        """Register (idempotently) the cache identity `spec`.

        A spec with a tenant (kvd.core.keys) is that tenant's namespace: its
        blocks are charged to the tenant's quota, and tenant_namespace finds
        it for that tenant only.
        """
        spec.validate()
        namespace_id = spec.namespace_id()
        existing = self._namespaces.get(namespace_id)
        if existing is not None:
            return existing
        if len(self._namespaces) >= self.limits.max_namespaces:
            raise ResourceExhausted(f"too many namespaces (max {self.limits.max_namespaces})")
        if spec.block_bytes > self.host.slot_bytes:
            raise InvalidArgument(
                f"a block of this namespace is {spec.block_bytes} bytes, larger than the host slot "
                f"of {self.host.slot_bytes} bytes; use fewer tokens per block or raise host.slot_bytes"
            )
        quota = self.tenant_quota(spec.tenant) if spec.tenant else None
        public_id = spec.without_tenant().namespace_id() if spec.tenant else namespace_id
        state = NamespaceState(
            namespace_id, spec, spec.block_bytes, PrefixIndex(spec.model_id, spec.block_bytes, namespace_id, quota),
            public_id=public_id, quota=quota,
        )
        self._namespaces[namespace_id] = state
        self._public[(spec.tenant, public_id)] = state
        return state

    def tenant_quota(self, tenant: str) -> TenantQuota:
        """The usage and quota of `tenant` (one with no limits if it is not configured)."""
        check(bool(tenant), "the empty tenant has no quota")
        quota = self.tenants.get(tenant)
        if quota is None:
            quota = self.tenants[tenant] = TenantQuota(tenant)
        return quota

    def tenant_namespace(self, tenant: str, public_id: bytes) -> NamespaceState:
        """The namespace `tenant` knows as `public_id` ("": the namespaces of no tenant).

        Another tenant's namespace is NOT_FOUND exactly like one nobody
        registered, so its existence is not revealed.
        """
        if len(public_id) != KEY_BYTES:
            raise InvalidArgument(f"namespace_id must be {KEY_BYTES} bytes, got {len(public_id)}")
        state = self._public.get((tenant, public_id))
        if state is None:
            raise namespace_not_found(public_id)
        return state

    def enable_disk(self, namespace_id: bytes) -> None:
        """Write this namespace's sealed blocks to the disk tier from now on."""
        check(self.disk is not None, "no disk tier")
        self.namespace(namespace_id).index.disk_enabled = True

    def namespace(self, namespace_id: bytes) -> NamespaceState:
        if len(namespace_id) != KEY_BYTES:
            raise InvalidArgument(f"namespace_id must be {KEY_BYTES} bytes, got {len(namespace_id)}")
        state = self._namespaces.get(namespace_id)
        if state is None:
            raise namespace_not_found(namespace_id)
        return state

    def namespaces(self) -> list[NamespaceState]:
        return list(self._namespaces.values())

    # ------------------------------------------------------------------
    # Lookup and Get

    def lookup(self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes = b"") -> list[Block]:
        """Longest stored prefix of `keys` (a chain continuing `parent_key`).

        Marks the prefix as used. An unknown parent matches nothing.
        """
        state = self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        matched = self._match(state, keys, parent_key)
        self._touch_prefix(matched)
        state.lookup_hits += len(matched)
        state.lookup_misses += len(keys) - len(matched)
        return matched

    def stored(self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes = b"") -> list[Block]:
        """Longest stored prefix of `keys`, with no side effect: not counted
        as a lookup or a Get, no block marked used (a durability wait asks)."""
        state = self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        return [block for block in self._match(state, keys, parent_key) if block.state == BlockState.SEALED]

    def get(
        self,
        namespace_id: bytes,
        client_id: str,
        keys: Sequence[bytes],
        lease_ms: int,
        now_ms: int,
        parent_key: bytes = b"",
    ) -> tuple[Lease | None, list[Block]]:
        """Pin the longest stored prefix of `keys` under a read lease.

        For prefixes resident in the host tier. With a disk tier, callers use
        begin_get / finish_loads / settle_get, which also bring blocks in from
        disk.
        """
        plan = self.begin_get(namespace_id, client_id, keys, lease_ms, now_ms, parent_key)
        check(not plan.loads and not plan.waits, "get() of a prefix on disk: use begin_get")
        return plan.lease, plan.matched

    def begin_get(
        self,
        namespace_id: bytes,
        client_id: str,
        keys: Sequence[bytes],
        lease_ms: int,
        now_ms: int,
        parent_key: bytes = b"",
    ) -> GetPlan:
        """Pin the longest stored prefix of `keys` and plan its disk reads.

        Every matched block is pinned under one read lease. Blocks only on
        disk get a host slot now (evicting if needed) and are listed in
        `loads`: the caller reads them into those slots and reports with
        finish_loads. Blocks another Get is already loading are in `waits`.
        If the host tier cannot take a block, the prefix is cut before it.
        """
        state = self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        self._check_client(client_id)
        deadline_ms = now_ms + self._lease_ms(lease_ms)
        self.expire(now_ms)
        matched = self._match(state, keys, parent_key)
        if matched:
            self._check_lease_room()
            self.leases.check_pin_room(client_id, len(matched))
        counted = self._count_get(state, len(keys), matched)
        if not matched:
            return GetPlan(None, matched, counted=counted)
        self._touch_prefix(matched)
        self._note_sightings(matched)
        lease = self.leases.open(LeaseKind.READ, client_id, namespace_id, deadline_ms)
        lease.handles = [self._acquire(block) for block in matched]
        self.leases.charge(lease, len(lease.handles))
        plan = GetPlan(lease, matched, counted=counted)
        for position, block in enumerate(matched):
            if block in self.loading:
                plan.waits.append(block)
                continue
            if self.host_slot(block) != NO_SLOT:
                continue
            if not self.disk.promotion.promote(block):
                self._cut_plan(plan, position)
                break
            slot = self._allocate_host_slot(block.index.tenant)
            if slot == NO_SLOT:
                self._cut_plan(plan, position)
                plan.starved = True
                break
            self._set_host_slot(block, slot)
            self.loading.add(block)
            self.disk.eviction.touch(self.disk_slot(block))
            plan.loads.append(DiskLoad(block, slot, self.disk_slot(block)))
        self._note_prefetch_use(plan.matched)
        return plan

    def finish_loads(self, loads: Sequence[DiskLoad], ok: Sequence[bool]) -> None:
        """Blocks read from disk: good ones are now in the host tier, bad ones are lost."""
        check(len(loads) == len(ok), "one outcome per load")
        disk = self.disk
        for load, good in zip(loads, ok):
            block = load.block
            if block not in self.loading:
                # An ancestor loaded in this batch was corrupt: lost already.
                check(block.state in (BlockState.LOST, BlockState.REMOVED), "{!r} was not loading", block)
                continue
            check(self.host_slot(block) == load.host_slot, "{!r} loads into another slot", block)
            self.loading.discard(block)
            if block.state == BlockState.LOST:
                # Lost while this read was in flight (an ancestor's read
                # failed): its host slot is free only now that nothing
                # writes into it any more.
                self._clear_host_slot(block, cold_parent=False)
                continue
            if good:
                disk.counters.loaded += 1
                self.events.tier_changed(block.index.namespace_id, block.key, TierId.HOST)
            else:
                # Corrupt or unreadable: never served, and neither is anything
                # chained under it.
                disk.counters.load_failures += 1
                self._lose(block)

    def abandon_get(self, plan: GetPlan) -> None:
        """Drop a plan whose loads were never started: slots back, pins released."""
        for load in plan.loads:
            block = load.block
            if block in self.loading:
                self.loading.discard(block)
                self._clear_host_slot(block, cold_parent=False)
        plan.loads = []
        if plan.lease is not None and not plan.lease.ended:
            self.leases.close(plan.lease)
        plan.lease = None
        plan.matched = []
        if plan.counted is not None:
            self._tally_get(*plan.counted, sign=-1)
            plan.counted = None

    def settle_get(self, plan: GetPlan) -> list[Block]:
        """The servable prefix of a plan whose loads have all finished."""
        for position, block in enumerate(plan.matched):
            check(block not in self.loading, "settle_get before the loads finished")
            # No host slot: a prefetch this Get waited for was dropped unread.
            if block.state != BlockState.SEALED or self.host_slot(block) == NO_SLOT:
                self._cut_plan(plan, position)
                break
        return plan.matched

    # ------------------------------------------------------------------
    # Prefetch: disk reads ahead of a Get, with no lease

    def begin_prefetch(
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
        state = self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        check(max_in_flight >= 0, "max_in_flight must not be negative")
        matched = self._match(state, keys, parent_key)
        plan = PrefetchPlan(matched=len(matched), missing=len(keys) - len(matched))
        # Pinned while slots are found, so that making room never evicts a
        # block of this very prefix; unpinned, they rejoin the eviction
        # order as just used (as after a Get).
        pins = [self._acquire(block) for block in matched]
        for block in matched:
            if block in self.loading:
                plan.loading += 1
            elif self.host_slot(block) != NO_SLOT:
                plan.in_host += 1
            elif plan.limit != PrefetchLimit.NONE or not self._queue_prefetch(block, plan, max_in_flight):
                plan.refused += 1
        for pin in reversed(pins):
            pin.release()
        counters = self.prefetch_counters
        counters.queued += len(plan.loads)
        counters.in_host += plan.in_host
        counters.loading += plan.loading
        counters.refused += plan.refused
        counters.missing += plan.missing
        return plan

    def _queue_prefetch(self, block: Block, plan: PrefetchPlan, max_in_flight: int) -> bool:
        """Give a disk-only block a host slot and a load in `plan`; False (and plan.limit) if it cannot."""
        if self.prefetch_in_flight >= max_in_flight:
            plan.limit = PrefetchLimit.IN_FLIGHT
            return False
        if not self.disk.promotion.promote(block):
            plan.limit = PrefetchLimit.PROMOTION
            return False
        quota = block.index.quota
        if quota is not None and quota.host_excess_bytes(1, self.host.slot_bytes) > 0:
            # A guess never takes its tenant past its host quota.
            plan.limit = PrefetchLimit.HOST_FULL
            return False
        # A prefetch is a guess: to make room it may demote a block that has
        # a disk copy, but never drop one that exists in host memory only.
        victim = None if self.host.pool.free_count else self.host.policy.victim()
        slot = (NO_SLOT if victim is not None and self.disk_slot(victim) == NO_SLOT
                else self._allocate_host_slot(block.index.tenant, prefer_own=False))
        if slot == NO_SLOT:
            plan.limit = PrefetchLimit.HOST_FULL
            return False
        self._set_host_slot(block, slot)
        self.loading.add(block)
        self.disk.eviction.touch(self.disk_slot(block))
        self.prefetched.add(block)
        self.prefetch_in_flight += 1
        plan.loads.append(DiskLoad(block, slot, self.disk_slot(block), self._acquire(block)))
        return True

    def finish_prefetch(self, loads: Sequence[DiskLoad], ok: Sequence[bool]) -> None:
        """Prefetch reads done (as finish_loads), then unpinned: good blocks stay
        in host memory as ordinary eviction candidates, bad ones are lost."""
        self.finish_loads(loads, ok)
        for load in loads:
            check(load.handle is not None, "a prefetch load without its pin")
            self.prefetch_in_flight -= 1
            load.handle.release()

    def abandon_prefetch(self, loads: Sequence[DiskLoad]) -> None:
        """Drop prefetch loads whose reads never started: slots back (counted
        as wasted), pins released; the blocks stay on disk."""
        for load in loads:
            block = load.block
            check(block in self.loading and load.handle is not None, "{!r} is no prefetch load", block)
            self.loading.discard(block)
            self._clear_host_slot(block, cold_parent=False)
            self.prefetch_in_flight -= 1
            load.handle.release()

    def _note_prefetch_use(self, matched: Sequence[Block]) -> None:
        """A Get matched these blocks: prefetched ones were worth it."""
        prefetched = self.prefetched
        if not prefetched:
            return
        for block in matched:
            if block in prefetched:
                prefetched.remove(block)
                self.prefetch_counters.used += 1

    # ------------------------------------------------------------------
    # Disk tier: write-through, removals, recovery

    def pick_writes(self, limit: int) -> list[DiskWrite]:
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
        picks: list[DiskWrite] = []
        picked: set[Block] = set()
        full_tenants: set[TenantQuota] = set()
        queue = self.write_queue
        while queue and len(picks) < limit:
            block = queue[0]
            if (
                block.state != BlockState.SEALED
                or self.disk_slot(block) != NO_SLOT
                or self.host_slot(block) == NO_SLOT
                or block in picked
            ):
                queue.popleft()  # gone, already durable, no bytes to write, or queued twice
                continue
            quota = block.index.quota
            at_quota = quota is not None and quota.disk_full(disk.slot_bytes)
            parent = block.parent
            if parent is not None and self.disk_slot(parent) == NO_SLOT and parent not in picked:
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
                slot = NO_SLOT if quota in full_tenants else self._take_own_disk_slot(quota)
                if slot == NO_SLOT:
                    full_tenants.add(quota)
                    queue.popleft()
                    quota.counters.disk_refused += 1
                    continue
            else:
                slot = self._allocate_disk_slot()
                if slot == NO_SLOT:
                    break  # full until evictions' removals are journalled
            queue.popleft()
            disk.pool.assign(slot, block)
            if quota is not None:
                quota.disk_used_bytes += disk.slot_bytes
            disk.pool.incoming.add(slot)
            picks.append(DiskWrite(block, self._acquire(block), slot, self.host_slot(block)))
            picked.add(block)
        return picks

    def finish_writes(self, writes: Sequence[DiskWrite], ok: Sequence[bool]) -> None:
        """Record which writes are durable. Failed slots need a REMOVE first:
        their record may have reached the manifest."""
        disk = self.disk
        check(disk is not None and len(writes) == len(ok), "one outcome per write")
        for write, good in zip(writes, ok):
            block = write.block
            check(write.disk_slot in disk.pool.incoming and disk.pool.owners[write.disk_slot] is block, "unknown disk write")
            disk.pool.incoming.discard(write.disk_slot)
            parent = block.parent
            durable_prefix = parent is None or self.disk_slot(parent) != NO_SLOT
            if good and durable_prefix and block.state == BlockState.SEALED:
                self.tiers.add_copy(block, disk, write.disk_slot)
                disk.pool.used_bytes += self._block_bytes(block)
                disk.eviction.touch(write.disk_slot)
                disk.counters.written += 1
            else:
                disk.pool.release(write.disk_slot, block)
                if block.index.quota is not None:
                    block.index.quota.disk_used_bytes -= disk.slot_bytes
                disk.counters.write_failures += 1
            write.handle.release()

    def take_disk_removals(self) -> list[tuple[bytes, bytes, int]]:
        """(namespace id, key, disk slot) whose REMOVE must be journalled."""
        if self.disk is None:
            return []
        return self.disk.pool.take_removals()

    def confirm_disk_removals(self, slots: Sequence[int]) -> None:
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
        for block in blocks:
            chain = []
            node: Block | None = block
            while node is not None and self.disk_slot(node) == NO_SLOT and node not in seen:
                seen.add(node)
                chain.append(node)
                node = node.parent
            if not chain:
                continue
            if queued is None:
                queued = set(self.write_queue)
            again = False
            for member in reversed(chain):
                if member.state != BlockState.SEALED or self.host_slot(member) == NO_SLOT or not member.index.disk_enabled:
                    continue
                again = again or member not in queued
                if again:
                    self.write_queue.append(member)
                    queued.add(member)

    def _allocate_disk_slot(self) -> int:
        """A free disk slot, or the slot of the disk policy's victim; NO_SLOT if none may go."""
        slot = self.disk.pool.take_free()
        if slot != NO_SLOT:
            return slot
        victim = self._disk_victim(_disk_evictable)
        return NO_SLOT if victim is None else self._evict_disk_block(victim)

    def _disk_victim(self, evictable: Callable[[Block], bool]) -> Block | None:
        pool = self.disk.pool
        return self.disk.eviction.victim(pool.owners, pool.incoming, evictable)

    def _take_own_disk_slot(self, quota: TenantQuota) -> int:
        """The disk slot of one of the tenant's own blocks (the disk policy's
        pick among them), evicted for a newer one; NO_SLOT if none may go."""
        victim = self._disk_victim(lambda block: block.index.quota is quota and _disk_evictable(block))
        if victim is None:
            return NO_SLOT
        quota.counters.disk_evicted += 1
        return self._evict_disk_block(victim)

    def _evict_disk_block(self, victim: Block) -> int:
        """Evict `victim`'s disk copy (the block too, if no host copy) and hand out its slot."""
        disk = self.disk
        disk.counters.evictions += 1
        slot = self.disk_slot(victim)
        if self.host_slot(victim) != NO_SLOT:
            self._free_disk_slot(victim)
        else:
            disk.counters.dropped += 1
            self._remove_block(victim, cold_parent=False)
        # Reused at once: the caller journals take_disk_removals() before it
        # writes the new bytes (see pick_writes).
        disk.pool.reuse(slot)
        return slot

    def recover(self, namespace_id: bytes, records: Iterable[tuple[bytes, bytes, int]]) -> int:
        """Index blocks found on disk: (key, parent key or b"", disk slot).

        Parents are inserted before children whatever the record order. A
        block whose parent is not on disk, or whose slot is invalid or taken,
        is dropped: its slot is queued for a REMOVE. Returns blocks indexed.
        """
        state = self.namespace(namespace_id)
        disk = self.disk
        check(disk is not None, "recover without a disk tier")
        index = state.index
        pending = {key: (parent_key, slot) for key, parent_key, slot in records}
        recovered = 0

        def drop(key: bytes, slot: int) -> None:
            disk.counters.recovery_dropped += 1
            if 0 <= slot < disk.slot_count and disk.pool.owners[slot] is None and slot not in disk.pool.retired:
                disk.pool.forget(slot, namespace_id, key)

        for start in list(pending):
            # Walk up to the first ancestor already indexed (or a root), then
            # insert downwards: iterative, chains can be thousands long.
            chain = []
            key = start
            while key in pending and key not in index.nodes:
                chain.append(key)
                parent_key = pending[key][0]
                if not parent_key or parent_key in index.nodes:
                    break
                key = parent_key
            for key in reversed(chain):
                parent_key, slot = pending.pop(key)
                parent = index.nodes.get(parent_key) if parent_key else None
                valid_slot = (0 <= slot < disk.slot_count and disk.pool.owners[slot] is None
                              and slot not in disk.pool.quarantine and slot not in disk.pool.retired)
                if (parent_key and (parent is None or parent.state != BlockState.SEALED)) or not valid_slot:
                    drop(key, slot)
                    continue
                block = index.insert(key, parent)
                block.state = BlockState.SEALED
                disk.pool.assign(slot, block)
                self.tiers.add_copy(block, disk, slot)
                disk.pool.used_bytes += state.block_bytes
                if state.quota is not None:
                    state.quota.disk_used_bytes += disk.slot_bytes
                recovered += 1
                self.events.stored(namespace_id, [key], parent_key, TierId.DISK)
            if start in pending:
                # Its chain reached a key neither indexed nor recorded.
                parent_key, slot = pending.pop(start)
                drop(start, slot)
        disk.counters.recovered += recovered
        disk.pool.rebuild_free()
        return recovered

    def retire_disk_slots(self, slots: Sequence[int]) -> None:
        """Never use these disk slots (a drive out of service); call before recover."""
        check(self.disk is not None, "retire_disk_slots without a disk tier")
        self.disk.pool.retire(slots)

    def _cut_plan(self, plan: GetPlan, position: int) -> None:
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

    def peek(self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes = b"") -> list[Block]:
        """Like get without a lease: for callers that copy out before they return."""
        state = self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        matched = self._match(state, keys, parent_key)
        self._count_get(state, len(keys), matched)
        self._touch_prefix(matched)
        self._note_sightings(matched)
        return matched

    # ------------------------------------------------------------------
    # Put: reserve, then commit

    def reserve(
        self,
        namespace_id: bytes,
        client_id: str,
        parent_key: bytes,
        keys: Sequence[bytes],
        lease_ms: int,
        now_ms: int,
    ) -> ReserveResult:
        """Reserve writable slots for the keys of a chain not yet stored.

        Walks the chain from `parent_key`: stored keys are EXISTS, keys
        another client is writing stop the walk (IN_FLIGHT), missing keys get
        a slot (RESERVED) until none can be freed (NO_SPACE). The reserved
        keys are always one contiguous run, held by one write lease.
        """
        state = self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        self._check_client(client_id)
        if len(set(keys)) != len(keys):
            raise InvalidArgument("keys contain duplicates; a chain never repeats a key")
        deadline_ms = now_ms + self._lease_ms(lease_ms)
        self.expire(now_ms)
        index = state.index
        parent = self._parent_block(index, parent_key)

        statuses: list[ReserveStatus] = []
        slots: list[int] = []
        # Validate the whole walk before changing anything.
        first_missing = len(keys)
        for position, key in enumerate(keys):
            node = index.get(key)
            if node is None:
                first_missing = position
                break
            if node.parent is not parent:
                raise InvalidArgument(
                    f"keys[{position}] is stored under a different parent; keys must be a chain from parent_key"
                )
            if node.state != BlockState.SEALED:
                # Being written by another client (or a tombstone waiting
                # for its readers): nothing to do from here for now.
                first_missing = position
                break
            statuses.append(ReserveStatus.EXISTS)
            slots.append(NO_SLOT)
            parent = node
        in_flight = first_missing < len(keys) and index.get(keys[first_missing]) is not None
        if not in_flight and first_missing < len(keys):
            # The keys after the first missing one must be missing too: a
            # stored key cannot be the child of a block that does not exist
            # yet. Checked before the touch below and before any slot is
            # allocated (allocating evicts), so a rejection changes nothing.
            for position in range(first_missing + 1, len(keys)):
                if keys[position] in index.nodes:
                    raise InvalidArgument(
                        f"keys[{position}] is stored under a different parent; keys must be a chain from parent_key"
                    )
            self._check_lease_room()
            # At most every missing key, and the parent pinned under them.
            self.leases.check_pin_room(client_id, len(keys) - first_missing + (parent is not None))
            if state.quota is not None:
                # The last check: past it the request goes ahead.
                self._make_host_quota_room(state.quota, len(keys) - first_missing, keep=parent)
        existing = [index.nodes[key] for key in keys[:first_missing]]
        self._touch_prefix(existing)
        self._note_sightings(existing)  # a Put of stored blocks: seen again

        lease: Lease | None = None
        if in_flight:
            # Someone else is writing the next block: nothing to do from here.
            statuses.extend([ReserveStatus.IN_FLIGHT] * (len(keys) - first_missing))
            slots.extend([NO_SLOT] * (len(keys) - first_missing))
            return ReserveResult(None, statuses, slots)
        if first_missing == len(keys):
            return ReserveResult(None, statuses, slots)

        lease = self.leases.open(LeaseKind.WRITE, client_id, namespace_id, deadline_ms)
        if parent is not None:
            lease.parent_handle = self._acquire(parent)
        for position in range(first_missing, len(keys)):
            key = keys[position]
            # Checked missing above; evicting only ever removes keys.
            check(key not in index.nodes, "reserved key appeared in the index during reserve")
            slot = self._allocate_host_slot(index.tenant)
            if slot == NO_SLOT:
                statuses.extend([ReserveStatus.NO_SPACE] * (len(keys) - position))
                slots.extend([NO_SLOT] * (len(keys) - position))
                break
            node = index.insert(key, parent)
            self._set_host_slot(node, slot)
            lease.handles.append(self._writer_handle(node))
            self.host.counters.reserved += 1
            statuses.append(ReserveStatus.RESERVED)
            slots.append(slot)
            parent = node
        self.leases.charge(lease, len(lease.handles) + (lease.parent_handle is not None))
        if not lease.handles:
            self.leases.close(lease)
            raise ResourceExhausted(
                f"host tier is full: all {self.host.slot_count} slots are pinned or being written"
            )
        return ReserveResult(lease, statuses, slots)

    def commit(
        self,
        namespace_id: bytes,
        client_id: str,
        lease_id: int,
        keys: Sequence[bytes],
        abort_keys: Sequence[bytes],
        now_ms: int,
    ) -> tuple[int, int]:
        """Seal `keys` (all, when both lists are empty) and abort `abort_keys`.

        Aborting a block aborts the rest of the chain after it. Returns
        (sealed, aborted). All checks run before any block changes.
        """
        self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        self._check_keys(abort_keys, "abort_keys")
        self.expire(now_ms)
        lease = self.leases.find(lease_id, client_id)
        if lease.kind != LeaseKind.WRITE:
            raise FailedPrecondition(f"lease {lease_id} is a read lease; only write leases are committed")
        if lease.namespace_id != namespace_id:
            raise InvalidArgument(f"lease {lease_id} belongs to another namespace")
        positions = {handle.key: position for position, handle in enumerate(lease.handles)}
        for field_name, requested in (("keys", keys), ("abort_keys", abort_keys)):
            for key in requested:
                if key not in positions:
                    raise InvalidArgument(f"{field_name} has key {key.hex()[:16]}... that is not part of lease {lease_id}")
        if len(set(keys)) != len(keys) or len(set(abort_keys)) != len(abort_keys):
            raise InvalidArgument("keys or abort_keys contain duplicates")
        if set(keys) & set(abort_keys):
            raise InvalidArgument("a key is both committed and aborted")
        for key in keys:
            handle = lease.handles[positions[key]]
            if handle.released:
                raise FailedPrecondition(f"block {key.hex()[:16]}... was aborted in lease {lease_id}")
            if not handle.writable:
                raise FailedPrecondition(f"block {key.hex()[:16]}... is already committed")
        if not keys and not abort_keys:
            keys = [handle.key for handle in lease.handles if handle.writable]
        to_seal = {positions[key] for key in keys}
        abort_from = min((positions[key] for key in abort_keys), default=len(lease.handles))
        # The lease is one chain: a block may be sealed only if every earlier
        # block is sealed already or sealed by this same call. One pass.
        first_unsealed_gap = None
        for position, handle in enumerate(lease.handles):
            if position in to_seal:
                if position >= abort_from:
                    raise FailedPrecondition("cannot commit a block after an aborted block of the same chain")
                if first_unsealed_gap is not None:
                    raise FailedPrecondition(
                        f"cannot commit keys[{position}] of the lease before its parent (position {first_unsealed_gap})"
                    )
            elif handle.writable and first_unsealed_gap is None:
                first_unsealed_gap = position
        for position in range(abort_from, len(lease.handles)):
            if not lease.handles[position].writable and not lease.handles[position].released:
                raise FailedPrecondition(f"cannot abort: position {position} of the chain is already committed")

        aborted = 0
        for position in range(len(lease.handles) - 1, abort_from - 1, -1):
            handle = lease.handles[position]
            if not handle.released:
                handle.release()
                aborted += 1
        self.leases.refund(lease, aborted)
        sealed_keys = []
        for position in sorted(to_seal):
            lease.handles[position].seal()
            sealed_keys.append(lease.handles[position].key)
        if sealed_keys:
            # One chain: its first block's parent is sealed already.
            first = lease.handles[min(to_seal)].block.parent
            self.events.stored(namespace_id, sealed_keys, first.key if first is not None else b"", TierId.HOST)
        if not any(handle.writable for handle in lease.handles):
            self.leases.close(lease)
        return len(to_seal), aborted

    # ------------------------------------------------------------------
    # Release, renew, delete, expiry

    def release(self, client_id: str, lease_ids: Sequence[int]) -> int:
        self._check_client(client_id)
        if len(lease_ids) > self.limits.max_batch_keys:
            raise InvalidArgument(f"at most {self.limits.max_batch_keys} lease ids per call")
        leases = [self.leases.find(lease_id, client_id) for lease_id in lease_ids]
        if len({lease.lease_id for lease in leases}) != len(leases):
            raise InvalidArgument("lease_ids contain duplicates")
        for lease in leases:
            self.leases.close(lease)
        return len(leases)

    def renew(self, client_id: str, lease_id: int, lease_ms: int, now_ms: int) -> int:
        self._check_client(client_id)
        deadline_ms = now_ms + self._lease_ms(lease_ms)
        self.expire(now_ms)
        lease = self.leases.find(lease_id, client_id)
        self.leases.renew(lease, deadline_ms)
        return deadline_ms

    def delete(self, namespace_id: bytes, keys: Sequence[bytes]) -> tuple[int, int]:
        """Remove blocks and their descendants. Returns (deleted, pinned)."""
        state = self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        deleted = pinned = 0
        for key in keys:
            node = state.index.get(key)
            if node is None:
                continue
            subtree = state.index.subtree(node)
            if any(block.ref_count > 0 or block.state != BlockState.SEALED for block in subtree):
                pinned += 1
                continue
            for block in subtree:
                self._remove_block(block, cold_parent=False)
            deleted += len(subtree)
        self.host.counters.deleted += deleted
        return deleted, pinned

    def expire(self, now_ms: int) -> int:
        return len(self.leases.expire(now_ms))

    def close_all_leases(self) -> int:
        return self.leases.close_all()

    # ------------------------------------------------------------------
    # In-process handles (tests, simulator, future tiers)

    def pin(self, block: Block) -> BlockHandle:
        """A read handle on one sealed block (e.g. while a Put waits for its disk copy)."""
        return self._acquire(block)

    def acquire(self, namespace_id: bytes, keys: Sequence[bytes]) -> list[BlockHandle]:
        """Read handles for the stored prefix of `keys`; the caller releases them."""
        matched = self.namespace(namespace_id).index.match(keys)
        return [self._acquire(block) for block in matched]

    # ------------------------------------------------------------------
    # HandleOwner: called back by BlockHandle

    def _seal(self, block: Block) -> None:
        check(block.parent is None or block.parent.state == BlockState.SEALED, "seal before the parent")
        block.state = BlockState.SEALED
        self.host.counters.sealed += 1
        if self.disk is not None and block.index.disk_enabled and self.disk.admission.record(block.key):
            self._queue_write(block)

    def _queue_write(self, block: Block) -> None:
        if len(self.write_queue) < self.write_queue_max:
            self.write_queue.append(block)
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
            check(block.children == 0, "abort of a writable block with children: abort tail first")
            self.host.counters.aborted += 1
            self._remove_block(block, cold_parent=False)
            return
        if block.state == BlockState.LOST:
            self._bury(block)
            return
        check(block.state == BlockState.SEALED, "reference dropped on {!r}", block)
        self._maybe_admit(block, cold=False)

    def _count_leak(self) -> None:
        self.leaked_handles += 1

    # ------------------------------------------------------------------
    # Internals

    def _acquire(self, block: Block) -> BlockHandle:
        check(block.state == BlockState.SEALED, "read handle on {!r}", block)
        self._withdraw(block)
        if block.ref_count == 0:
            self.pinned_blocks += 1
        block.ref_count += 1
        self.live_handles += 1
        return BlockHandle(self, block, writer=False)

    def _writer_handle(self, block: Block) -> BlockHandle:
        check(block.ref_count == 0 and block.state == BlockState.WRITABLE, "writer handle on a used block")
        block.ref_count = 1
        self.pinned_blocks += 1
        self.live_handles += 1
        return BlockHandle(self, block, writer=True)

    # ------------------------------------------------------------------
    # Watermarks: reclaim host memory ahead of need

    def host_reclaiming(self) -> bool:
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

        Stops at the first candidate without a disk copy: that one must be
        written back first (or, without a disk tier, be evicted on demand
        when a slot is needed: dropping blocks early would only lose hits).
        Returns the number demoted (at most `limit`).
        """
        host = self.host
        demoted = 0
        while host.pool.resident_blocks > host.low_slots and (limit is None or demoted < limit):
            victim = host.policy.victim()
            if victim is None or self.disk_slot(victim) == NO_SLOT:
                break
            self._evict_host_block(victim)  # durable: only its host copy goes
            host.counters.background_demotions += 1
            demoted += 1
        self.host_reclaiming()
        return demoted

    def _allocate_host_slot(self, tenant: str | None = None, *, prefer_own: bool = True) -> int:
        """A host slot for a block of `tenant` (see _free_host_slot), backed
        by the tenant's memory; NO_SLOT if none can be had. A slot whose
        memory cannot be switched to the tenant (the kernel refused the
        mapping) goes back to the free slots, and the caller sees NO_SLOT,
        as when the tier is full."""
        slot = self._free_host_slot(tenant if prefer_own else None)
        claim = self.claim_host_slot
        if slot == NO_SLOT or claim is None or tenant is None or self.slot_tenants[slot] == tenant:
            return slot
        try:
            claim(slot, tenant)
        except OSError:
            self.host.pool.give_back(slot)
            self.claim_failures += 1
            return NO_SLOT
        self.slot_tenants[slot] = tenant
        return slot

    def _free_host_slot(self, tenant: str | None = None) -> int:
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
            victim = host.policy.victim_near(lambda block: slot_tenants[self.host_slot(block)] == tenant, window,
                                             lambda block: self._eviction_run(block, window))
        else:
            victim = host.policy.victim()
        if victim is None:
            return NO_SLOT
        self._evict_host_block(victim)
        host.counters.evictions += 1
        slot = host.pool.take_free()
        check(slot != NO_SLOT, "eviction freed no host slot")
        return slot

    def _evict_host_block(self, victim: Block) -> None:
        """Free the host slot of `victim`, an eviction candidate."""
        host = self.host
        # Evicting a host leaf may make its parent one: it goes next in line,
        # so a cold prefix leaves the host tier from its tail inward.
        if self.disk_slot(victim) != NO_SLOT:
            # A durable copy exists: only the host copy goes.
            self._clear_host_slot(victim, cold_parent=True)
            host.counters.demotions += 1
            self.events.tier_changed(victim.index.namespace_id, victim.key, TierId.DISK)
        elif victim.children == 0:
            if self.disk is not None and victim.index.disk_enabled and not self.disk.admission.admits(victim.key):
                # Dropped, never written: the admission filter turned it away.
                self.disk.counters.admission_rejected += 1
            else:
                host.counters.dropped += 1
            self._remove_block(victim, cold_parent=True)
        else:
            # Dirty with descendants that are gone from every tier but still
            # pinned as tombstones: the whole subtree goes.
            host.counters.dropped += 1
            self._lose(victim)

    def _make_host_quota_room(self, quota: TenantQuota, slots: int, keep: Block | None) -> None:
        """Before `slots` host slots are reserved for the tenant: evict its own
        least recently used candidates until they fit its host quota, or raise
        QuotaExceeded, having changed nothing, if they cannot be made to fit.

        `keep` (the block the reservation extends) is never a victim, nor is
        a candidate that has children but no disk copy: evicting it would
        lose its subtree. Other candidates either are leaves (removed) or
        have a disk copy (demoted, still stored).
        """
        slot_bytes = self.host.slot_bytes
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
        evictable = self._quota_evictable(quota, keep, needed)
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
            victim = next((block for block in quota.candidates if self._quota_victim(block, keep)), None)
            check(victim is not None, "the tenant's evictable blocks were miscounted")
            self._evict_host_block(victim)
            quota.counters.host_evicted += 1

    def _quota_evictable(self, quota: TenantQuota, keep: Block | None, needed: int) -> int:
        """How many of the tenant's host blocks (up to `needed`) evicting its
        candidates would free: each candidate, and the ancestors that
        become candidates once it is gone (counted only where that is
        certain, so the count never exceeds what eviction frees)."""
        count = 0
        counted: set[Block] = set()
        for block in quota.candidates:
            if not self._quota_victim(block, keep):
                continue
            count += 1
            child, parent = block, block.parent
            while count < needed and parent is not None and parent not in counted:
                # The parent's children once `child` is gone: a non-durable child leaves the index.
                children_left = parent.children - (0 if self.disk_slot(child) != NO_SLOT else 1)
                if not (self.host_slot(parent) != NO_SLOT and self.tiers.resident_children(parent, self.host) == 1 and parent.ref_count == 0
                        and parent.state == BlockState.SEALED and parent.index.quota is quota
                        and self._quota_victim(parent, keep, children_left)):
                    break
                counted.add(parent)
                count += 1
                child, parent = parent, parent.parent
            if count >= needed:
                break
        return count

    def _eviction_run(self, block: Block, limit: int) -> int:
        """Host blocks that leave, at most `limit`, when candidate `block` is
        evicted: it and the ancestors that become candidates after it, up the
        chain while each has no other child in host memory."""
        run = 1
        parent = block.parent
        while (run < limit and parent is not None and self.host_slot(parent) != NO_SLOT
               and self.tiers.resident_children(parent, self.host) == 1):
            run += 1
            parent = parent.parent
        return run


    def _quota_victim(self, block: Block, keep: Block | None, children: int | None = None) -> bool:
        """Whether a tenant's candidate may go to keep it within its host quota:
        not the block a reservation extends, and not one with children but no
        disk copy (evicting it would lose its subtree)."""
        if children is None:
            children = block.children
        return block is not keep and not (children and self.disk_slot(block) == NO_SLOT)

    def _remove_block(self, block: Block, *, cold_parent: bool) -> None:
        """Take a childless, unpinned block out of its index and its slot."""
        check(block.ref_count == 0, "removal of pinned {!r}", block)
        if block.state == BlockState.SEALED:
            # Writable blocks were never announced; tombstones were when lost.
            self.events.removed(block.index.namespace_id, block.key)
        self._withdraw(block)
        if self.host_slot(block) != NO_SLOT:
            self._clear_host_slot(block, cold_parent=cold_parent)
        if self.disk_slot(block) != NO_SLOT:
            self._free_disk_slot(block)
        parent = block.index.remove(block)
        if parent is not None:
            if parent.state == BlockState.LOST:
                self._bury(parent)
            else:
                self._maybe_admit(parent, cold=cold_parent)

    def _set_host_slot(self, block: Block, slot: int) -> None:
        check(self.host_slot(block) == NO_SLOT, "{!r} has a host slot already", block)
        check(self.claim_host_slot is None or self.slot_tenants[slot] == block.index.tenant,
              "host slot not in its block's tenant's memory")
        host = self.host
        host.pool.assign(slot, block)
        self.tiers.add_copy(block, host, slot)
        host.pool.used_bytes += self._block_bytes(block)
        if block.index.quota is not None:
            block.index.quota.host_used_bytes += host.slot_bytes
        if block.parent is not None:
            # It has a child in host memory now: no longer a candidate.
            self._withdraw(block.parent)

    def _clear_host_slot(self, block: Block, *, cold_parent: bool) -> None:
        slot = self.host_slot(block)
        check(slot != NO_SLOT and self.host.pool.owners[slot] is block, "host slot owner mismatch")
        if self.prefetched and block in self.prefetched:
            self.prefetched.remove(block)
            self.prefetch_counters.wasted += 1
        self._withdraw(block)
        host = self.host
        self.tiers.drop_copy(block, host)
        host.pool.release(slot, block)
        host.pool.used_bytes -= self._block_bytes(block)
        if block.index.quota is not None:
            block.index.quota.host_used_bytes -= host.slot_bytes
        if block.parent is not None:
            self._maybe_admit(block.parent, cold=cold_parent)

    def _free_disk_slot(self, block: Block) -> None:
        """Drop a block's disk copy; its slot waits for a durable REMOVE."""
        disk = self.disk
        slot = self.disk_slot(block)
        check(disk is not None and disk.pool.owners[slot] is block, "disk slot owner mismatch")
        self.tiers.drop_copy(block, disk)
        disk.pool.release(slot, block)
        disk.pool.used_bytes -= self._block_bytes(block)
        if block.index.quota is not None:
            block.index.quota.disk_used_bytes -= disk.slot_bytes

    def _lose(self, block: Block) -> None:
        """`block` and everything under it can no longer be served.

        Each loses its slots; those nobody pins leave the index at once
        (leaves first), the rest stay as LOST tombstones until released.
        Costs a scan of the index, which only corruption or a dirty
        eviction under pinned tombstones ever pays.
        """
        for member in block.index.subtree(block):
            if member.state == BlockState.LOST:
                continue
            if member.state == BlockState.SEALED:
                self.events.removed(member.index.namespace_id, member.key)
            self._withdraw(member)
            # A member being loaded keeps its host slot until its read is
            # over (finish_loads frees it): the disk thread may still be
            # writing into it, so handing it to another block now could
            # corrupt that block. Its loader pins it, so it stays a tombstone.
            # Likewise a writable member: its writer is filling the slot and
            # keeps it until it lets the block go (commit seals nothing LOST).
            if self.host_slot(member) != NO_SLOT and member not in self.loading and member.state != BlockState.WRITABLE:
                self._clear_host_slot(member, cold_parent=False)
            if self.disk_slot(member) != NO_SLOT:
                self._free_disk_slot(member)
            member.state = BlockState.LOST
        for member in block.index.subtree(block):
            if member.state == BlockState.LOST and member.ref_count == 0 and member.children == 0:
                self._remove_block(member, cold_parent=False)

    def _bury(self, block: Block) -> None:
        """Remove a tombstone once nothing pins it and nothing hangs under it."""
        if block.state == BlockState.LOST and block.ref_count == 0 and block.children == 0:
            self._remove_block(block, cold_parent=False)

    @staticmethod
    def _block_bytes(block: Block) -> int:
        return block.index.block_bytes

    def host_slot(self, block: Block) -> int:
        """`block`'s slot in host memory, or NO_SLOT.

        Host memory heads this stack at global slot id 0, so a block's
        chain starts with its host copy if it has one (TierStack.slot_in's
        fast path, inlined: this is on every hot path)."""
        slot = block.slot
        return slot if slot < self._host_end else NO_SLOT

    def disk_slot(self, block: Block) -> int:
        """`block`'s slot on disk, or NO_SLOT (also without a disk tier)."""
        return NO_SLOT if self.disk is None else self.tiers.slot_in(block, self.disk)

    def _maybe_admit(self, block: Block, *, cold: bool) -> None:
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

    def _withdraw(self, block: Block) -> None:
        if block in self.host.policy:
            self.host.policy.remove(block)
            quota = block.index.quota
            if quota is not None and quota.tracks_candidates:
                del quota.candidates[block]

    def _note_sightings(self, matched: Sequence[Block]) -> None:
        """A Get or a repeated Put saw these blocks (one chain): tell the disk
        admission filter, and queue for writing those that just qualified."""
        disk = self.disk
        if disk is None or not matched or not disk.admission.active or not matched[0].index.disk_enabled:
            return
        for position in disk.admission.record_many([block.key for block in matched]):
            block = matched[position]
            if self.host_slot(block) != NO_SLOT and self.disk_slot(block) == NO_SLOT:
                self._queue_write(block)

    def _touch_prefix(self, matched: Sequence[Block]) -> None:
        # Only a prefix's last block can be a leaf, so only it can be a
        # candidate: touching it is O(1) however long the prefix.
        if matched:
            last = matched[-1]
            if last in self.host.policy:
                self.host.policy.touch(last)
                quota = last.index.quota
                if quota is not None and quota.tracks_candidates:
                    quota.candidates.move_to_end(last)

    def _match(self, state: NamespaceState, keys: Sequence[bytes], parent_key: bytes) -> list[Block]:
        if not parent_key:
            return state.index.match(keys)
        if len(parent_key) != KEY_BYTES:
            raise InvalidArgument(f"parent_key must be empty or {KEY_BYTES} bytes, got {len(parent_key)}")
        parent = state.index.get(parent_key)
        if parent is None or parent.state != BlockState.SEALED:
            return []
        return state.index.match(keys, parent)

    def _parent_block(self, index: PrefixIndex, parent_key: bytes) -> Block | None:
        if not parent_key:
            return None
        if len(parent_key) != KEY_BYTES:
            raise InvalidArgument(f"parent_key must be empty or {KEY_BYTES} bytes, got {len(parent_key)}")
        parent = index.get(parent_key)
        if parent is None or parent.state != BlockState.SEALED:
            raise FailedPrecondition("parent_key is not a stored block; Put the prefix from an earlier point")
        return parent

    def _check_keys(self, keys: Sequence[bytes], field_name: str) -> None:
        if len(keys) > self.limits.max_batch_keys:
            raise InvalidArgument(f"{field_name} has {len(keys)} keys; at most {self.limits.max_batch_keys} per call")
        if keys and set(map(len, keys)) == {KEY_BYTES}:
            return
        for position, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise InvalidArgument(f"{field_name}[{position}] is {len(key)} bytes; keys are {KEY_BYTES} bytes")

    @staticmethod
    def _check_client(client_id: str) -> None:
        if not client_id or len(client_id) > MAX_CLIENT_ID_CHARS:
            raise InvalidArgument(f"client_id must be 1..{MAX_CLIENT_ID_CHARS} characters")

    def _count_get(self, state: NamespaceState, requested: int,
                   matched: Sequence[Block]) -> tuple[NamespaceState, int, int, int]:
        """Count a Get's keys per namespace and per tier; returns what it counted.

        A key is looked for in the host tier, then on disk: one resident in
        host memory is a host hit; any other is a host miss (a page fault),
        then a disk hit if it was matched (read back, or being read back
        for another Get) or a disk miss if it was not found at all.
        """
        in_host = len(matched)
        if self.disk is not None:
            in_host = sum(1 for block in matched if self.host_slot(block) != NO_SLOT and block not in self.loading)
        counted = (state, requested, len(matched), in_host)
        self._tally_get(*counted, sign=1)
        return counted

    def _tally_get(self, state: NamespaceState, requested: int, matched: int, in_host: int, *, sign: int) -> None:
        state.get_hits += sign * matched
        state.get_misses += sign * (requested - matched)
        if self.disk is not None:
            self.disk.counters.hits += sign * (matched - in_host)
            self.disk.counters.misses += sign * (requested - matched)
        self.host.counters.hits += sign * in_host
        self.host.counters.misses += sign * (requested - in_host)

    def _check_lease_room(self) -> None:
        if self.leases.full():
            raise ResourceExhausted(f"too many open leases (max {self.leases.max_leases}); release some first")

    def _lease_ms(self, lease_ms: int) -> int:
        if lease_ms == 0:
            return self.limits.lease_ms_default
        if not 0 < lease_ms <= self.limits.lease_ms_max:
            raise InvalidArgument(f"lease_ms {lease_ms} is outside (0, {self.limits.lease_ms_max}]")
        return lease_ms

    # ------------------------------------------------------------------

    def _verify_quotas(self) -> None:
        """Each tenant's usage is the slots its blocks hold; its candidates are the policy's."""
        if not self.tenants:
            return
        host_bytes = dict.fromkeys(self.tenants.values(), 0)
        disk_bytes = dict.fromkeys(self.tenants.values(), 0)
        candidates: dict[TenantQuota, list[Block]] = {quota: [] for quota in self.tenants.values()}
        for owner in self.host.pool.owners:
            if owner is not None and owner.index.quota is not None:
                host_bytes[owner.index.quota] += self.host.slot_bytes
        if self.disk is not None:
            for owner in self.disk.pool.owners:
                if owner is not None and owner.index.quota is not None:
                    disk_bytes[owner.index.quota] += self.disk.slot_bytes
        for block in self.host.policy.order():
            if block.index.quota is not None:
                candidates[block.index.quota].append(block)
        for quota in self.tenants.values():
            check(self.tenants.get(quota.name) is quota, "tenant {!r} filed twice", quota.name)
            check(quota.host_used_bytes == host_bytes[quota], "tenant {!r} host usage drifted", quota.name)
            check(quota.disk_used_bytes == disk_bytes[quota], "tenant {!r} disk usage drifted", quota.name)
            if quota.tracks_candidates:
                check(set(quota.candidates) == set(candidates[quota]),
                      "tenant {!r} candidates differ from the host policy's", quota.name)
            else:
                check(not quota.candidates, "tenant {!r} tracks candidates without a host limit", quota.name)
        for (tenant, public_id), state in self._public.items():
            check(self._namespaces.get(state.namespace_id) is state and state.spec.tenant == tenant
                  and state.public_id == public_id and state.index.quota is state.quota
                  and (state.quota is None) == (not tenant), 'namespace {} filed wrongly', public_id.hex()[:16])
        check(len(self._public) == len(self._namespaces), "a namespace is missing from the public map")

    def tier_of(self, block: Block) -> TierId:
        if self.host_slot(block) != NO_SLOT and block not in self.loading:
            return TierId.HOST
        check(self.disk_slot(block) != NO_SLOT, "{!r} resides in no tier", block)
        return TierId.DISK

    def verify(self) -> None:
        """Check every cross-structure invariant (tests call this after each step)."""
        self.tiers.verify()
        if self.claim_host_slot is not None:
            for slot, owner in enumerate(self.host.pool.owners):
                check(owner is None or self.slot_tenants[slot] == owner.index.tenant,
                      "a block sits in another tenant's host memory")
        self.leases.verify()
        self.events.verify()
        disk = self.disk
        resident_children: dict = {tier: {} for tier in self.tiers}
        host_resident = disk_resident = pinned = refs = host_bytes = disk_bytes = 0
        for state in self._namespaces.values():
            state.index.verify()
            for block in state.index:
                self.tiers.verify_block(block, resident_children)
                if block.state == BlockState.LOST:
                    # Only a pinned tombstone (a load or a writer still using
                    # its host slot) keeps that slot.
                    check((self.host_slot(block) == NO_SLOT or block.ref_count > 0) and self.disk_slot(block) == NO_SLOT,
                          'tombstone {!r} has slots', block)
                    check(block.ref_count > 0 or block.children > 0, "tombstone {!r} should be gone", block)
                else:
                    check(self.host_slot(block) != NO_SLOT or self.disk_slot(block) != NO_SLOT, "{!r} resides nowhere", block)
                if self.host_slot(block) != NO_SLOT:
                    check(self.host.pool.owners[self.host_slot(block)] is block, "{!r} slot owner mismatch", block)
                    host_resident += 1
                    host_bytes += state.block_bytes
                if self.disk_slot(block) != NO_SLOT:
                    check(disk is not None and disk.pool.owners[self.disk_slot(block)] is block, "{!r} disk owner mismatch", block)
                    # A durable block's whole prefix is durable (FORMAT.md).
                    check(block.parent is None or self.disk_slot(block.parent) != NO_SLOT, "{!r} durable, parent not", block)
                    disk_resident += 1
                    disk_bytes += state.block_bytes
                if block in self.loading:
                    check(block.ref_count > 0 and self.host_slot(block) != NO_SLOT, "loading {!r} unpinned", block)
                refs += block.ref_count
                pinned += block.ref_count > 0
                candidate = (
                    block.state == BlockState.SEALED
                    and block.ref_count == 0
                    and self.tiers.resident_children(block, self.host) == 0
                    and self.host_slot(block) != NO_SLOT
                )
                check(
                    (block in self.host.policy) == candidate,
                    '{!r} candidate={} but policy membership disagrees', block, candidate,
                )
                if candidate and self.disk_slot(block) == NO_SLOT:
                    # What host eviction drops must be droppable.
                    check(block.children == 0 or disk is not None, "dirty candidate {!r} has children", block)
        self.tiers.verify_children(resident_children)
        check(host_resident == self.host.pool.resident_blocks, "resident blocks disagree with free slots")
        self._verify_quotas()
        check(host_bytes == self.host.pool.used_bytes, "host used bytes drifted")
        if disk is not None:
            check(disk_bytes == disk.pool.used_bytes, "disk used bytes drifted")
            check(disk_resident == disk.pool.resident_blocks, "disk resident blocks disagree with its slots")
        check(pinned == self.pinned_blocks, "pinned count {} but {} pinned", self.pinned_blocks, pinned)
        check(refs == self.live_handles, "{} live handles but {} references", self.live_handles, refs)
        check(0 <= self.prefetch_in_flight <= len(self.loading), "{} prefetch loads in flight", self.prefetch_in_flight)
        prefetch = self.prefetch_counters
        check(prefetch.queued == prefetch.used + prefetch.wasted + len(self.prefetched),
              "every prefetched block is used, wasted, or still waiting for a Get")
        for block in self.prefetched:
            # A lost block being read still has its slot, until the read ends.
            check(self.host_slot(block) != NO_SLOT and (block.state == BlockState.SEALED or block in self.loading),
                  'prefetched {!r} not in host memory', block)
