"""WriteQueue: seal order kept, membership counted through requeues."""

from __future__ import annotations

from kvd.core.radix import PrefixIndex
from kvd.core.write_queue import WriteQueue


def test_membership_follows_appends_and_pops_of_a_block_queued_twice():
    index = PrefixIndex()
    a, b = index.insert(b"a" * 32, None), index.insert(b"b" * 32, None)
    queue = WriteQueue()
    for block in (a, b, a):  # a requeued behind b
        queue.append(block)
    assert list(queue) == [a, b, a] and queue[0] is a and len(queue) == 3 and a in queue
    assert queue.popleft() is a and a in queue  # its second place is still queued
    assert queue.popleft() is b and b not in queue
    assert queue.popleft() is a and a not in queue and not queue
    queue.verify()


def test_the_head_is_never_older_than_queued_since_says():
    """Marks bound the head's age from above: at each step, the head was queued at or after
    queued_since(), and the bound moves on as the head does (to within the marks' spacing)."""
    index = PrefixIndex()
    blocks = [index.insert(bytes([n]) * 32, None) for n in range(5)]
    queue = WriteQueue()
    assert queue.queued_since() is None
    queue.mark(0.0)
    queued_at = {}
    for now, block in ((1.0, blocks[0]), (2.0, blocks[1]), (3.0, blocks[2])):
        queue.append(block)
        queued_at[block] = now
        queue.mark(now + 0.5)
    assert queue.queued_since() == 0.0  # the head came after the mark at 0
    queue.mark(10.0)  # nothing new: the last mark moves, it bounds better
    queue.popleft()
    queue.mark(11.0)
    assert queue.queued_since() == 1.5 <= queued_at[queue[0]] + 0.5
    assert queued_at[queue[0]] >= queue.queued_since()
    queue.popleft()
    queue.popleft()
    queue.mark(12.0)
    assert queue.queued_since() is None  # empty
    queue.append(blocks[3])  # queued at 20, after a long quiet spell
    queue.mark(20.5)
    assert queue.queued_since() == 12.0  # not 0: quiet marks moved up
    queue.verify()
