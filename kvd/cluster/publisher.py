"""The holder's side of the directory: this daemon's blocks, told to their segment owners.

`Publisher.poll()` reads every namespace's KV events from its own cursor
into the engine's event ring (kvd.core.events), turns STORED and REMOVED
keys into directory keys (kvd.cluster.keys), finds each one's segment
anchor, and queues the keys per owner; `take()` hands the queued batches
to the sender, one per owner. Tier changes do not matter to the directory
(a peer reads from host memory or disk alike).

Anchors. A STORED event continues a chain from its parent key: the first
key's anchor is its parent's (or itself, when it is an anchor), and each
next key carries the anchor on until a key starts a new segment. The
publisher remembers the anchor of every block it published (its rendezvous
id, 8 bytes, in a dict keyed by directory key: about 100 B per block). A
REMOVED key has left the index by the time it is read, and this record is
how its owner is still found; it is also what `rebalance` re-publishes
from when the members change.

Resynchronisation. A cursor whose next event has left the ring, or a
namespace seen for the first time, is rebuilt from the namespace's index:
whatever the publisher had and the index lacks is removed, whatever the
index has is stored.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from kvd.cluster.keys import namespace_mask
from kvd.cluster.placement import Rendezvous
from kvd.core.block import BlockState
from kvd.core.events import Event, EventKind
from kvd.invariants import check

READ_EVENTS = 256


class _Namespace:
    __slots__ = ("mask", "mask_int", "mask_word", "mask_id", "next_sequence", "anchors")

    def __init__(self, namespace_id: bytes) -> None:
        self.mask = namespace_mask(namespace_id)
        self.mask_int = int.from_bytes(self.mask, "little")
        self.mask_word = int.from_bytes(self.mask[8:12], "little")
        self.mask_id = int.from_bytes(self.mask[:8], "little")
        self.next_sequence = 0  # 0: never read; resync from the index first
        # directory key -> rendezvous id of its segment's anchor
        self.anchors: dict[bytes, int] = {}

    def directory_key(self, key: bytes) -> bytes:
        return (int.from_bytes(key, "little") ^ self.mask_int).to_bytes(32, "little")

    def is_anchor(self, key: bytes, segment_blocks: int) -> bool:
        """Whether the block key's directory key starts a segment (placement.is_anchor, unmasked here)."""
        return (int.from_bytes(key[8:12], "little") ^ self.mask_word) % segment_blocks == 0

    def anchor_id(self, key: bytes) -> int:
        """The rendezvous id of the block key's directory key."""
        return int.from_bytes(key[:8], "little") ^ self.mask_id


class Publisher:
    def __init__(self, engine, segment_blocks: int, replicas: int = 1) -> None:
        self.engine = engine
        self.segment_blocks = segment_blocks
        self.replicas = replicas
        self._namespaces: dict[bytes, _Namespace] = {}
        self._owners: Rendezvous | None = None
        # owner -> directory key -> True (stored) or False (removed), waiting to be sent. A key's
        # latest change wins: a block stored and removed between two sends is removed.
        self._queued: dict[str, dict[bytes, bool]] = defaultdict(dict)
        self.resyncs = 0

    @property
    def held_keys(self) -> int:
        return sum(len(ns.anchors) for ns in self._namespaces.values())

    def set_members(self, names: Iterable[str], fresh: Iterable[str] = ()) -> None:
        """New membership: every held key moves to the replicas it gained (and is removed from
        those it lost that are still members, so no stale entry answers should one of them own
        the key again), and every key a `fresh` replica (a node that (re)joined with an empty
        shard) owns is sent to it again."""
        before = self._owners
        self._owners = Rendezvous(list(names))
        staying, fresh = set(self._owners.members), set(fresh)
        for gone in set(self._queued) - staying:
            del self._queued[gone]  # its shard went with it
        for ns in self._namespaces.values():
            if not ns.anchors:
                continue
            anchors = list(ns.anchors.values())
            now = self._owner_sets(anchors)
            old = self._owner_sets(anchors, before) if before is not None else now
            for key, owners, previous in zip(ns.anchors, now, old):
                if owners == previous and not fresh:
                    continue
                for owner in previous:
                    if owner not in owners and owner in staying and owner not in fresh:
                        self._set(owner, key, False)
                for owner in owners:
                    if owner not in previous or owner in fresh:
                        self._set(owner, key, True)

    def _owner_sets(self, anchor_ids: list[int], owners: Rendezvous | None = None) -> list[tuple[str, ...]]:
        """Each anchor's replica set; anchors repeat (one per key), so each distinct one is scored once."""
        owners = owners or self._owners
        distinct, which = np.unique(np.array(anchor_ids, dtype=np.uint64), return_inverse=True)
        indices = owners.replica_indices(distinct, self.replicas)
        sets = [tuple(owners.members[i] for i in row) for row in indices.tolist()]
        return [sets[i] for i in which.tolist()]

    def _set(self, owner: str, key: bytes, stored: bool) -> None:
        queue = self._queued[owner]
        queue.pop(key, None)  # re-inserted last: a queue's order is the order of the latest changes
        queue[key] = stored

    def _queue(self, stored: bool, keys: list[bytes], anchor_ids: list[int]) -> None:
        """Queue keys as stored or removed for every replica of their segments."""
        if keys:
            for key, owners in zip(keys, self._owner_sets(anchor_ids)):
                for owner in owners:
                    self._set(owner, key, stored)

    def poll(self) -> None:
        """Read every namespace's new events (or its index, when resynchronising) into the queues."""
        if self._owners is None:
            return
        events = self.engine.events
        for state in self.engine.namespaces():
            ns = self._namespaces.get(state.namespace_id)
            if ns is None:
                ns = self._namespaces[state.namespace_id] = _Namespace(state.namespace_id)
            while True:
                if ns.next_sequence == 0:
                    self._resync(ns, state)
                    break
                batch = events.read(state.namespace_id, ns.next_sequence, READ_EVENTS)
                if batch is None:
                    ns.next_sequence = 0
                    continue
                if not batch:
                    break
                for event in batch:
                    self._apply(ns, state, event)
                ns.next_sequence = batch[-1].sequence + 1

    def _apply(self, ns: _Namespace, state, event: Event) -> None:
        if event.kind is EventKind.STORED:
            self._stored(ns, state, event.parent_key, event.keys)
        elif event.kind is EventKind.REMOVED:
            removed = [ns.directory_key(key) for key in event.keys]
            gone = [(key, ns.anchors.pop(key)) for key in removed if key in ns.anchors]
            self._queue(False, [key for key, _ in gone], [anchor for _, anchor in gone])

    def _stored(self, ns: _Namespace, state, parent_key: bytes, keys: list[bytes]) -> None:
        anchor = self._anchor_of_parent(ns, state, parent_key) if parent_key else None
        stored, anchors = [], []
        for key in keys:
            if anchor is None or ns.is_anchor(key, self.segment_blocks):
                anchor = ns.anchor_id(key)
            directory_key = ns.directory_key(key)
            ns.anchors[directory_key] = anchor
            stored.append(directory_key)
            anchors.append(anchor)
        self._queue(True, stored, anchors)

    def _anchor_of_parent(self, ns: _Namespace, state, parent_key: bytes) -> int | None:
        known = ns.anchors.get(ns.directory_key(parent_key))
        if known is not None:
            return known
        block = state.index.get(parent_key)
        return self._anchor_of_block(ns, block) if block is not None else None

    def _anchor_of_block(self, ns: _Namespace, block) -> int:
        """Walk up to the first anchor, or the root (which always anchors its chain)."""
        while True:
            known = ns.anchors.get(ns.directory_key(block.key))
            if known is not None:
                return known
            if block.parent is None or ns.is_anchor(block.key, self.segment_blocks):
                return ns.anchor_id(block.key)
            block = block.parent

    def _resync(self, ns: _Namespace, state) -> None:
        """Rebuild the namespace's published set from its index (parents come before children)."""
        self.resyncs += 1
        ns.next_sequence = self.engine.events.last_sequence(state.namespace_id) + 1
        fresh: dict[bytes, int] = {}
        by_block: dict[int, int] = {}
        for block in state.index:
            if block.state != BlockState.SEALED:
                continue
            parent = block.parent
            if parent is None or ns.is_anchor(block.key, self.segment_blocks):
                anchor = ns.anchor_id(block.key)
            else:
                anchor = by_block.get(id(parent))
                if anchor is None:  # a parent that is not sealed (a LOST tombstone): walk
                    anchor = self._anchor_of_block(ns, parent)
            by_block[id(block)] = anchor
            fresh[ns.directory_key(block.key)] = anchor
        gone = [(key, anchor) for key, anchor in ns.anchors.items() if key not in fresh]
        self._queue(False, [key for key, _ in gone], [anchor for _, anchor in gone])
        ns.anchors = fresh
        self._queue(True, list(fresh), list(fresh.values()))

    def take(self) -> dict[str, tuple[list[bytes], list[bytes]]]:
        """The queued (stored, removed) keys, per owner; the queues start over empty.
        A key is in at most one of an owner's two lists, so their order does not matter."""
        queued, self._queued = self._queued, defaultdict(dict)
        return {owner: ([key for key, stored in queue.items() if stored],
                        [key for key, stored in queue.items() if not stored])
                for owner, queue in queued.items() if queue}

    def requeue(self, owner: str, stored: list[bytes], removed: list[bytes]) -> None:
        """Put back a batch its owner did not take (sent again with the next one), under
        any newer change to the same keys queued since."""
        queue = self._queued[owner]
        for keys, kind in ((stored, True), (removed, False)):
            for key in keys:
                queue.setdefault(key, kind)

    def verify(self) -> None:
        for ns in self._namespaces.values():
            check(all(isinstance(anchor, int) for anchor in ns.anchors.values()), "anchors are rendezvous ids")
