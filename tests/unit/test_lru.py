"""The intrusive LRU policy (kvd.core.policy.lru) on its own."""

from __future__ import annotations

import pytest

from kvd.core.block import Block, BlockState
from kvd.core.policy import make_policy
from kvd.core.policy.lru import LruPolicy
from kvd.core.radix import PrefixIndex
from kvd.invariants import InvariantError

INDEX = PrefixIndex("lru-test")


def blocks(*names: str) -> dict[str, Block]:
    return {
        name: Block(key=name.encode().ljust(32, b"\0"), index=INDEX, parent=None, state=BlockState.SEALED)
        for name in names
    }


def names(policy: LruPolicy, by_block: dict[str, Block]) -> list[str]:
    lookup = {id(block): name for name, block in by_block.items()}
    return [lookup[id(block)] for block in policy.order()]


def drain(policy: LruPolicy, by_block: dict[str, Block]) -> list[str]:
    """Evict everything, returning the eviction order."""
    lookup = {id(block): name for name, block in by_block.items()}
    evicted = []
    while (victim := policy.victim()) is not None:
        evicted.append(lookup[id(victim)])
        policy.remove(victim)
        policy.verify()
    return evicted


@pytest.fixture
def policy() -> LruPolicy:
    return LruPolicy()


def test_make_policy():
    assert isinstance(make_policy("lru"), LruPolicy)
    assert make_policy("lru").name == "lru"
    with pytest.raises(ValueError, match="lru"):
        make_policy("lfu")


def test_empty(policy):
    assert policy.victim() is None
    assert len(policy) == 0
    assert policy.order() == []
    policy.verify()


def test_admission_order_is_eviction_order(policy):
    b = blocks("a", "b", "c", "d")
    for name in "abcd":
        policy.admit(b[name])
        policy.verify()
    assert len(policy) == 4
    assert all(block in policy for block in b.values())
    assert policy.victim() is b["a"]
    assert drain(policy, b) == ["a", "b", "c", "d"]
    assert len(policy) == 0
    assert not any(block in policy for block in b.values())


def test_touch_moves_to_most_recent(policy):
    b = blocks("a", "b", "c", "d")
    for name in "abcd":
        policy.admit(b[name])
    policy.touch(b["b"])
    assert names(policy, b) == ["a", "c", "d", "b"]
    policy.touch(b["a"])
    assert names(policy, b) == ["c", "d", "b", "a"]
    policy.touch(b["a"])  # already most recent: no change
    assert names(policy, b) == ["c", "d", "b", "a"]
    policy.verify()
    assert drain(policy, b) == ["c", "d", "b", "a"]


def test_remove_from_head_middle_and_tail(policy):
    b = blocks("a", "b", "c", "d", "e")
    for name in "abcde":
        policy.admit(b[name])
    policy.remove(b["c"])
    assert names(policy, b) == ["a", "b", "d", "e"]
    policy.remove(b["a"])
    assert names(policy, b) == ["b", "d", "e"]
    policy.remove(b["e"])
    assert names(policy, b) == ["b", "d"]
    assert b["c"].policy_prev is None and b["c"].policy_next is None
    assert b["c"] not in policy and b["a"] not in policy and b["e"] not in policy
    assert len(policy) == 2
    policy.verify()
    # A removed block can be admitted again, at the most recent end.
    policy.admit(b["a"])
    assert drain(policy, b) == ["b", "d", "a"]


def test_single_element(policy):
    b = blocks("a")
    policy.admit(b["a"])
    assert b["a"] in policy
    policy.touch(b["a"])
    assert names(policy, b) == ["a"]
    policy.remove(b["a"])
    assert b["a"] not in policy
    assert policy.victim() is None
    policy.admit(b["a"], cold=True)
    assert names(policy, b) == ["a"]
    policy.verify()


def test_cold_admission_goes_next_in_line(policy):
    b = blocks("a", "b", "c", "x", "y")
    for name in "abc":
        policy.admit(b[name])
    policy.admit(b["x"], cold=True)
    assert names(policy, b) == ["x", "a", "b", "c"]
    policy.admit(b["y"], cold=True)
    assert names(policy, b) == ["y", "x", "a", "b", "c"]
    policy.verify()
    policy.touch(b["y"])
    assert drain(policy, b) == ["x", "a", "b", "c", "y"]


def test_cold_into_empty_then_warm(policy):
    b = blocks("a", "b")
    policy.admit(b["a"], cold=True)
    policy.admit(b["b"])
    assert drain(policy, b) == ["a", "b"]


def test_interleaved_operations(policy):
    b = blocks("a", "b", "c", "d", "e")
    policy.admit(b["a"])
    policy.admit(b["b"])
    policy.touch(b["a"])  # b a
    policy.admit(b["c"], cold=True)  # c b a
    policy.admit(b["d"])  # c b a d
    policy.remove(b["b"])  # c a d
    policy.touch(b["c"])  # a d c
    policy.admit(b["e"], cold=True)  # e a d c
    policy.verify()
    assert names(policy, b) == ["e", "a", "d", "c"]
    assert drain(policy, b) == ["e", "a", "d", "c"]


def test_misuse_is_refused(policy):
    b = blocks("a", "b")
    policy.admit(b["a"])
    with pytest.raises(InvariantError):
        policy.admit(b["a"])
    with pytest.raises(InvariantError):
        policy.admit(b["a"], cold=True)
    with pytest.raises(InvariantError):
        policy.remove(b["b"])
    with pytest.raises(InvariantError):
        policy.touch(b["b"])
    assert names(policy, b) == ["a"]
    policy.verify()


def corruptions():
    def broken_back_link(policy, b):
        b["c"].policy_prev = b["a"]

    def wrong_length(policy, b):
        policy._list.length += 1

    def wrong_tail(policy, b):
        policy._list.tail = b["b"]

    def cycle(policy, b):
        b["c"].policy_next = b["a"]

    return [broken_back_link, wrong_length, wrong_tail, cycle]


@pytest.mark.parametrize("corrupt", corruptions(), ids=lambda f: f.__name__)
def test_verify_catches_corruption(policy, corrupt):
    b = blocks("a", "b", "c")
    for name in "abc":
        policy.admit(b[name])
    policy.verify()
    corrupt(policy, b)
    with pytest.raises(InvariantError):
        policy.verify()
