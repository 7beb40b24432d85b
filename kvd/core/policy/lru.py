"""Least-recently-used eviction over an intrusive doubly linked list.

The links live in the blocks themselves (`policy_prev` / `policy_next`), so
admitting, touching and evicting allocate nothing and cost O(1). Order comes
from list position, not from clocks: the head is the next victim, the tail
the most recently used.

    head -> [oldest] <-> [..] <-> [newest] <- tail
"""

from __future__ import annotations

from kvd.core.block import Block
from kvd.invariants import check


class LruPolicy:
    name = "lru"

    def __init__(self) -> None:
        self._head: Block | None = None
        self._tail: Block | None = None
        self._length = 0

    def __len__(self) -> int:
        return self._length

    def __contains__(self, block: Block) -> bool:
        return block.policy_prev is not None or block.policy_next is not None or self._head is block

    def admit(self, block: Block, *, cold: bool = False) -> None:
        check(block not in self, "block admitted twice")
        if self._head is None:
            self._head = self._tail = block
        elif cold:
            block.policy_next = self._head
            self._head.policy_prev = block
            self._head = block
        else:
            tail = self._tail
            assert tail is not None
            tail.policy_next = block
            block.policy_prev = tail
            self._tail = block
        self._length += 1

    def remove(self, block: Block) -> None:
        check(block in self, "removal of a block that is not a candidate")
        previous, following = block.policy_prev, block.policy_next
        if previous is None:
            self._head = following
        else:
            previous.policy_next = following
        if following is None:
            self._tail = previous
        else:
            following.policy_prev = previous
        block.policy_prev = block.policy_next = None
        self._length -= 1

    def touch(self, block: Block) -> None:
        if self._tail is block:
            return
        self.remove(block)
        self.admit(block)

    def victim(self) -> Block | None:
        return self._head

    def order(self) -> list[Block]:
        """Candidates from next victim to most recently used (for tests)."""
        blocks = []
        node = self._head
        while node is not None:
            blocks.append(node)
            node = node.policy_next
        return blocks

    def verify(self) -> None:
        count = 0
        previous = None
        node = self._head
        while node is not None:
            check(node.policy_prev is previous, "broken back link in LRU list")
            previous = node
            node = node.policy_next
            count += 1
            check(count <= self._length, "LRU list longer than its count (cycle?)")
        check(previous is self._tail, "LRU tail does not end the list")
        check(count == self._length, f"LRU count {self._length} but {count} linked")
