"""An intrusive doubly linked list of blocks, shared by the list-based policies.

The links live in the blocks (`Block.policy_prev` / `policy_next`), so
linking and unlinking allocate nothing and cost O(1). A block has one pair
of links, so it is in at most one list at a time; the policy that owns the
lists knows which.

    head -> [a] <-> [b] <-> ... <-> [z] <- tail
"""

from __future__ import annotations

from collections.abc import Iterator

from kvd.core.block import Block
from kvd.invariants import check


class BlockList:
    __slots__ = ("head", "length", "tail")

    def __init__(self) -> None:
        self.head: Block | None = None
        self.tail: Block | None = None
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def push_tail(self, block: Block) -> None:
        self._link(block, self.tail, None)

    def push_head(self, block: Block) -> None:
        self._link(block, None, self.head)

    def _link(self, block: Block, previous: Block | None, following: Block | None) -> None:
        block.policy_prev, block.policy_next = previous, following
        if previous is None:
            self.head = block
        else:
            previous.policy_next = block
        if following is None:
            self.tail = block
        else:
            following.policy_prev = block
        self.length += 1

    def unlink(self, block: Block) -> None:
        """Take out `block`, which the caller knows is in this list."""
        previous, following = block.policy_prev, block.policy_next
        if previous is None:
            check(self.head is block, "unlink of a block that heads no list")
            self.head = following
        else:
            previous.policy_next = following
        if following is None:
            self.tail = previous
        else:
            following.policy_prev = previous
        block.policy_prev = block.policy_next = None
        self.length -= 1

    def __iter__(self) -> Iterator[Block]:
        node = self.head
        while node is not None:
            yield node
            node = node.policy_next

    def verify(self, name: str) -> list[Block]:
        """Check the links and the count; returns the blocks, head first."""
        blocks = []
        previous = None
        node = self.head
        while node is not None:
            check(node.policy_prev is previous, "broken back link in {} list", name)
            blocks.append(node)
            check(len(blocks) <= self.length, "{} list longer than its count (cycle?)", name)
            previous = node
            node = node.policy_next
        check(previous is self.tail, "{} tail does not end the list", name)
        check(len(blocks) == self.length, "{} count {} but {} linked", name, self.length, len(blocks))
        return blocks
