"""Tiering policies: mechanism is in the engine and the pools, policy here.

One module per policy, chosen per tier in the config:

| config | interface | modules |
|---|---|---|
| host.policy | `EvictionPolicy`: which host candidate gives up its slot | lru.py, s3fifo.py |
| disk.policy | `SlotEvictionPolicy`: which disk slot is reused | clock.py |
| disk.admission_min_hits | `AdmissionFilter`: which blocks are written to disk | admission.py |
| disk.promotion | `PromotionPolicy`: whether a Get's disk hit comes into host memory | promotion.py |

Host eviction: a tier tells its policy when a block becomes an eviction
candidate (`admit`), when it stops being one (`remove`), and when a
candidate is used (`touch`); the tier asks `victim()` when it needs a slot
and evicts that block at once. A block is a candidate exactly while it is
sealed, unpinned (ref_count 0), resident, and without a child resident in
the tier: prefixes are evicted from the tail inward, so whatever stays
cached is still reachable by a prefix match.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from kvd.core.block import Block

if TYPE_CHECKING:
    from kvd.core.policy.promotion import PromotionPolicy


class EvictionPolicy(Protocol):
    name: str

    def admit(self, block: Block, *, cold: bool = False) -> None:
        """Make `block` a candidate; `cold` places it next in line."""
        ...

    def remove(self, block: Block) -> None:
        """`block` is no longer a candidate (evicted, pinned, got a child, or gone)."""
        ...

    def touch(self, block: Block) -> None:
        """A candidate was used."""
        ...

    def victim(self) -> Block | None:
        """The next candidate to evict, without removing it; None if none."""
        ...

    def victim_near(self, prefer: Callable[[Block], bool], window: int, weight: Callable[[Block], int]) -> Block | None:
        """victim(), or a candidate that `prefer`s among those evicted in the
        next `window` blocks (a candidate counts `weight(candidate)`: the
        blocks that follow it out), which is then evicted as the victim
        would be."""
        ...

    def order(self) -> list[Block]:
        """Every candidate (for tests, snapshots and Engine.host_candidates, which Demote works through)."""
        ...

    def __contains__(self, block: Block) -> bool: ...

    def __len__(self) -> int: ...

    def verify(self) -> None: ...


@dataclass(slots=True)
class ScanBudget:
    """How many more slots victim searches may look at (the writer gives each
    turn one, so no turn's searches grow with the tier's size)."""

    left: int


class SlotEvictionPolicy(Protocol):
    """Victim selection over a tier's slot array (no per-block links)."""

    name: str

    def touch(self, slot: int) -> None:
        """The block in `slot` was read or written."""
        ...

    def victim(
        self, owners: Sequence[Block | None], busy: Container[int], evictable: Callable[[Block], bool],
        budget: ScanBudget,
    ) -> Block | None:
        """A block to evict: owns a slot not in `busy` and is `evictable`.

        None if none was found among the slots looked at: every slot, or
        as many as `budget` still allowed (each look takes one from it),
        in which case the next search goes on where this one stopped.
        """
        ...

    def verify(self) -> None: ...


@dataclass(frozen=True, slots=True)
class DiskPolicies:
    """The disk tier's policies (config: disk.policy, disk.admission_min_hits, disk.promotion)."""

    eviction: str = "clock"
    # Write a block to disk once it has been seen this many times; 1: all.
    admission_min_hits: int = 1
    promotion: str = "always"


T = TypeVar("T")


def _choose(kind: str, name: str, factories: dict[str, Callable[[], T]]) -> T:
    if name not in factories:
        raise ValueError(f"unknown {kind} policy {name!r} (known: {', '.join(sorted(factories))})")
    return factories[name]()


def make_policy(name: str, slot_count: int = 1024) -> EvictionPolicy:
    """The host eviction policy `name` for a tier of `slot_count` slots."""
    from kvd.core.policy.lru import LruPolicy
    from kvd.core.policy.s3fifo import S3FifoPolicy

    return _choose("eviction", name, {"lru": LruPolicy, "s3fifo": lambda: S3FifoPolicy(slot_count)})


def make_slot_policy(name: str, slot_count: int) -> SlotEvictionPolicy:
    from kvd.core.policy.clock import ClockPolicy

    return _choose("disk eviction", name, {"clock": lambda: ClockPolicy(slot_count)})


def make_promotion(name: str) -> PromotionPolicy:
    from kvd.core.policy.promotion import AlwaysPromote

    return _choose("promotion", name, {"always": AlwaysPromote})
