"""The prefix index (kvd.core.radix.PrefixIndex) on its own.

The index does not seal blocks (the engine does), so these tests set
`state` directly to build the trees they need.
"""

from __future__ import annotations

import hashlib
import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core import radix
from kvd.core.block import Block, BlockState
from kvd.core.keys import PackedKeys
from kvd.core.radix import PrefixIndex
from kvd.errors import InvalidArgument
from kvd.invariants import InvariantError


def key(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


def sealed_chain(index: PrefixIndex, names: list[str], parent: Block | None = None) -> list[Block]:
    blocks = []
    for name in names:
        parent = index.insert(key(name), parent)
        parent.state = BlockState.SEALED
        blocks.append(parent)
    return blocks


@pytest.fixture
def index() -> PrefixIndex:
    return PrefixIndex("test", 64)


# ----------------------------------------------------------------------
# match


def test_empty_index_matches_nothing(index):
    assert index.match([]) == []
    assert index.match([key("a")]) == []
    index.verify()


def test_match_returns_the_longest_sealed_prefix(index):
    a, b, c = sealed_chain(index, ["a", "b", "c"])
    matched = index.match([key("a"), key("b"), key("c")])
    assert matched == [a, b, c]
    assert all(got is want for got, want in zip(matched, [a, b, c]))
    assert index.match([key("a"), key("b"), key("c"), key("d")]) == [a, b, c]
    assert index.match([key("a"), key("b"), key("x"), key("c")]) == [a, b]
    assert index.match([key("a")]) == [a]
    assert index.match([key("x"), key("a")]) == []
    index.verify()


def test_match_from_a_parent(index):
    a, b, c = sealed_chain(index, ["a", "b", "c"])
    # Without a parent the walk starts at root blocks, and b is not one.
    assert index.match([key("b"), key("c")]) == []
    assert index.match([key("b"), key("c")], parent=a) == [b, c]
    assert index.match([key("c")], parent=b) == [c]
    assert index.match([key("c")], parent=a) == []


def test_match_stops_at_a_writable_block(index):
    a, b = sealed_chain(index, ["a", "b"])
    c = index.insert(key("c"), b)  # WRITABLE: being written, not discoverable
    d = index.insert(key("d"), c)
    assert index.match([key("a"), key("b"), key("c"), key("d")]) == [a, b]
    c.state = BlockState.SEALED
    assert index.match([key("a"), key("b"), key("c"), key("d")]) == [a, b, c]
    d.state = BlockState.SEALED
    assert index.match([key("a"), key("b"), key("c"), key("d")]) == [a, b, c, d]
    index.verify()


def test_match_of_a_writable_root_is_empty(index):
    index.insert(key("a"), None)
    assert index.match([key("a")]) == []


def test_match_stops_at_a_key_under_another_parent(index):
    a, b, _c = sealed_chain(index, ["a", "b", "c"])
    (b2,) = sealed_chain(index, ["b2"], parent=a)
    # Skipping a block: c is stored, but under b, not under a.
    assert index.match([key("a"), key("c")]) == [a]
    # Keys out of order.
    assert index.match([key("c"), key("b"), key("a")]) == []
    assert index.match([key("a"), key("c"), key("b")]) == [a]
    # Siblings are not a chain.
    assert index.match([key("a"), key("b"), key("b2")]) == [a, b]
    assert index.match([key("a"), key("b2"), key("c")]) == [a, b2]
    # A repeated key is never its own child.
    assert index.match([key("a"), key("a")]) == [a]


def test_match_does_not_change_the_index(index):
    blocks = sealed_chain(index, ["a", "b"])
    before = {k: (n.state, n.child_count(), n.ref_count, n.parent) for k, n in index.nodes.items()}
    index.match([key("a"), key("b"), key("zz")])
    assert {k: (n.state, n.child_count(), n.ref_count, n.parent) for k, n in index.nodes.items()} == before
    assert len(index) == len(blocks)


# ----------------------------------------------------------------------
# match of packed keys (a long Lookup): the native walk, same answers


def packed_and_listed(index: PrefixIndex, keys: list[bytes], parent: Block | None = None) -> list[Block]:
    """index.match of `keys` packed (the native walk) and listed (the Python loop): the same blocks."""
    listed = index.match(keys, parent)
    packed = index.match(PackedKeys(b"".join(keys)), parent)
    assert len(packed) == len(listed) and all(a is b for a, b in zip(packed, listed, strict=True))
    return packed


def test_packed_keys_take_the_native_walk():
    # The native module is built by `make setup`; without it the packed path is the Python loop.
    assert radix._native_match_chain is not None


def test_packed_match_stops_where_the_loop_does(index):
    a, b, c = sealed_chain(index, ["a", "b", "c"])
    (b2,) = sealed_chain(index, ["b2"], parent=a)
    d = index.insert(key("d"), c)  # WRITABLE
    assert packed_and_listed(index, [key("a"), key("b"), key("c"), key("d")]) == [a, b, c]
    assert packed_and_listed(index, [key("a"), key("c")]) == [a]
    assert packed_and_listed(index, [key("a"), key("b2"), key("c")]) == [a, b2]
    assert packed_and_listed(index, [key("b"), key("c")]) == []
    assert packed_and_listed(index, [key("b"), key("c")], parent=a) == [b, c]
    assert packed_and_listed(index, [key("a"), key("a")]) == [a]
    assert packed_and_listed(index, []) == []
    d.state = BlockState.LOST
    assert packed_and_listed(index, [key("a"), key("b"), key("c"), key("d")]) == [a, b, c]


@settings(max_examples=200, deadline=None)
@given(
    parents=st.lists(st.integers(min_value=-1, max_value=30), min_size=1, max_size=30),
    states=st.lists(st.sampled_from([BlockState.SEALED] * 4 + [BlockState.WRITABLE, BlockState.LOST]),
                    min_size=30, max_size=30),
    query=st.lists(st.integers(min_value=0, max_value=40), max_size=40),
    start=st.integers(min_value=-1, max_value=30),
)
def test_packed_match_equals_the_loop_on_any_forest(parents, states, query, start):
    index = PrefixIndex("test", 64)
    blocks: list[Block] = []
    for position, parent in enumerate(parents):
        # Node i hangs under an earlier node (or is a root): any forest.
        under = blocks[parent % position] if parent >= 0 and position else None
        blocks.append(index.insert(key(str(position)), under))
        blocks[-1].state = states[position]
    # Queries mix stored keys (any order) with keys never stored (numbers past the forest).
    keys = [key(str(number)) for number in query]
    parent = blocks[start % len(blocks)] if start >= 0 else None
    packed_and_listed(index, keys, parent)


def test_native_walk_reads_fields_of_any_node_type():
    # Blocks are read through their slot offsets; any other object through getattr, with the same answer.
    nodes, parent = {}, None
    for name in "abcd":
        parent = nodes[key(name)] = types.SimpleNamespace(key=key(name), parent=parent, state=BlockState.SEALED)
    nodes[key("c")].state = BlockState.WRITABLE
    walk = [key(name) for name in "abcd"]
    assert radix._native_match_chain(nodes, b"".join(walk), 32, None, BlockState.SEALED) == [nodes[key("a")],
                                                                                            nodes[key("b")]]
    del nodes[key("a")].key  # a field that is not there is an error, not a guess
    with pytest.raises(AttributeError):
        radix._native_match_chain(nodes, b"".join(walk[:2]), 32, None, BlockState.SEALED)


def test_packed_keys_must_be_whole_keys():
    with pytest.raises(InvalidArgument, match="packed_keys is 33 bytes, not a whole number of 32-byte keys"):
        PackedKeys(bytes(33))
    with pytest.raises(ValueError, match="not a whole number of 32-byte keys"):
        radix._native_match_chain({}, bytes(33), 32, None, BlockState.SEALED)


# ----------------------------------------------------------------------
# insert / remove


def test_insert_creates_writable_nodes_and_counts_children(index):
    a = index.insert(key("a"), None)
    assert (a.state, a.child_count(), a.ref_count, a.parent, a.index) == (BlockState.WRITABLE, 0, 0, None, index)
    a.state = BlockState.SEALED
    b = index.insert(key("b"), a)
    b2 = index.insert(key("b2"), a)
    c = index.insert(key("c"), b)
    assert (a.child_count(), b.child_count(), b2.child_count(), c.child_count()) == (2, 1, 0, 0)
    # The newest child heads its list.
    assert (a.first_child, b2.next_sibling, b.prev_sibling, b.next_sibling) == (b2, b, b2, None)
    assert b.parent is a and c.parent is b
    assert len(index) == 4
    assert index.get(key("c")) is c
    assert index.get(key("zz")) is None
    assert set(map(id, index)) == {id(a), id(b), id(b2), id(c)}
    index.verify()


def test_remove_maintains_child_counts(index):
    a, b, c = sealed_chain(index, ["a", "b", "c"])
    (b2,) = sealed_chain(index, ["b2"], parent=a)
    assert index.remove(c) is b
    assert (b.child_count(), b.first_child, c.state, c.parent) == (0, None, BlockState.REMOVED, None)
    assert index.get(key("c")) is None
    index.verify()
    assert index.remove(b2) is a
    assert a.child_count() == 1
    assert index.remove(b) is a
    assert a.child_count() == 0
    assert index.remove(a) is None
    assert len(index) == 0
    index.verify()


def test_a_removed_key_can_be_inserted_again(index):
    (a,) = sealed_chain(index, ["a"])
    index.remove(a)
    again = index.insert(key("a"), None)
    assert again is not a and again.state == BlockState.WRITABLE
    index.verify()


def test_insert_and_remove_refuse_misuse(index):
    a, b = sealed_chain(index, ["a", "b"])
    with pytest.raises(InvariantError):
        index.insert(key("a"), None)  # already there
    with pytest.raises(InvariantError):
        index.insert(key("b"), a)  # already there, even under its own parent
    with pytest.raises(InvariantError):
        index.remove(a)  # still has a child
    other = PrefixIndex("other")
    (foreign,) = sealed_chain(other, ["f"])
    with pytest.raises(InvariantError):
        index.insert(key("x"), foreign)  # parent of another index
    with pytest.raises(InvariantError):
        index.remove(foreign)
    index.remove(b)
    with pytest.raises(InvariantError):
        index.insert(key("x"), b)  # parent no longer in the index
    with pytest.raises(InvariantError):
        index.remove(b)  # twice
    assert a.child_count() == 0
    index.verify()


# ----------------------------------------------------------------------
# subtree


def test_subtree_lists_descendants_leaves_first(index):
    a, b, c = sealed_chain(index, ["a", "b", "c"])
    b2, c2 = sealed_chain(index, ["b2", "c2"], parent=a)
    (other,) = sealed_chain(index, ["other"])
    order = index.subtree(a)
    assert set(map(id, order)) == {id(a), id(b), id(c), id(b2), id(c2)}
    assert len(order) == 5
    position = {id(node): i for i, node in enumerate(order)}
    for node in order:
        if node.parent is not None and node is not a:
            assert position[id(node)] < position[id(node.parent)]
    assert index.subtree(c) == [c]
    assert [id(n) for n in index.subtree(b)] == [id(c), id(b)]
    assert index.subtree(other) == [other]
    # Removing in this order is always legal.
    for node in order:
        index.remove(node)
    assert list(index) == [other]
    index.verify()


class UnwalkableNodes(dict):
    """The index's dict, refusing to be walked: what must cost O(subtree) may only probe it."""

    def _walked(self, *args):
        raise AssertionError("the whole index was walked")

    __iter__ = values = items = keys = _walked


def test_subtree_costs_its_own_size_not_the_index(index):
    # Issue 35 item 7: Delete walked every node of the namespace per deleted key.
    a, b, c = sealed_chain(index, ["a", "b", "c"])
    for number in range(2000):
        sealed_chain(index, [f"other {number}", f"other {number} child"])
    index.nodes = UnwalkableNodes(index.nodes)
    assert [node.key for node in index.subtree(a)] == [c.key, b.key, a.key]
    for node in index.subtree(a):
        index.remove(node)
    index.nodes = {key: index.nodes[key] for key in dict.keys(index.nodes)}
    assert len(index) == 4000
    index.verify()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 40)), max_size=120))
def test_links_stay_consistent_through_any_inserts_and_removals(steps):
    index = PrefixIndex("links", 64)
    for number, (insert, pick) in enumerate(steps):
        nodes = list(index)
        leaves = [node for node in nodes if node.first_child is None]
        if insert or not leaves:
            parent = nodes[pick % len(nodes)] if nodes and pick % 3 else None
            index.insert(key(f"n{number}"), parent)
        else:
            index.remove(leaves[pick % len(leaves)])
        index.verify()
        for node in index:
            expected = {id(other) for other in index if other.parent is node}
            assert {id(child) for child in index.subtree(node)[:-1] if child.parent is node} == expected
            assert len(index.subtree(node)) == 1 + sum(len(index.subtree(child)) for child in index
                                                       if child.parent is node)


# ----------------------------------------------------------------------
# verify catches corruption


def corrupt_cases():
    def child_linked_twice(index, a, b, c):
        c.next_sibling = c

    def child_unlinked(index, a, b, c):
        a.first_child = None

    def prev_link_disagrees(index, a, b, c):
        c.prev_sibling = b

    def root_unlinked(index, a, b, c):
        index.first_root = None

    def removed_node_still_linked(index, a, b, c):
        del index.nodes[key("c")]

    def stored_under_wrong_key(index, a, b, c):
        index.nodes[key("zz")] = index.nodes.pop(key("c"))

    def node_of_another_index(index, a, b, c):
        c.index = PrefixIndex("other")

    def removed_node_in_index(index, a, b, c):
        c.state = BlockState.REMOVED

    def negative_ref_count(index, a, b, c):
        c.ref_count = -1

    def parent_outside_index(index, a, b, c):
        del index.nodes[key("a")]

    def sealed_under_writable(index, a, b, c):
        b.state = BlockState.WRITABLE

    return [
        child_linked_twice,
        child_unlinked,
        prev_link_disagrees,
        root_unlinked,
        removed_node_still_linked,
        stored_under_wrong_key,
        node_of_another_index,
        removed_node_in_index,
        negative_ref_count,
        parent_outside_index,
        sealed_under_writable,
    ]


@pytest.mark.parametrize("corrupt", corrupt_cases(), ids=lambda f: f.__name__)
def test_verify_catches_corruption(index, corrupt):
    a, b, c = sealed_chain(index, ["a", "b", "c"])
    index.verify()
    corrupt(index, a, b, c)
    with pytest.raises(InvariantError):
        index.verify()


def test_writable_under_sealed_and_writable_under_writable_are_fine(index):
    (a,) = sealed_chain(index, ["a"])
    b = index.insert(key("b"), a)
    index.insert(key("c"), b)
    index.verify()
