"""Slot bookkeeping of the disk tier (the bytes live in kvd.tiers.disk).

Slots are numbered so that consecutive numbers stripe over the drives
(kvd/tiers/disk/FORMAT.md); `free_slots` hands them out lowest first.

The pool also holds the disk tier's policies (kvd.core.policy): victim
selection over the slot array (`eviction`, CLOCK by default: one byte per
slot and no per-block links, so the index stays small however large the
drives are), the admission filter that decides which blocks are written at
all, and whether a disk hit is promoted into host memory.

A freed slot is not reusable at once: the manifest still has the PUT of its
previous block. It waits in `quarantine` until the daemon has made a REMOVE
record for it durable (`confirm_removals`), so a replay after a crash can
never pair an old record with new bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvd.core.block import Block
from kvd.core.policy import DiskPolicies, make_promotion, make_slot_policy
from kvd.core.policy.admission import AdmissionFilter
from kvd.invariants import check


@dataclass(slots=True)
class DiskCounters:
    written: int = 0
    write_failures: int = 0
    loaded: int = 0
    load_failures: int = 0
    evictions: int = 0
    recovered: int = 0
    recovery_dropped: int = 0
    # Dirty blocks dropped by host eviction because the admission filter
    # never let them be written.
    admission_rejected: int = 0
    # Of `evictions`: victims with no host copy, gone from every tier (the
    # others keep serving from host memory).
    dropped: int = 0
    # Get keys the host tier lacked that were found here (read back into
    # host memory), and that were found in no tier.
    hits: int = 0
    misses: int = 0


class DiskPool:
    def __init__(self, slot_count: int, slot_bytes: int, policies: DiskPolicies | None = None) -> None:
        check(slot_count > 0 and slot_bytes > 0, "disk pool needs slots")
        policies = policies or DiskPolicies()
        self.slot_count = slot_count
        self.slot_bytes = slot_bytes
        self.free_slots: list[int] = list(range(slot_count - 1, -1, -1))
        self.owners: list[Block | None] = [None] * slot_count
        self.eviction = make_slot_policy(policies.eviction, slot_count)
        self.admission = AdmissionFilter.for_slots(policies.admission_min_hits, slot_count)
        self.promotion = make_promotion(policies.promotion)
        # Slots whose block is being written (owner set, block.disk_slot not yet).
        self.writing: set[int] = set()
        # (namespace id, key, slot) freed but not yet journalled as removed.
        self.removals: list[tuple[bytes, bytes, int]] = []
        self.quarantine: set[int] = set()
        # Slots of drives out of service (their metadata could not be read
        # at start): never handed out, never owned.
        self.retired: set[int] = set()
        self.used_bytes = 0
        self.counters = DiskCounters()

    @property
    def capacity_bytes(self) -> int:
        """What the drives in service can hold (retired slots count for nothing)."""
        return (self.slot_count - len(self.retired)) * self.slot_bytes

    @property
    def resident_blocks(self) -> int:
        return self.slot_count - len(self.free_slots) - len(self.quarantine) - len(self.writing) - len(self.retired)

    def retire(self, slots: list[int]) -> None:
        """Take free slots out of service for good (a quarantined drive's)."""
        retired = set(slots)
        check(all(self.owners[slot] is None and slot not in self.quarantine for slot in retired),
              "retiring a disk slot in use")
        self.retired |= retired
        self.free_slots = [slot for slot in self.free_slots if slot not in self.retired]

    def take_free(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def touch(self, slot: int) -> None:
        self.eviction.touch(slot)

    def victim(self, evictable: Callable[[Block], bool]) -> Block | None:
        """The next block to evict (none being written), or None if no block may go."""
        return self.eviction.victim(self.owners, self.writing, evictable)

    def confirm_removals(self, slots: list[int]) -> None:
        """The REMOVE records of these slots are durable: they may be reused."""
        for slot in slots:
            if slot in self.quarantine:
                self.quarantine.discard(slot)
                self.free_slots.append(slot)
            else:
                # Taken straight over by a new write after its eviction.
                check(self.owners[slot] is not None, f"disk slot {slot} was not awaiting removal")

    def verify(self) -> None:
        self.eviction.verify()
        self.admission.verify()
        free = set(self.free_slots)
        check(len(free) == len(self.free_slots), "disk slot listed free twice")
        check(not (free & self.quarantine), "disk slot both free and quarantined")
        check(not (self.retired & (free | self.quarantine | self.writing)), "a retired disk slot is in use")
        check(all(self.owners[slot] is None for slot in self.retired), "a retired disk slot has an owner")
        for slot in free | self.quarantine:
            check(self.owners[slot] is None, "free disk slot {} has an owner", slot)
        for slot in self.writing:
            check(self.owners[slot] is not None, "disk slot {} written for nobody", slot)
        for slot, owner in enumerate(self.owners):
            if owner is not None and slot not in self.writing:
                check(owner.disk_slot == slot, "{!r} does not know its disk slot {}", owner, slot)
