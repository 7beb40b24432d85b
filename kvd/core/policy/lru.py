"""Least-recently-used eviction over an intrusive doubly linked list.

The links live in the blocks themselves (`policy_prev` / `policy_next`, see
`links.BlockList`), so admitting, touching and evicting allocate nothing and
cost O(1). Order comes from list position, not from clocks: the head is the
next victim, the tail the most recently used.

    head -> [oldest] <-> [..] <-> [newest] <- tail
"""

from __future__ import annotations

from collections.abc import Callable

from kvd.core.block import Block
from kvd.core.policy.links import BlockList
from kvd.invariants import check


class LruPolicy:
    name = "lru"

    def __init__(self) -> None:
        self._list = BlockList()

    def __len__(self) -> int:
        return self._list.length

    def __contains__(self, block: Block) -> bool:
        return block.policy_prev is not None or block.policy_next is not None or self._list.head is block

    def admit(self, block: Block, *, cold: bool = False) -> None:
        check(block not in self, "block admitted twice")
        if cold:
            self._list.push_head(block)
        else:
            self._list.push_tail(block)

    def remove(self, block: Block) -> None:
        check(block in self, "removal of a block that is not a candidate")
        self._list.unlink(block)

    def touch(self, block: Block) -> None:
        if self._list.tail is block:
            return
        self.remove(block)
        self._list.push_tail(block)

    def victim(self) -> Block | None:
        return self._list.head

    def victim_near(self, prefer: Callable[[Block], bool], window: int, weight: Callable[[Block], int]) -> Block | None:
        block = self._list.head
        while block is not None and window > 0:
            if prefer(block):
                return block
            window -= weight(block)
            block = block.policy_next
        return self._list.head

    def order(self) -> list[Block]:
        """Candidates from next victim to most recently used (for tests)."""
        return list(self._list)

    def verify(self) -> None:
        self._list.verify("LRU")
