"""Eviction policies: which unpinned block gives up its slot next.

Mechanism is separate from policy. A tier tells its policy when a block
becomes an eviction candidate (`admit`), when it stops being one (`remove`),
and when a candidate is used (`touch`); the tier asks `victim()` when it
needs a slot. A block is a candidate exactly while it is sealed, unpinned
(ref_count 0), a leaf of the prefix index (no children) and resident in the
tier: prefixes are evicted from the tail inward, so whatever stays cached is
still reachable by a prefix match.
"""

from __future__ import annotations

from typing import Protocol

from kvd.core.block import Block


class EvictionPolicy(Protocol):
    name: str

    def admit(self, block: Block, *, cold: bool = False) -> None:
        """Make `block` a candidate; `cold` places it next in line."""
        ...

    def remove(self, block: Block) -> None:
        """`block` is no longer a candidate (pinned, got a child, or gone)."""
        ...

    def touch(self, block: Block) -> None:
        """A candidate was used."""
        ...

    def victim(self) -> Block | None:
        """The next candidate to evict, without removing it; None if none."""
        ...

    def __contains__(self, block: Block) -> bool: ...

    def __len__(self) -> int: ...

    def verify(self) -> None: ...


def make_policy(name: str) -> EvictionPolicy:
    from kvd.core.policy.lru import LruPolicy

    policies = {"lru": LruPolicy}
    if name not in policies:
        raise ValueError(f"unknown eviction policy {name!r} (known: {', '.join(sorted(policies))})")
    return policies[name]()
