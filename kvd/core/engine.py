"""The engine: the one owner of kvd's block state, as a facade over focused modules.

Everything that decides which block lives where is synchronous and lives
in kvd.core. The engine never touches payload bytes, never reads a clock
(callers pass `now_ms`) and never does I/O, so the daemon, the tests and
the simulator drive exactly the same code. Its parts, one job each:

| module | job |
|---|---|
| namespaces.py | cache identities, tenants' namespaces and quotas |
| requests.py | the request dataclasses (KeysRequest, CommitRequest), checks of client input, prefix matching |
| blocks.py | the block lifecycle: handles, sealing, removal, loss, residency moves |
| residency.py, slot_pool.py, tier.py | the tier stack: slots and where each block's copies are |
| eviction.py | host slots: allocation, tenant affinity, quota room, watermarks |
| component.py | what the request components below share (limits, namespaces, blocks, host slots, leases) |
| reads.py | Lookup and Get, with the reads from lower tiers a Get needs |
| prefetch.py, prefetch_ledger.py | reads ahead of a Get, and whether they paid |
| puts.py | reserve and commit |
| deletes.py | Delete, and a namespace's every block removed a step at a time |
| namespace_usage.py | a namespace's blocks and bytes per tier, counted a step at a time |
| writeback.py | which blocks are written to each lower tier next, into which slots |
| recovery.py | indexing what the disk held at start |
| events.py, event_snapshot.py | the KV event log, and snapshots of a namespace built a step at a time |
| verify.py | the invariants between all of the above |

Concurrency: the daemon calls the engine only from its event-loop thread
and never awaits in the middle of an engine call, so every call is atomic
with respect to every other; no locks exist to get wrong.

Errors: bad client input raises a `kvd.errors.KvdError` *before* any state
changes, so a rejected request never alters stored data. Inconsistent
internal state raises `InvariantError` and is never caught.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from kvd.core.block import Block, BlockHandle
from kvd.core.blocks import BlockLifecycle
from kvd.core.deletes import Deletes, NamespaceDeletion
from kvd.core.event_snapshot import SnapshotBuild
from kvd.core.events import EventLog
from kvd.core.eviction import TENANT_AFFINITY_WINDOW, HostAllocator
from kvd.core.keys import NamespaceSpec
from kvd.core.lease import Lease, LeaseTable
from kvd.core.limits import MAX_CLIENT_ID_CHARS, EngineLimits
from kvd.core.namespace_usage import UsageCount
from kvd.core.namespaces import NamespaceState, NamespaceTable, namespace_not_found
from kvd.core.policy import DiskPolicies, make_policy
from kvd.core.prefetch import PrefetchLimit, PrefetchPlan, Prefetcher
from kvd.core.prefetch_ledger import PrefetchCounters, PrefetchLedger
from kvd.core.puts import Committed, Puts, ReserveResult, ReserveStatus
from kvd.core.quota import TenantQuota
from kvd.core.reads import GetPlan, InPlace, Reads
from kvd.core.recovery import Recovery
from kvd.core.requests import CommitRequest, KeysRequest, check_client, granted_lease_ms
from kvd.core.residency import TierStack
from kvd.core.slot_pool import SlotPool, class_sizes
from kvd.core.tier import MemoryTier, StorageSpec, StorageTier, TierId
from kvd.core.verify import verify_blocks, verify_quotas
from kvd.core.transfer import Transfer
from kvd.core.writeback import WriteBack
from kvd.errors import InvalidArgument
from kvd.invariants import check

__all__ = [
    "MAX_CLIENT_ID_CHARS", "TENANT_AFFINITY_WINDOW", "CommitRequest", "Engine", "EngineLimits", "GetPlan",
    "Committed", "KeysRequest", "NamespaceState", "PrefetchCounters", "PrefetchLimit", "PrefetchPlan", "ReserveResult", "ReserveStatus",
    "StorageSpec", "TierId", "Transfer", "namespace_not_found",
]


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
        lower_tiers: Sequence[StorageSpec] = (),
        host_min_slot_bytes: int = 0,
        disk_min_slot_bytes: int = 0,
    ) -> None:
        """`lower_tiers`: tiers between host memory and the disk, fastest first.
        `host_min_slot_bytes`, `disk_min_slot_bytes`: carve the tier into slot
        classes down to this size (kvd.core.slot_pool); 0: one slot size."""
        self.limits = limits or EngineLimits()
        # Host memory first, at global slot id 0; then the tiers below, the disk last.
        classes = class_sizes(host_slot_bytes, host_min_slot_bytes) if host_min_slot_bytes else ()
        host_pool = SlotPool(host_slot_count, host_slot_bytes, class_bytes=classes)
        self.host = MemoryTier(TierId.HOST, host_pool, make_policy(policy, host_pool.slot_count), client_mappable=True,
                               high_watermark=high_watermark, low_watermark=low_watermark)
        specs = list(lower_tiers)
        if disk_slot_count:
            disk_classes = class_sizes(disk_slot_bytes, disk_min_slot_bytes) if disk_min_slot_bytes else ()
            specs.append(StorageSpec(TierId.DISK, disk_slot_count, disk_slot_bytes, True, disk_policies,
                                     class_bytes=disk_classes))
        lower: list[StorageTier] = []
        base = self.host.pool.end
        for spec in specs:
            lower.append(spec.build(base))
            base = lower[-1].pool.end
        self.events = events if events is not None else EventLog()
        self.leases = LeaseTable(self.limits.max_leases, self.limits.max_pins_per_client)
        self.blocks = BlockLifecycle(self.host, lower, self.events, PrefetchLedger(), write_queue_max)
        # The durable tier, if any (the disk).
        self.disk = self.blocks.disk
        self.namespace_table = NamespaceTable(self.limits, self.host, lower, tenant_quotas)
        self.allocator = HostAllocator(self.blocks)
        self.reads = Reads(self.limits, self.namespace_table, self.blocks, self.allocator, self.leases)
        self.prefetcher = Prefetcher(self.reads)
        self.puts = Puts(self.limits, self.namespace_table, self.blocks, self.allocator, self.leases)
        self.deletes = Deletes(self.limits, self.namespace_table, self.blocks, self.allocator, self.leases)
        self.writebacks = {tier: WriteBack(self.blocks, tier) for tier in lower}
        self.recovery = Recovery(self.namespace_table, self.blocks)

    # -- state the daemon, metrics and tests read ----------------------------

    @property
    def tiers(self) -> TierStack:
        return self.blocks.tiers

    @property
    def tenants(self) -> dict[str, TenantQuota]:
        return self.namespace_table.tenants

    @property
    def loading(self) -> set[Block]:
        return self.blocks.loading

    @property
    def write_queue(self):
        return self.blocks.write_queue

    @property
    def write_queue_dropped(self) -> int:
        return self.blocks.write_queue_dropped

    @property
    def prefetch_counters(self) -> PrefetchCounters:
        return self.blocks.ledger.counters

    @property
    def prefetch_in_flight(self) -> int:
        return self.prefetcher.in_flight

    @property
    def live_handles(self) -> int:
        return self.blocks.live_handles

    @property
    def leaked_handles(self) -> int:
        return self.blocks.leaked_handles

    @property
    def pinned_blocks(self) -> int:
        return self.blocks.pinned_blocks

    @property
    def claim_host_slot(self) -> Callable[[int, str], None] | None:
        """Per-tenant host memory: see HostAllocator (the daemon sets it)."""
        return self.allocator.claim_host_slot

    @claim_host_slot.setter
    def claim_host_slot(self, claim: Callable[[int, str], None] | None) -> None:
        self.allocator.claim_host_slot = claim

    @property
    def slot_tenants(self) -> list[str | None]:
        return self.allocator.slot_tenants

    @property
    def claim_failures(self) -> int:
        return self.allocator.claim_failures

    def host_slot(self, block: Block) -> int:
        return self.blocks.host_slot(block)

    def host_offsets(self, blocks: Sequence[Block]) -> list[int]:
        """Where each block's host copy starts in the host tier, in one call (what a Get hands
        out, what a read lands in); each must have a host slot."""
        slots = [self.blocks.host_slot(block) for block in blocks]
        check(min(slots, default=0) >= 0, "host offsets of {} blocks, some without a host slot", len(slots))
        return self.host.pool.offsets_of(slots)

    def load_offsets(self, loads: Sequence[Transfer]) -> list[int]:
        """Where in the host tier each load lands: a slot only its own block holds, while the
        engine knows it is being read (checked here, before the bytes are handed to a thread)."""
        loading = self.blocks.loading
        check(all(load.block in loading and self.blocks.host_slot(load.block) == load.target_slot for load in loads),
              "reads into host slots their blocks do not hold")
        return self.host.pool.offsets_of([load.target_slot for load in loads])

    def disk_slot(self, block: Block) -> int:
        return self.blocks.disk_slot(block)

    def tier_bytes(self, blocks: Sequence[Block]) -> bytes:
        return self.blocks.tier_bytes(blocks)

    def tier_of(self, block: Block) -> TierId:
        return self.blocks.tier_of(block)

    def event_snapshot(self, namespace_id: bytes, step_blocks: int) -> SnapshotBuild:
        """A snapshot of the blocks the namespace serves, built by repeated
        step() calls of `step_blocks` blocks each (kvd.core.event_snapshot);
        the caller closes it."""
        return SnapshotBuild(self.namespace(namespace_id).index, self.events, self.blocks.tier_bytes, step_blocks)

    # -- namespaces -------------------------------------------------------------

    def register_namespace(self, spec: NamespaceSpec) -> NamespaceState:
        return self.namespace_table.register(spec)

    def tenant_quota(self, tenant: str) -> TenantQuota:
        return self.namespace_table.tenant_quota(tenant)

    def tenant_namespace(self, tenant: str, public_id: bytes) -> NamespaceState:
        return self.namespace_table.tenant_namespace(tenant, public_id)

    def enable_disk(self, namespace_id: bytes) -> None:
        self.namespace_table.enable_disk(namespace_id)

    def namespace(self, namespace_id: bytes) -> NamespaceState:
        return self.namespace_table.namespace(namespace_id)

    def namespaces(self) -> list[NamespaceState]:
        return self.namespace_table.namespaces()

    def namespace_usage(self, namespace_id: bytes) -> UsageCount:
        """The namespace's blocks and bytes in each tier, counted by the count's step() calls
        (kvd.core.namespace_usage)."""
        return UsageCount(self.namespace(namespace_id).index, self.tiers)

    # -- Lookup, Get, Prefetch (kvd.core.reads, kvd.core.prefetch) ---------------

    def lookup(self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes = b"") -> list[Block]:
        return self.reads.lookup(namespace_id, keys, parent_key)

    def stored(self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes = b"") -> list[Block]:
        return self.reads.stored(namespace_id, keys, parent_key)

    def chain_to(self, namespace_id: bytes, key: bytes) -> list[bytes]:
        return self.reads.chain_to(namespace_id, key)

    def begin_get(self, request: KeysRequest) -> GetPlan:
        return self.reads.begin_get(request)

    def pin_in_place(self, request: KeysRequest) -> InPlace:
        return self.reads.pin_in_place(request)

    def finish_loads(self, loads: Sequence[Transfer], ok: Sequence[bool]) -> None:
        self.reads.finish_loads(loads, ok)

    def abandon_get(self, plan: GetPlan) -> None:
        self.reads.abandon_get(plan)

    def drop_get(self, plan: GetPlan) -> None:
        self.reads.drop_get(plan)

    def give_up_loads(self, loads: Sequence[Transfer]) -> None:
        self.reads.give_up_loads(loads)

    def settle_get(self, plan: GetPlan) -> list[Block]:
        return self.reads.settle_get(plan)

    def begin_prefetch(self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes = b"",
                       max_in_flight: int = 0) -> PrefetchPlan:
        return self.prefetcher.begin(namespace_id, keys, parent_key, max_in_flight)

    def finish_prefetch(self, loads: Sequence[Transfer], ok: Sequence[bool]) -> None:
        self.prefetcher.finish(loads, ok)

    def abandon_prefetch(self, loads: Sequence[Transfer]) -> None:
        self.prefetcher.abandon(loads)

    # -- Put (kvd.core.puts) --------------------------------------------------------

    def reserve(self, request: KeysRequest) -> ReserveResult:
        return self.puts.reserve(request)

    def commit(self, request: CommitRequest) -> Committed:
        return self.puts.commit(request)

    def seal_prefix(self, lease: Lease, count: int, now_ms: int) -> int:
        return self.puts.seal_prefix(lease, count, now_ms)

    # -- the tiers below host memory (kvd.core.writeback, kvd.core.recovery) ------

    @property
    def lower_tiers(self) -> list[StorageTier]:
        return self.blocks.lower

    def pick_writes(self, limit: int, tier: StorageTier | None = None) -> list[Transfer]:
        """The next writes to `tier` (default: the durable tier)."""
        tier = tier or self.disk
        return [] if tier is None else self.writebacks[tier].pick_writes(limit)

    def writes_cut_short(self, tier: StorageTier | None = None) -> bool:
        """Whether the last pick_writes for `tier` (default: the durable tier)
        stopped because its slot searches used up the turn's budget before
        they could tell: the writer's next turn should come at once."""
        tier = tier or self.disk
        return tier is not None and self.writebacks[tier].cut_short

    def finish_writes(self, writes: Sequence[Transfer], ok: Sequence[bool]) -> None:
        if writes:
            self.writebacks[writes[0].target].finish_writes(writes, ok)

    def write_queue_of(self, tier: StorageTier):
        return self.blocks.write_queues[tier]

    def take_removals(self, tier: StorageTier) -> list[tuple[bytes, bytes, int]]:
        """(namespace id, key, slot) of `tier`'s freed slots whose REMOVE must be journalled."""
        return self.writebacks[tier].take_removals()

    def removals_journalled(self, tier: StorageTier, slots: Sequence[int]) -> None:
        self.writebacks[tier].removals_journalled(slots)

    def take_disk_removals(self) -> list[tuple[bytes, bytes, int]]:
        return [] if self.disk is None else self.take_removals(self.disk)

    def disk_removals_journalled(self, slots: Sequence[int]) -> None:
        self.removals_journalled(self.disk, slots)

    def require_durable(self, blocks: Iterable[Block]) -> None:
        if self.disk is not None:
            self.writebacks[self.disk].require_durable(blocks)

    def recover(self, namespace_id: bytes, records: Iterable[tuple[bytes, bytes, int]]) -> int:
        return self.recovery.recover(namespace_id, records)

    def retire_disk_pages(self, pages: Sequence[int]) -> None:
        self.recovery.retire_disk_pages(pages)

    def host_reclaiming(self) -> bool:
        return self.allocator.reclaim_due()

    def demote_to_low_watermark(self, limit: int | None = None) -> int:
        return self.allocator.demote_to_low_watermark(limit)

    def host_candidates(self) -> list[Block]:
        """Every host eviction candidate now, next victim first (for `demote`)."""
        return self.host.policy.order()

    def demote(self, candidates: Sequence[Block], *, chains: bool = True) -> tuple[int, int]:
        return self.allocator.demote(candidates, chains=chains)

    # -- leases, Delete, in-process handles ----------------------------------------

    def release(self, client_id: str, lease_ids: Sequence[int]) -> int:
        check_client(client_id)
        if len(lease_ids) > self.limits.max_batch_keys:
            raise InvalidArgument(f"at most {self.limits.max_batch_keys} lease ids per call")
        leases = [self.leases.find(lease_id, client_id) for lease_id in lease_ids]
        if len({lease.lease_id for lease in leases}) != len(leases):
            raise InvalidArgument("lease_ids contain duplicates")
        for lease in leases:
            self.leases.close(lease)
        return len(leases)

    def renew(self, client_id: str, lease_id: int, lease_ms: int, now_ms: int) -> int:
        check_client(client_id)
        deadline_ms = now_ms + granted_lease_ms(self.limits, lease_ms)
        self.expire(now_ms)
        lease = self.leases.find(lease_id, client_id)
        self.leases.renew(lease, deadline_ms)
        return deadline_ms

    def delete(self, namespace_id: bytes, keys: Sequence[bytes]) -> tuple[int, int]:
        """Remove blocks and their descendants. Returns (deleted, pinned)."""
        return self.deletes.delete(namespace_id, keys)

    def delete_namespace(self, namespace_id: bytes) -> NamespaceDeletion:
        """Every block of the namespace, removed by the deletion's step() calls (kvd.core.deletes)."""
        return self.deletes.delete_namespace(namespace_id)

    def expire(self, now_ms: int) -> int:
        return len(self.leases.expire(now_ms))

    def close_all_leases(self) -> int:
        return self.leases.close_all()

    def pin(self, block: Block) -> BlockHandle:
        """A read handle on one sealed block (e.g. while a Put waits for its disk copy)."""
        return self.blocks.acquire(block)

    def verify(self) -> None:
        """Check every structure and every invariant between them (tests call this after each step)."""
        self.tiers.verify()
        self.allocator.verify()
        for writeback in self.writebacks.values():
            writeback.verify()
        self.leases.verify()
        self.events.verify()
        self.namespace_table.verify()
        verify_blocks(self.blocks, self.namespace_table.namespaces(), self.prefetcher.in_flight)
        verify_quotas(self.blocks, self.tenants)
