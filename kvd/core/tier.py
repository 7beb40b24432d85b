"""A tier's bookkeeping: its slot pool, what it can do, its policies, its counters.

kvd keeps blocks in an ordered stack of tiers, fastest first (device HBM,
host memory, local disk; the remote tier of other nodes beside the disk).
The core sees each as a `Tier`: a `SlotPool`, declared capabilities, and
the policies of its kind:

* `MemoryTier` (host; device later): volatile, byte-addressable; an
  intrusive eviction policy over the blocks that are candidates
  (kvd.core.policy: sealed, unpinned, no child resident in the tier), and
  watermarks between which the tier is reclaimed ahead of need;
* `StorageTier` (disk): persistent; victim selection over its slot array
  (no per-block links, so the index stays small however large the drives),
  an admission filter (which blocks are written at all) and a promotion
  policy (whether a hit comes up into memory).

Where a block's copies are is the residency stack's business
(kvd.core.residency), not the tier's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvd.core.policy import DiskPolicies, EvictionPolicy, make_promotion, make_slot_policy
from kvd.core.policy.admission import AdmissionFilter
from kvd.core.slot_pool import SlotPool
from kvd.invariants import check


class TierId(enum.IntEnum):
    """Values match kvd.v1.Tier."""

    DEVICE = 1
    HOST = 2
    DISK = 3
    REMOTE = 4


@dataclass(frozen=True, slots=True)
class Capabilities:
    # Survives a restart: freed slots wait for a durable REMOVE record.
    persistent: bool
    # Clients map its slots (the arena): Puts land here and Gets are served from here.
    client_mappable: bool
    # Holds a copy of what it hands up (a disk block read into memory stays on disk).
    inclusive: bool


@dataclass(slots=True)
class TierCounters:
    """What happened in one tier; a counter that does not apply stays 0."""

    # Get keys found resident here, and not (for host memory: page faults).
    hits: int = 0
    misses: int = 0
    # On demand: a slot was needed and none was free.
    evictions: int = 0
    # Victims with no copy in any other tier: gone for good.
    dropped: int = 0
    # Memory tiers: copies dropped because a slower tier holds the block,
    # and of those, the ones dropped ahead of need (above the high watermark)
    # and the ones an operator's Demote dropped.
    demotions: int = 0
    background_demotions: int = 0
    requested_demotions: int = 0
    # The Put protocol, counted where Puts land.
    reserved: int = 0
    sealed: int = 0
    aborted: int = 0
    deleted: int = 0
    # Storage tiers: blocks written here and read back up, and failures.
    written: int = 0
    write_failures: int = 0
    loaded: int = 0
    load_failures: int = 0
    recovered: int = 0
    recovery_dropped: int = 0
    # Dirty blocks a memory tier dropped because this tier's admission
    # filter never let them be written.
    admission_rejected: int = 0


@dataclass(frozen=True, slots=True)
class StorageSpec:
    """A tier below host memory, before its slot ids are placed in the stack."""

    tier_id: TierId
    slot_count: int
    slot_bytes: int
    persistent: bool = False
    policies: DiskPolicies | None = None
    name: str = ""
    # Slot size classes (kvd.core.slot_pool): sizes that divide slot_bytes; none: one size.
    class_bytes: tuple[int, ...] = ()

    def build(self, base: int) -> StorageTier:
        pool = SlotPool(self.slot_count, self.slot_bytes, base=base, persistent=self.persistent,
                        class_bytes=self.class_bytes)
        return StorageTier(self.tier_id, pool, self.policies, name=self.name)


class Tier:
    """One tier of the stack: a slot pool and what kind of tier it is."""

    def __init__(self, tier_id: TierId, caps: Capabilities, pool: SlotPool, name: str = "") -> None:
        check(pool.persistent == caps.persistent, "a tier's pool and capabilities disagree on persistence")
        self.tier_id = tier_id
        self.name = name or tier_id.name.lower()
        self.caps = caps
        self.pool = pool
        self.counters = TierCounters()
        # Position in the stack, fastest first (set by TierStack).
        self.rank = -1

    @property
    def slot_bytes(self) -> int:
        return self.pool.slot_bytes

    @property
    def slot_count(self) -> int:
        return self.pool.slot_count

    def verify(self) -> None:
        self.pool.verify()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name}, rank={self.rank}, slots={self.pool.slot_count})"


class MemoryTier(Tier):
    """A volatile tier with an intrusive eviction policy and watermarks."""

    def __init__(self, tier_id: TierId, pool: SlotPool, policy: EvictionPolicy, *, client_mappable: bool,
                 high_watermark: float = 0.9, low_watermark: float = 0.8) -> None:
        super().__init__(tier_id, Capabilities(persistent=False, client_mappable=client_mappable, inclusive=False),
                         pool)
        check(0.0 < low_watermark < high_watermark <= 1.0, "watermarks need 0 < low < high <= 1")
        self.policy = policy
        # Reclaim (write back, then demote) from when occupancy reaches the
        # high watermark until it is back at the low one. Occupancy counts
        # slots, or, with slot classes, the bytes of the slots in use.
        self.in_bytes = len(pool.classes) > 1
        total = pool.page_count * pool.page_bytes if self.in_bytes else pool.slot_count
        self.high_slots = max(1, int(total * high_watermark))
        self.low_slots = min(self.high_slots - 1, int(total * low_watermark)) if self.high_slots > 1 else 0
        self.reclaiming = False

    def occupancy(self) -> int:
        """What the watermarks measure: resident blocks, or with slot classes the bytes of their slots."""
        return self.pool.owned_bytes if self.in_bytes else self.pool.resident_blocks

    def above_low(self) -> bool:
        return self.occupancy() > self.low_slots

    def reclaim_due(self) -> bool:
        """Hysteresis between the watermarks: True from the high one until back at the low one."""
        occupancy = self.occupancy()
        if occupancy >= self.high_slots:
            self.reclaiming = True
        elif occupancy <= self.low_slots:
            self.reclaiming = False
        return self.reclaiming

    def verify(self) -> None:
        super().verify()
        self.policy.verify()


class StorageTier(Tier):
    """A tier below host memory: slot-array eviction, admission and promotion policies.

    Persistent (the disk: its pool quarantines freed slots until their
    REMOVE is journalled) or volatile (a memory tier between host and
    disk; the remote tier of other nodes later). Inclusive either way: a
    block read up from it keeps its copy here.
    """

    def __init__(self, tier_id: TierId, pool: SlotPool, policies: DiskPolicies | None = None, *,
                 name: str = "") -> None:
        super().__init__(tier_id, Capabilities(persistent=pool.persistent, client_mappable=False, inclusive=True),
                         pool, name)
        policies = policies or DiskPolicies()
        self.eviction = make_slot_policy(policies.eviction, pool.slot_count)
        self.admission = AdmissionFilter.for_slots(policies.admission_min_hits, pool.slot_count)
        self.promotion = make_promotion(policies.promotion)

    def verify(self) -> None:
        super().verify()
        self.eviction.verify()
        self.admission.verify()
