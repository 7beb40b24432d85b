"""A write-back queue: blocks in seal order, with membership in O(1).

A block may stand in the queue more than once (requeued behind a parent
that had to be written first; the copy further ahead is skipped when it
comes up), so membership is a count per block, kept as the queue changes.
Asking whether a block is queued then costs a dict probe, not a set built
from the whole queue per call (issue 35 item 7).

How long the head has waited: the core reads no clock, so the driver
marks the queue now and then with its own time (`mark`); a mark says "the
first n blocks ever queued were queued by t". The head was queued after
the last mark that does not cover it, so `queued_since` (that mark's
time) bounds its age from above, to within the marks' spacing, in O(1)
memory per mark and without a time per block.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from kvd.core.block import Block
from kvd.invariants import check


class WriteQueue:
    __slots__ = ("_blocks", "_counts", "_appended", "_popped", "_marks")

    def __init__(self) -> None:
        self._blocks: deque[Block] = deque()
        self._counts: dict[Block, int] = {}
        # Blocks ever appended and popped; (appended, time) marks, oldest first.
        self._appended = 0
        self._popped = 0
        self._marks: deque[tuple[int, float]] = deque()

    def append(self, block: Block) -> None:
        self._blocks.append(block)
        self._counts[block] = self._counts.get(block, 0) + 1
        self._appended += 1

    def mark(self, now: float) -> None:
        """Every block queued so far was queued by `now` (the driver's clock)."""
        marks = self._marks
        if marks and marks[-1][0] == self._appended:
            marks[-1] = (self._appended, now)  # nothing new since: the later time bounds better
        else:
            marks.append((self._appended, now))
        while len(marks) > 1 and marks[1][0] <= self._popped:
            marks.popleft()  # a later mark still precedes the head

    def queued_since(self) -> float | None:
        """A time (the driver's clock) before which the oldest queued block
        was not queued; None when the queue is empty or was never marked."""
        if not self._blocks or not self._marks:
            return None
        return self._marks[0][1]

    def popleft(self) -> Block:
        block = self._blocks.popleft()
        self._popped += 1
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
        check(sum(self._counts.values()) == len(self._blocks) == self._appended - self._popped,
              "the write queue's counts disagree with it")
        marks = list(self._marks)
        check(all(a[0] < b[0] <= self._appended and a[1] <= b[1] for a, b in zip(marks, marks[1:])),
              "the write queue's marks are out of order")
