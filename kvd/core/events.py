"""The KV event log: what a KV-aware router needs to mirror a namespace.

Every change to the set of blocks a namespace serves, and to the tier each
is served from, is one of three events:

    STORED        keys sealed: a chain continuing parent_key (b"": keys[0]
                  is a root), served from `tier` (HOST; DISK when recovered)
    REMOVED       keys no longer served by any tier (deleted, evicted from
                  the last tier holding them, lost to corruption)
    TIER_CHANGED  keys now served from `tier` (demoted to DISK when their
                  host copy was evicted, promoted to HOST by a Get)

"Served from" is what Lookup reports (`Engine.tier_of`). So applying a
namespace's events from sequence 1 to an empty map, or from a snapshot's
sequence + 1 to that snapshot, gives exactly the blocks Lookup finds, with
the tiers Lookup reports.

Batching. The engine appends keys to the *open* event for as long as
consecutive changes share namespace, kind and tier (and, for STORED,
continue the open chain); anything else closes it. A commit of 100 blocks
is one event, an eviction that frees 50 slots one event. An event holds at
most `max_event_keys` keys, so it fits in one gRPC message; a longer run
goes on in a new event (a STORED continuation's parent is the previous
event's last key).

Sequence numbers. An event is numbered when it is closed (published): per
namespace, from 1, consecutive, never reused within one daemon instance.
Readers (`read`, `last_sequence`, `first_sequence`) close the open event
first, so they never miss a change the engine has made. `listener`, if
set, is called whenever an event opens; the daemon uses it to publish once
per event-loop turn and wake its subscribers.

Memory. Published events stay in one ring shared by every namespace,
bounded by `ring_events` events and `ring_keys` keys; the oldest go first.
A reader whose next event has left the ring must resynchronise from a
snapshot. Subscribers are cursors into the ring, so a subscriber costs
nothing per event, and however slow it is it holds no event in memory.

Tracking. A snapshot built over several event-loop steps
(kvd.core.event_snapshot) must learn every key of its namespace that
changes meanwhile, whether or not the event stays in the ring: `track`
gives it a `KeyTracker` that every append for that namespace adds its keys
to, until `untrack`.

Cost: the engine pays a call and a list append per changed block where it
already handles that block, and one list per batch; with no tracker, one
more test of an empty dict per call.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvd.invariants import check

# Keys per event: 4096 keys are about 140 KB on the wire.
MAX_EVENT_KEYS = 4096
RING_EVENTS_DEFAULT = 65536
RING_KEYS_DEFAULT = 262144


class EventKind(enum.IntEnum):
    """Values match kvd.v1.KvEventKind."""

    STORED = 1
    REMOVED = 2
    TIER_CHANGED = 3


@dataclass(slots=True, eq=False)
class Event:
    namespace_id: bytes
    kind: EventKind
    # A kvd.core.engine.TierId value for STORED and TIER_CHANGED; 0 for REMOVED.
    tier: int
    # STORED: key of the block before keys[0]; b"" when keys[0] is a root.
    parent_key: bytes
    keys: list[bytes] = field(default_factory=list)
    # 0 while the event is open; immutable once numbered.
    sequence: int = 0


class KeyTracker:
    """The keys of one namespace that events named since tracking began (or since `take`)."""

    __slots__ = ("namespace_id", "keys")

    def __init__(self, namespace_id: bytes) -> None:
        self.namespace_id = namespace_id
        # Insertion-ordered, so whoever walks them does so in a fixed order.
        self.keys: dict[bytes, None] = {}

    def take(self) -> dict[bytes, None]:
        """The keys noted so far; noting starts again from none."""
        keys, self.keys = self.keys, {}
        return keys


@dataclass(slots=True, eq=False)
class _Stream:
    """One namespace's numbering and its events still in the ring."""

    events: deque[Event] = field(default_factory=deque)
    last_sequence: int = 0


class EventLog:
    def __init__(
        self,
        ring_events: int = RING_EVENTS_DEFAULT,
        ring_keys: int = RING_KEYS_DEFAULT,
        max_event_keys: int = MAX_EVENT_KEYS,
    ) -> None:
        check(ring_events > 0 and ring_keys > 0 and max_event_keys > 0, "event ring needs room")
        self.ring_events = ring_events
        self.ring_keys = ring_keys
        # One event never holds more keys than the whole ring may.
        self.max_event_keys = min(max_event_keys, ring_keys)
        self.listener: Callable[[], None] | None = None
        self._streams: dict[bytes, _Stream] = {}
        # The stream of each retained event, oldest first: the ring's order.
        self._ring: deque[_Stream] = deque()
        self._ring_key_count = 0
        self._open: Event | None = None
        # Published events and keys by kind (index: EventKind value).
        self.published_events = [0] * (len(EventKind) + 1)
        self.published_keys = [0] * (len(EventKind) + 1)
        # Events that left the ring to make room.
        self.trimmed_events = 0
        # Per namespace, the trackers told of each key an append names.
        self._trackers: dict[bytes, list[KeyTracker]] = {}

    # ------------------------------------------------------------------
    # Appending: called by the engine where a block changes

    def stored(self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes, tier: int) -> None:
        """`keys`, a chain continuing `parent_key`, are now served from `tier`."""
        if not keys:
            return
        if self._trackers:
            self._note(namespace_id, keys)
        event = self._open
        if (
            event is None
            or event.kind is not EventKind.STORED
            or event.tier != tier
            or event.keys[-1] != parent_key
            or event.namespace_id != namespace_id
        ):
            event = self._start(namespace_id, EventKind.STORED, tier, parent_key)
        room = self.max_event_keys - len(event.keys)
        if len(keys) <= room:
            event.keys.extend(keys)
            return
        event.keys.extend(keys[:room])
        for start in range(room, len(keys), self.max_event_keys):
            event = self._start(namespace_id, EventKind.STORED, tier, event.keys[-1])
            event.keys.extend(keys[start : start + self.max_event_keys])

    def removed(self, namespace_id: bytes, key: bytes) -> None:
        """The block `key` is no longer served by any tier."""
        if self._trackers:
            self._note(namespace_id, (key,))
        event = self._open
        if (
            event is None
            or event.kind is not EventKind.REMOVED
            or len(event.keys) >= self.max_event_keys
            or event.namespace_id != namespace_id
        ):
            event = self._start(namespace_id, EventKind.REMOVED, 0, b"")
        event.keys.append(key)

    def tier_changed(self, namespace_id: bytes, key: bytes, tier: int) -> None:
        """The block `key` is now served from `tier`."""
        if self._trackers:
            self._note(namespace_id, (key,))
        event = self._open
        if (
            event is None
            or event.kind is not EventKind.TIER_CHANGED
            or event.tier != tier
            or len(event.keys) >= self.max_event_keys
            or event.namespace_id != namespace_id
        ):
            event = self._start(namespace_id, EventKind.TIER_CHANGED, tier, b"")
        event.keys.append(key)

    def _note(self, namespace_id: bytes, keys: Sequence[bytes]) -> None:
        for tracker in self._trackers.get(namespace_id, ()):
            noted = tracker.keys
            for key in keys:
                noted[key] = None

    def _start(self, namespace_id: bytes, kind: EventKind, tier: int, parent_key: bytes) -> Event:
        self.flush()
        # Before the new event exists: a listener that flushes at once
        # must not publish it empty.
        if self.listener is not None:
            self.listener()
        event = Event(namespace_id, kind, tier, parent_key)
        self._open = event
        return event

    def flush(self) -> None:
        """Number and publish the open event, trimming the ring to its bounds."""
        event = self._open
        if event is None:
            return
        self._open = None
        check(bool(event.keys), "an empty event was opened")
        stream = self._streams.get(event.namespace_id)
        if stream is None:
            stream = self._streams[event.namespace_id] = _Stream()
        stream.last_sequence += 1
        event.sequence = stream.last_sequence
        stream.events.append(event)
        self._ring.append(stream)
        self._ring_key_count += len(event.keys)
        self.published_events[event.kind] += 1
        self.published_keys[event.kind] += len(event.keys)
        while len(self._ring) > self.ring_events or self._ring_key_count > self.ring_keys:
            oldest = self._ring.popleft().events.popleft()
            self._ring_key_count -= len(oldest.keys)
            self.trimmed_events += 1

    # ------------------------------------------------------------------
    # Reading: subscribers and snapshots

    def last_sequence(self, namespace_id: bytes) -> int:
        """Number of the namespace's newest event (0: none yet)."""
        self.flush()
        stream = self._streams.get(namespace_id)
        return stream.last_sequence if stream is not None else 0

    def first_sequence(self, namespace_id: bytes) -> int:
        """Number of the namespace's oldest event still in the ring (last + 1 if none is)."""
        self.flush()
        stream = self._streams.get(namespace_id)
        if stream is None:
            return 1
        return stream.events[0].sequence if stream.events else stream.last_sequence + 1

    def read(self, namespace_id: bytes, next_sequence: int, limit: int) -> list[Event] | None:
        """Up to `limit` published events numbered from `next_sequence` on.

        [] when there is none yet; None when event `next_sequence` has left
        the ring, so the reader must resynchronise.
        """
        self.flush()
        stream = self._streams.get(namespace_id)
        last = stream.last_sequence if stream is not None else 0
        check(1 <= next_sequence <= last + 1, "read from {}, but the newest event is {}", next_sequence, last)
        if next_sequence > last:
            return []
        events = stream.events
        if not events or next_sequence < events[0].sequence:
            return None
        start = next_sequence - events[0].sequence
        # Indexing a deque walks from its nearer end: a subscriber that keeps
        # up reads near the tail in O(1), whatever the ring holds.
        return [events[position] for position in range(start, min(start + limit, len(events)))]

    def track(self, namespace_id: bytes) -> KeyTracker:
        """A tracker of the keys every append for the namespace names from now on."""
        tracker = KeyTracker(namespace_id)
        self._trackers.setdefault(namespace_id, []).append(tracker)
        return tracker

    def untrack(self, tracker: KeyTracker) -> None:
        """Stop telling `tracker` (idempotent)."""
        trackers = self._trackers.get(tracker.namespace_id, [])
        if tracker in trackers:
            trackers.remove(tracker)
            if not trackers:
                del self._trackers[tracker.namespace_id]

    def tracking(self, tracker: KeyTracker) -> bool:
        return tracker in self._trackers.get(tracker.namespace_id, ())

    @property
    def open_key_count(self) -> int:
        return len(self._open.keys) if self._open is not None else 0

    @property
    def retained_keys(self) -> int:
        return self._ring_key_count

    def verify(self) -> None:
        check(len(self._ring) <= self.ring_events and self._ring_key_count <= self.ring_keys, "event ring over its bounds")
        held = {id(stream): 0 for stream in self._streams.values()}
        for stream in self._ring:
            check(id(stream) in held, "ring entry of an unknown stream")
            held[id(stream)] += 1
        keys = 0
        for stream in self._streams.values():
            check(held[id(stream)] == len(stream.events), "ring order disagrees with a stream")
            expected = stream.last_sequence - len(stream.events) + 1
            for event in stream.events:
                check(event.sequence == expected, "event {} where {} was due", event.sequence, expected)
                check(0 < len(event.keys) <= self.max_event_keys, "event {} has {} keys",
                      event.sequence, len(event.keys))
                expected += 1
                keys += len(event.keys)
        check(keys == self._ring_key_count, "ring key count drifted")
        if self._open is not None:
            check(self._open.sequence == 0 and len(self._open.keys) <= self.max_event_keys, "open event malformed")
        for namespace_id, trackers in self._trackers.items():
            check(bool(trackers) and all(tracker.namespace_id == namespace_id for tracker in trackers),
                  "a tracker filed under another namespace")
