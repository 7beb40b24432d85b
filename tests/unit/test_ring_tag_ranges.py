"""The grant tags a pool's I/O ring hands to its loads: contiguous ranges, first fit, merged back."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.invariants import InvariantError
from kvd.planes.device_ring import TagRanges


def test_ranges_are_taken_first_fit_and_merge_back_whole():
    tags = TagRanges(100)
    assert [tags.take(30), tags.take(30), tags.take(30)] == [0, 30, 60]
    assert tags.take(11) is None  # 10 left
    tags.give(30, 30)
    assert tags.take(31) is None and tags.take(20) == 30  # the hole is reused from its start
    tags.give(0, 30)
    tags.give(60, 30)
    tags.give(30, 20)
    assert tags.free == [(0, 100)] and tags.take(100) == 0


def test_random_takes_and_gives_never_hand_out_a_tag_twice():
    rng = np.random.default_rng(5)
    tags, held, owner = TagRanges(500), [], np.zeros(500, dtype=bool)
    for _ in range(2000):
        if held and rng.random() < 0.5:
            first, length = held.pop(int(rng.integers(len(held))))
            owner[first:first + length] = False
            tags.give(first, length)
        else:
            length = int(rng.integers(1, 40))
            first = tags.take(length)
            if first is not None:
                assert not owner[first:first + length].any()
                owner[first:first + length] = True
                held.append((first, length))
    assert sum(length for _, length in tags.free) == 500 - int(owner.sum())


def test_a_range_given_back_twice_is_a_bug():
    tags = TagRanges(10)
    first = tags.take(4)
    tags.give(first, 4)
    with pytest.raises(InvariantError, match="given back twice"):
        tags.give(first, 4)
