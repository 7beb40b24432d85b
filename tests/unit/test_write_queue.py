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
