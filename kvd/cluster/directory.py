"""The cluster directory: which nodes hold which blocks, sharded by segment owner.

Each daemon keeps a `DirectoryShard` with the entries of the segments it
owns (kvd.cluster.placement): block key -> the nodes holding that block.
Holders publish their STORED / REMOVED events to the owners of the
affected segments; a lookup sends each segment's keys to its owner and
`longest_prefixes` composes the answers into the matched prefix per node.

Memory is bounded twice: an entry names at most `max_holders` nodes (a
hot prefix held by 500 nodes costs what one held by 4 costs; a router needs
a few candidates, not all of them), and a shard keeps at most `max_entries`
entries, dropping the oldest first. The directory is a hint: a holder
named here may have evicted the block since, and the fetch path verifies
every byte, so a stale entry costs a failed fetch, never a wrong block.

Node names are interned to small ints per shard; a node that leaves is
swept out of every entry at once, and its slot is reused only after that.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvd.invariants import check

DEFAULT_MAX_HOLDERS = 4
DEFAULT_MAX_ENTRIES = 1 << 22


class DirectoryShard:
    def __init__(self, max_holders: int = DEFAULT_MAX_HOLDERS, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_holders < 1 or max_entries < 1:
            raise ValueError("max_holders and max_entries must be positive")
        self.max_holders = max_holders
        self.max_entries = max_entries
        self._entries: dict[bytes, tuple[int, ...]] = {}
        self._names: list[str | None] = []
        self._slot_of: dict[str, int] = {}
        self.dropped_entries = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _slot(self, node: str) -> int:
        slot = self._slot_of.get(node)
        if slot is None:
            free = [i for i, name in enumerate(self._names) if name is None]
            slot = free[0] if free else len(self._names)
            if slot == len(self._names):
                self._names.append(node)
            else:
                self._names[slot] = node
            self._slot_of[node] = slot
        return slot

    def add(self, node: str, keys: Iterable[bytes]) -> int:
        """Record that `node` holds `keys`; returns how many entries gained it."""
        slot, entries, added = self._slot(node), self._entries, 0
        for key in keys:
            holders = entries.get(key)
            if holders is None:
                if len(entries) >= self.max_entries:
                    del entries[next(iter(entries))]
                    self.dropped_entries += 1
                entries[key] = (slot,)
                added += 1
            elif slot not in holders and len(holders) < self.max_holders:
                entries[key] = (*holders, slot)
                added += 1
        return added

    def remove(self, node: str, keys: Iterable[bytes]) -> int:
        slot = self._slot_of.get(node)
        if slot is None:
            return 0
        held = [key for key in dict.fromkeys(keys) if slot in self._entries.get(key, ())]
        self.remove_slot(slot, held)
        return len(held)

    def drop_node(self, node: str) -> int:
        """Forget every entry of a node that left; returns how many it was in."""
        slot = self._slot_of.pop(node, None)
        if slot is None:
            return 0
        touched = [key for key, holders in self._entries.items() if slot in holders]
        self.remove_slot(slot, touched)
        self._names[slot] = None
        return len(touched)

    def clear(self) -> None:
        """Forget every entry (this node was out of the cluster: what it held may be stale)."""
        self._entries.clear()
        self._names.clear()
        self._slot_of.clear()

    def remove_slot(self, slot: int, keys: Sequence[bytes]) -> None:
        for key in keys:
            rest = tuple(h for h in self._entries[key] if h != slot)
            if rest:
                self._entries[key] = rest
            else:
                del self._entries[key]

    def query(self, keys: Sequence[bytes]) -> list[tuple[str, ...]]:
        """Holders of each key, in order, up to the first key nobody holds."""
        names, answer = self._names, []
        for key in keys:
            holders = self._entries.get(key)
            if not holders:
                break
            answer.append(tuple(names[h] for h in holders))
        return answer

    def verify(self) -> None:
        for node, slot in self._slot_of.items():
            check(self._names[slot] == node, "interned slot names its node")
        live = set(self._slot_of.values())
        for holders in self._entries.values():
            check(0 < len(holders) <= self.max_holders, "an entry names 1..max_holders nodes")
            check(len(set(holders)) == len(holders) and set(holders) <= live, "holders are distinct live nodes")
        check(len(self._entries) <= self.max_entries, "a shard holds at most max_entries entries")


def longest_prefixes(answers: Sequence[Sequence[Sequence[str]]], segment_lengths: Sequence[int]) -> dict[str, int]:
    """Blocks of the prefix each node holds, from the owners' answers in segment order.

    `answers[s]` is the owner's reply for segment s (holders per key, cut at
    the first key nobody holds); `segment_lengths[s]` is how many keys that
    segment has. A node's index is prefix-closed (a block is evicted only
    once it has no children), so a node listed at position i holds the
    whole prefix up to i: its match is the last position it is listed at,
    plus one. That stays true when an entry lists only `max_holders` of a
    hot block's holders: the deeper, rarer blocks still name theirs.
    """
    matched: dict[str, int] = {}
    position = 0
    for answer, length in zip(answers, segment_lengths):
        for holders in answer:
            position += 1
            for node in holders:
                matched[node] = position
        if len(answer) < length:
            break
    return matched
