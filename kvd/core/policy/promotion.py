"""Promotion: whether a Get's disk hit is brought into host memory.

A block that is only on disk can be served only from a host slot, so a
policy that declines a promotion cuts the Get's prefix before that block
(the client recomputes the rest, as after a miss). Asked once per block a
Get would read from disk, before a host slot is taken for it (which may
evict). Only "always" exists today; a policy that declines under host
pressure, or promotes only blocks seen often, fits the same interface.
"""

from __future__ import annotations

from typing import Protocol

from kvd.core.block import Block


class PromotionPolicy(Protocol):
    name: str

    def promote(self, block: Block) -> bool:
        """Whether `block`, only on disk, is read into a host slot for a Get."""
        ...


class AlwaysPromote:
    name = "always"

    def promote(self, block: Block) -> bool:
        return True
