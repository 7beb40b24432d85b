"""Directory placement (segments, rendezvous hashing) and shards, against reference models."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.cluster.directory import DirectoryShard, longest_prefixes
from kvd.cluster.keys import rendezvous_ids
from kvd.cluster.placement import Rendezvous, anchor_of_block, is_anchor, segment_starts, segments


def random_keys(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


@dataclass
class FakeBlock:
    key: bytes
    parent: FakeBlock | None


def test_segments_cut_where_the_keys_say_and_average_the_target_length():
    keys = random_keys(200_000)
    starts = segment_starts(keys, 64)
    assert starts[0] == 0
    assert all(is_anchor(keys[i], 64) for i in starts[1:])
    start_set = set(starts)
    assert not any(is_anchor(keys[i], 64) for i in range(1, len(keys)) if i not in start_set)
    mean = len(keys) / len(starts)
    assert 58 < mean < 70, mean
    cut = segments(keys, 64)
    assert cut[0][0] == 0 and cut[-1][1] == len(keys)
    assert all(a[1] == b[0] for a, b in zip(cut, cut[1:]))


def test_a_stored_block_finds_the_same_anchor_the_lookup_cuts_at():
    keys = random_keys(5000, seed=3)
    blocks, parent = [], None
    for key in keys:
        parent = FakeBlock(key, parent)
        blocks.append(parent)
    for start, end in segments(keys, 32):
        for i in range(start, end):
            assert anchor_of_block(blocks[i], 32) == keys[start]


def test_segment_starts_refuses_short_keys():
    with pytest.raises(ValueError):
        segment_starts([b"\x00" * 31])


def test_rendezvous_spreads_evenly_and_moves_only_what_it_must():
    anchors = random_keys(100_000, seed=1)
    members = [f"node-{i}" for i in range(10)]
    before = Rendezvous(members).owners(anchors)
    counts = np.unique(before, return_counts=True)[1]
    assert len(counts) == 10 and counts.max() / counts.min() < 1.1
    # A join takes about 1/11 of the anchors, all from the others to itself.
    after_join = Rendezvous([*members, "node-new"]).owners(anchors)
    moved = [(a, b) for a, b in zip(before, after_join) if a != b]
    assert all(b == "node-new" for _, b in moved)
    assert abs(len(moved) / len(anchors) - 1 / 11) < 0.01
    # A leave moves exactly the leaver's anchors.
    after_leave = Rendezvous(members[1:]).owners(anchors)
    changed = [(a, b) for a, b in zip(before, after_leave) if a != b]
    assert all(a == "node-0" for a, _ in changed) and len(changed) == before.count("node-0")
    # Order of the member list does not matter.
    assert Rendezvous(list(reversed(members))).owners(anchors[:100]) == before[:100]


def test_replica_sets_are_the_top_scores_and_change_only_where_they_must():
    ids = rendezvous_ids(b"".join(random_keys(20_000, seed=2)))
    members = [f"node-{i}" for i in range(10)]
    hrw = Rendezvous(members)
    sets = hrw.replica_indices(ids, 3)
    assert sets.shape == (len(ids), 3) and (sets[:, 0] == hrw.owner_indices(ids)).all()
    assert all(len(set(row)) == 3 for row in sets.tolist())
    # Evenly spread: each member is in about 3/10 of the sets.
    counts = np.bincount(sets.ravel(), minlength=10)
    assert counts.max() / counts.min() < 1.1
    before = [{members[i] for i in row} for row in sets.tolist()]
    # A join puts the new node into about 3/11 of the sets, replacing one member each; nothing else changes.
    joined = Rendezvous([*members, "node-new"])
    after = [{joined.members[i] for i in row} for row in joined.replica_indices(ids, 3).tolist()]
    changed = [(b, a) for b, a in zip(before, after) if a != b]
    assert all("node-new" in a and len(a - b) == 1 for b, a in changed)
    assert abs(len(changed) / len(ids) - 3 / 11) < 0.02
    # A leave changes exactly the sets the leaver was in.
    left = Rendezvous(members[1:])
    after = [{left.members[i] for i in row} for row in left.replica_indices(ids, 3).tolist()]
    assert [b != a for b, a in zip(before, after)] == ["node-0" in b for b in before]
    # More replicas than members: every member, best first.
    assert Rendezvous(["a", "b"]).replica_indices(ids[:5], 4).shape == (5, 2)


class ReferenceShard:
    def __init__(self, max_holders: int) -> None:
        self.max_holders = max_holders
        self.entries: dict[bytes, list[str]] = {}

    def add(self, node, keys):
        for key in keys:
            holders = self.entries.setdefault(key, [])
            if node not in holders and len(holders) < self.max_holders:
                holders.append(node)

    def remove(self, node, keys):
        for key in keys:
            if node in self.entries.get(key, []):
                self.entries[key].remove(node)
                if not self.entries[key]:
                    del self.entries[key]

    def drop_node(self, node):
        self.remove(node, list(self.entries))

    def query(self, keys):
        answer = []
        for key in keys:
            if not self.entries.get(key):
                break
            answer.append(tuple(self.entries[key]))
        return answer


operations = st.lists(st.tuples(st.sampled_from(["add", "remove", "drop"]), st.sampled_from("abcdef"),
                                st.lists(st.integers(0, 30), max_size=12)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(operations, st.integers(1, 4))
def test_shard_matches_a_reference(ops, max_holders):
    keys = random_keys(31, seed=9)
    shard, reference = DirectoryShard(max_holders=max_holders), ReferenceShard(max_holders)
    for op, node, indices in ops:
        chosen = [keys[i] for i in indices]
        if op == "add":
            shard.add(node, chosen)
            reference.add(node, chosen)
        elif op == "remove":
            shard.remove(node, chosen)
            reference.remove(node, chosen)
        else:
            shard.drop_node(node)
            reference.drop_node(node)
        shard.verify()
    assert len(shard) == len(reference.entries)
    for key in keys:
        assert shard.query([key]) == reference.query([key])
    assert shard.query(keys) == reference.query(keys)


def test_shard_keeps_at_most_max_entries_oldest_out_first():
    shard = DirectoryShard(max_entries=100)
    keys = random_keys(150)
    shard.add("a", keys)
    assert len(shard) == 100 and shard.dropped_entries == 50
    assert shard.query(keys[:1]) == [] and shard.query(keys[50:51]) == [("a",)]
    shard.verify()


def test_a_left_node_is_swept_and_its_slot_reused_cleanly():
    shard = DirectoryShard()
    keys = random_keys(10)
    shard.add("a", keys)
    shard.add("b", keys[:5])
    assert shard.drop_node("a") == 10
    shard.add("c", keys[8:])
    assert shard.query(keys) == [("b",)] * 5
    assert shard.query(keys[8:]) == [("c",), ("c",)]
    shard.verify()


def test_longest_prefixes_compose_segment_answers():
    # Segments of 3, 3 and 2 keys; "a" holds 7 blocks, "b" 4, "c" 2, and a
    # hot first block lists only two of its holders.
    answers = [
        [("b", "c"), ("a", "b", "c"), ("a", "b")],
        [("a", "b"), ("a",), ("a",)],
        [("a",)],
    ]
    assert longest_prefixes(answers, [3, 3, 2]) == {"a": 7, "b": 4, "c": 2}
    # An owner's answer cut short ends the prefix there, whatever follows.
    assert longest_prefixes([[("a",)], [("a",)]], [2, 1]) == {"a": 1}
    assert longest_prefixes([], []) == {}


def test_random_keys_are_not_all_anchors():
    assert sum(is_anchor(os.urandom(32), 256) for _ in range(1000)) < 20
