"""An EventSnapshot built in bounded steps, exact as of the sequence it reports.

A KV-aware router mirrors a namespace from a snapshot (every block served,
its parent and tier) and the events after the snapshot's `sequence`
(kvd.core.events). The daemon answers on its event loop, so a namespace of
a million blocks cannot be listed in one step: `SnapshotBuild` works at
most `step_blocks` blocks per `step()`, and the engine goes on changing in
between. It reports the blocks served right after event `sequence`, the
newest event when its last step began, in three phases:

1. walk: down the index's child lists (kvd.core.radix), parents first,
   recording each SEALED block reached from a root or a recorded parent:
   key, parent key, tier at that moment. Meanwhile the event log notes
   every key of the namespace that an event names (EventLog.track).
2. catch up: the noted keys are looked up again as they are now (served or
   not, parent, tier), `step_blocks` at a time; keys noted while that runs
   are looked up in another round, until the ones left fit in one step (or
   stop shrinking): that step looks them up, fixes `sequence` and stops
   noting.
3. assemble (frozen data only): a recorded key that was noted keeps its
   place with its looked-up state, or leaves; noted keys served at
   `sequence` and not placed go last, parents first.

Why it is exact. A key no event named from the walk's start to `sequence`
was served all along, with one parent and one tier, by the same block,
whose ancestors were too (a sealed block's ancestors are sealed; they leave
after it). The walk reaches every block that stays in the tree (a removed
block keeps its next_sibling, and new blocks join at the head of a list),
so it recorded that key, with its state at `sequence`. A key an event did
name was looked up after its last change, so its looked-up state is its
state at `sequence`. Each key is listed once: a block is reached at most
once, and a noted key is placed at most once.

Why parents come first. The walk records a block after its parent. A noted
key keeps its place only if its parent kept (or has) a place before it;
otherwise it and, by the same rule, its noted descendants go last, ordered
parents first among themselves. A key nobody noted has a parent nobody
noted either (the parent's block cannot change while its child is served
by one block), recorded and kept before it.

Memory: what it has listed is kept as flat bytes (`_Packed`, about 66 B
a block) until sent. Lists of keys would hold a reference per block, and
CPython's young collections walk every reference of the lists made since
the last one: at a million blocks, tens of milliseconds in whichever step
it struck.

Cost: each step does O(step_blocks) work, however large the namespace;
the catch-up's last step O(keys noted in one round), at most step_blocks
unless the namespace changes faster than the rounds look keys up;
tracking costs the engine one dict store per changed key while a build
runs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import islice

from kvd.core.block import Block, BlockState
from kvd.core.events import EventLog
from kvd.core.keys import KEY_BYTES
from kvd.core.radix import PrefixIndex
from kvd.invariants import check

# Rounds of looking up changed keys before the last one looks up whatever
# is left at once. Rounds go on only while each leaves fewer keys than the
# one before: a namespace changing faster than lookups keep up with costs
# one longer last step (as many keys as the round before it), never a
# snapshot that does not end.
CATCH_UP_ROUNDS_MAX = 8

# A noted key's state as of `sequence`: (parent key, tier byte), or None when not served.
_State = tuple[bytes, int] | None
# What the steps' generator returns at its end (each step yields None).
_DONE = object()
# Where a root's parent key would be in a packed record (`roots` says which).
_NO_PARENT = bytes(KEY_BYTES)


@dataclass(slots=True)
class SnapshotPart:
    """Some of a snapshot's blocks, parents before children (b"": a root)."""

    keys: list[bytes] = field(default_factory=list)
    parent_keys: list[bytes] = field(default_factory=list)
    # One TierId byte per key.
    tiers: bytes = b""


@dataclass(slots=True, frozen=True)
class _Packed:
    """Snapshot entries as flat bytes (see Memory above):

        keys         KEY_BYTES per entry, back to back
        parent_keys  KEY_BYTES per entry; zeros for a root
        roots        one byte per entry, 1 for a root
        tiers        one TierId byte per entry
    """

    keys: bytes = b""
    parent_keys: bytes = b""
    roots: bytes = b""
    tiers: bytes = b""

    def __len__(self) -> int:
        return len(self.tiers)

    @staticmethod
    def of(keys: list[bytes], parent_keys: list[bytes], tiers: bytes) -> _Packed:
        packed = _Packed(b"".join(keys), b"".join([parent or _NO_PARENT for parent in parent_keys]),
                         bytes([not parent for parent in parent_keys]), tiers)
        check(len(packed.keys) == len(packed.parent_keys) == KEY_BYTES * len(tiers) == KEY_BYTES * len(keys),
              "snapshot entries of {} keys are not {} bytes each", len(keys), KEY_BYTES)
        return packed

    def key_list(self) -> list[bytes]:
        data = self.keys
        return [data[start:start + KEY_BYTES] for start in range(0, len(data), KEY_BYTES)]

    def unpacked(self) -> SnapshotPart:
        data = self.parent_keys
        parent_keys = [b"" if root else data[start:start + KEY_BYTES]
                       for start, root in zip(range(0, len(data), KEY_BYTES), self.roots)]
        return SnapshotPart(self.key_list(), parent_keys, self.tiers)


class SnapshotBuild:
    """One namespace's snapshot, built by repeated `step()` calls; `close()` when dropped."""

    def __init__(self, index: PrefixIndex, events: EventLog, tier_bytes: Callable[[Sequence[Block]], bytes],
                 step_blocks: int) -> None:
        check(step_blocks > 0, "a snapshot step needs blocks, got {}", step_blocks)
        self.index = index
        self.events = events
        self.tier_bytes = tier_bytes
        self.step_blocks = step_blocks
        # Final once `complete`.
        self.sequence = events.last_sequence(index.namespace_id)
        self.block_count = 0
        self.complete = False
        self._tracker = events.track(index.namespace_id)
        self._tracking = True
        # Blocks whose list (and, below them, subtree) the walk still has to go through.
        self._pending: list[Block] = [] if index.first_root is None else [index.first_root]
        self._records: list[_Packed] = []
        self._looked_up: dict[bytes, _State] = {}
        self._steps = self._build()

    def step(self) -> bool:
        """Do the next step's work; True once the snapshot is complete."""
        check(not self.complete, "step of a complete snapshot")
        if next(self._steps, _DONE) is _DONE:
            self.complete = True
        return self.complete

    def close(self) -> None:
        """Stop noting changes (idempotent); an incomplete build is abandoned."""
        self._steps.close()
        self._untrack()

    def parts(self, part_blocks: int) -> Iterator[SnapshotPart]:
        """The complete snapshot in parts of at most `part_blocks` blocks; at
        least one part. Each part costs O(part_blocks + step_blocks)."""
        check(self.complete and part_blocks > 0, "parts of an incomplete snapshot")
        part = SnapshotPart()
        tiers: list[bytes] = []
        sent = 0
        for record in self._records:
            entries = record.unpacked()
            start = 0
            while start < len(entries.keys):
                stop = min(len(entries.keys), start + part_blocks - len(part.keys))
                part.keys += entries.keys[start:stop]
                part.parent_keys += entries.parent_keys[start:stop]
                tiers.append(entries.tiers[start:stop])
                start = stop
                if len(part.keys) == part_blocks:
                    part.tiers = b"".join(tiers)
                    sent += len(part.keys)
                    yield part
                    part, tiers = SnapshotPart(), []
        if part.keys or not sent:
            part.tiers = b"".join(tiers)
            sent += len(part.keys)
            yield part
        check(sent == self.block_count, "snapshot parts hold {} blocks, not {}", sent, self.block_count)

    # -- the phases: a generator, one `yield` per step ---------------------------

    def _build(self) -> Iterator[None]:
        try:
            yield from self._walk()
            yield from self._catch_up()
        finally:
            self._untrack()
        yield from self._assemble()

    def _walk(self) -> Iterator[None]:
        pending, sealed = self._pending, BlockState.SEALED
        while pending:
            taken: list[Block] = []
            for _ in range(self.step_blocks):
                if not pending:
                    break
                node = pending.pop()
                after = node.next_sibling
                if after is not None:
                    pending.append(after)
                # A removed block is passed (its next_sibling leads on); under a
                # writable or lost block nothing is served, so the walk stays out.
                if node.state is sealed:
                    taken.append(node)
                    if node.first_child is not None:
                        pending.append(node.first_child)
            self._records.append(_Packed.of([block.key for block in taken],
                                            [b"" if block.parent is None else block.parent.key for block in taken],
                                            self.tier_bytes(taken)))
            yield

    def _catch_up(self) -> Iterator[None]:
        waiting_before = len(self._tracker.keys) + 1
        for _ in range(CATCH_UP_ROUNDS_MAX):
            waiting = len(self._tracker.keys)
            if waiting <= self.step_blocks or waiting >= waiting_before:
                break  # few enough for one step, or changes come faster than rounds end
            waiting_before = waiting
            noted = iter(self._tracker.take())
            while batch := list(islice(noted, self.step_blocks)):
                self._look_up(batch)
                yield
        # The last round, in this one step: `sequence` is the newest event now.
        self._look_up(list(self._tracker.take()))
        self.sequence = self.events.last_sequence(self.index.namespace_id)
        self._untrack()

    def _look_up(self, keys: list[bytes]) -> None:
        nodes, sealed, looked_up = self.index.nodes, BlockState.SEALED, self._looked_up
        served: list[Block] = []
        for key in keys:
            node = nodes.get(key)
            if node is not None and node.state is sealed:
                served.append(node)
            else:
                looked_up[key] = None
        for node, tier in zip(served, self.tier_bytes(served)):
            looked_up[node.key] = (b"" if node.parent is None else node.parent.key, tier)

    def _assemble(self) -> Iterator[None]:
        looked_up = self._looked_up
        if looked_up:
            placed: set[bytes] = set()
            for position, record in enumerate(self._records):
                if not looked_up.keys().isdisjoint(record.key_list()):
                    self._records[position] = self._patched(record.unpacked(), placed)
                yield
            emitted: set[bytes] = set()
            noted = iter(looked_up)
            while batch := list(islice(noted, self.step_blocks)):
                self._records.append(self._tail(batch, placed, emitted))
                yield
            check(placed.isdisjoint(emitted), "a noted key listed twice")
        self.block_count = sum(map(len, self._records))

    def _patched(self, record: SnapshotPart, placed: set[bytes]) -> _Packed:
        """`record` with each noted key in its state at `sequence`: kept in place
        while served under the same parent, that parent already listed."""
        looked_up = self._looked_up
        patched = SnapshotPart()
        tiers = bytearray()
        for key, parent_key, tier in zip(record.keys, record.parent_keys, record.tiers):
            if key in looked_up:
                state = looked_up[key]
                if (state is None or state[0] != parent_key or key in placed
                        or (parent_key in looked_up and parent_key not in placed)):
                    continue
                placed.add(key)
                tier = state[1]
            patched.keys.append(key)
            patched.parent_keys.append(parent_key)
            tiers.append(tier)
        return _Packed.of(patched.keys, patched.parent_keys, bytes(tiers))

    def _tail(self, batch: list[bytes], placed: set[bytes], emitted: set[bytes]) -> _Packed:
        """The served, unplaced noted keys of `batch`, each after its unplaced
        noted ancestors (listed first, if not yet)."""
        looked_up = self._looked_up
        tail = SnapshotPart()
        tiers = bytearray()
        for key in batch:
            chain: list[bytes] = []
            while key not in emitted and key not in placed and looked_up.get(key) is not None:
                emitted.add(key)
                chain.append(key)
                key = looked_up[key][0]  # type: ignore[index]
            for member in reversed(chain):
                parent_key, tier = looked_up[member]  # type: ignore[misc]
                tail.keys.append(member)
                tail.parent_keys.append(parent_key)
                tiers.append(tier)
        return _Packed.of(tail.keys, tail.parent_keys, bytes(tiers))

    def _untrack(self) -> None:
        if self._tracking:
            self._tracking = False
            self.events.untrack(self._tracker)

    def verify(self) -> None:
        check(self._tracking == self.events.tracking(self._tracker), "a snapshot's tracker is not where it says")
        check(not (self.complete and self._tracking), "a complete snapshot still tracks changes")
        for record in self._records:
            check(len(record.keys) == len(record.parent_keys) == KEY_BYTES * len(record.roots)
                  == KEY_BYTES * len(record.tiers), "a snapshot record is ragged")
