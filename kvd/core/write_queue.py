"""A write-back queue: blocks in seal order, with membership in O(1).

A block may stand in the queue more than once (requeued behind a parent
that had to be written first; the copy further ahead is skipped when it
comes up), so membership is a count per block, kept as the queue changes.
Asking whether a block is queued then costs a dict probe, not a set built
from the whole queue per call (issue 35 item 7).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvd.core.block import Block
from kvd.invariants import check


class WriteQueue:
    __slots__ = ("_blocks", "_counts")

    def __init__(self) -> None:
        self._blocks: deque[Block] = deque()
        self._counts: dict[Block, int] = {}

    def append(self, block: Block) -> None:
        self._blocks.append(block)
        self._counts[block] = self._counts.get(block, 0) + 1

    def popleft(self) -> Block:
        block = self._blocks.popleft()
        left = self._counts[block] - 1
        if left:
            self._counts[block] = left
        else:
            del self._counts[block]
        return block

    def __contains__(self, block: object) -> bool:
        return block in self._counts

    def __getitem__(self, position: int) -> Block:
        return self._blocks[position]

    def __len__(self) -> int:
        return len(self._blocks)

    def __bool__(self) -> bool:
        return bool(self._blocks)

    def __iter__(self) -> Iterator[Block]:
        return iter(self._blocks)

    def verify(self) -> None:
        check(sum(self._counts.values()) == len(self._blocks), "the write queue's counts disagree with it")
