"""KV events on the client side: watches, snapshots and a mirror of a namespace.

A KV-aware router keeps, for each kvd it routes to, which blocks it holds
and in which tier. Without gaps:

    with Client(target) as client:
        mirror = BlockMirror(client.event_snapshot(ns))
        with client.watch_events(ns, mirror.sequence + 1, mirror.instance_id) as watch:
            for event in watch:
                mirror.apply(event)   # mirror.tiers: key -> kvd.v1.Tier value

`ResyncRequired` (raised by the watch, or by `mirror.apply` on a gap or an
event that does not fit) means: take a new snapshot and watch from its
sequence + 1. The daemon asks for it when the events a subscriber needs
have left its bounded ring (a resume from too old a sequence, or a
subscriber too slow to keep up) and when it is another daemon instance
than the one the sequence numbers came from (it restarted). When the
daemon drains (SIGTERM) the watch ends with gRPC status UNAVAILABLE.

Event kinds and what they mean are in kvd/core/events.py and the proto.
The watch and snapshot logic lives here once; the blocking and asyncio
clients only differ in how they read the stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc

from kvd.client._wire import Namespace
from kvd.core.events import EventKind
from kvd.v1 import kvd_pb2

__all__ = ["AsyncEventWatch", "BlockMirror", "EventKind", "EventSnapshot", "EventWatch", "KvEvent", "ResyncRequired"]


@dataclass(frozen=True, slots=True)
class KvEvent:
    kind: EventKind
    # Per namespace, from 1, consecutive within one daemon instance.
    sequence: int
    # STORED: a chain, in order. REMOVED, TIER_CHANGED: any order.
    keys: list[bytes]
    # STORED: key of the block before keys[0]; b"" when keys[0] is a root.
    parent_key: bytes
    # STORED, TIER_CHANGED: the kvd.v1.Tier the keys are now served from.
    tier: int


class ResyncRequired(Exception):
    """Events were missed: take a new snapshot and watch from its sequence + 1."""

    def __init__(self, reason: str, sequence: int, instance_id: str) -> None:
        super().__init__(f"resynchronise from a new snapshot: {reason} (daemon's newest event {sequence})")
        self.reason = reason
        self.sequence = sequence
        self.instance_id = instance_id


@dataclass(slots=True)
class EventSnapshot:
    """The blocks a namespace serves, right after event `sequence`."""

    instance_id: str
    sequence: int
    # Parents before children; parent_keys[i] is b"" for a root block.
    keys: list[bytes]
    parent_keys: list[bytes]
    # One kvd.v1.Tier value per key.
    tiers: bytes


class BlockMirror:
    """A subscriber's copy of one namespace: key -> tier, kept current by events.

    Every event is checked against what the mirror holds (no gap in the
    sequence, a stored key is new and its parent known, a removed or moved
    key is present); one that does not fit raises ResyncRequired.
    """

    def __init__(self, snapshot: EventSnapshot) -> None:
        self.instance_id = snapshot.instance_id
        self.sequence = snapshot.sequence
        self.tiers: dict[bytes, int] = dict(zip(snapshot.keys, snapshot.tiers))
        self.parents: dict[bytes, bytes] = dict(zip(snapshot.keys, snapshot.parent_keys))

    def apply(self, event: KvEvent) -> None:
        if event.sequence != self.sequence + 1:
            self._mismatch(f"event {event.sequence} follows event {self.sequence}")
        tiers = self.tiers
        if event.kind == EventKind.STORED:
            parent = event.parent_key
            if parent and parent not in tiers:
                self._mismatch(f"event {event.sequence} stores under unknown parent {parent.hex()[:16]}")
            for key in event.keys:
                if key in tiers:
                    self._mismatch(f"event {event.sequence} stores {key.hex()[:16]} twice")
                tiers[key] = event.tier
                self.parents[key] = parent
                parent = key
        elif event.kind in (EventKind.REMOVED, EventKind.TIER_CHANGED):
            if any(key not in tiers for key in event.keys):
                self._mismatch(f"event {event.sequence} names a key the mirror does not hold")
            if event.kind == EventKind.REMOVED:
                for key in event.keys:
                    del tiers[key]
                    del self.parents[key]
            else:
                for key in event.keys:
                    tiers[key] = event.tier
        self.sequence = event.sequence

    def _mismatch(self, reason: str):
        raise ResyncRequired(reason, self.sequence, self.instance_id)


# ----------------------------------------------------------------------
# Wire: shared by the blocking and the asyncio watch


def watch_request(namespace: Namespace, from_sequence: int, instance_id: str) -> kvd_pb2.WatchEventsRequest:
    if from_sequence < 0:
        raise ValueError(f"from_sequence must be >= 0, got {from_sequence}")
    return kvd_pb2.WatchEventsRequest(
        namespace_id=namespace.namespace_id, from_sequence=from_sequence, instance_id=instance_id
    )


def snapshot_request(namespace: Namespace) -> kvd_pb2.EventSnapshotRequest:
    return kvd_pb2.EventSnapshotRequest(namespace_id=namespace.namespace_id)


class SnapshotParts:
    """Collects the parts of one EventSnapshot stream."""

    def __init__(self) -> None:
        self._first: Any = None
        self._keys: list[bytes] = []
        self._parent_keys: list[bytes] = []
        self._tiers: list[bytes] = []

    def add(self, message: kvd_pb2.EventSnapshotResponse) -> None:
        if self._first is None:
            self._first = message
        elif (message.sequence, message.instance_id) != (self._first.sequence, self._first.instance_id):
            raise ValueError("the parts of one snapshot disagree on its sequence")
        self._keys.extend(message.keys)
        self._parent_keys.extend(message.parent_keys)
        self._tiers.append(message.tiers)

    def result(self) -> EventSnapshot:
        first = self._first
        tiers = b"".join(self._tiers)
        if first is None or not (len(self._keys) == len(self._parent_keys) == len(tiers) == first.block_count):
            raise ValueError("incomplete snapshot: the stream ended before its last part")
        return EventSnapshot(first.instance_id, first.sequence, self._keys, self._parent_keys, tiers)


class _Watch:
    """One WatchEvents stream: the subscription header, then events in order."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self.instance_id = ""
        # The last event delivered (at first: the one before the first to come).
        self.sequence = 0

    def _started(self, message: kvd_pb2.KvEvent) -> None:
        self._check_resync(message)
        if message.kind != kvd_pb2.KV_EVENT_KIND_WATCHING:
            raise ValueError(f"a watch began with event kind {message.kind}, not WATCHING")
        self.instance_id = message.instance_id
        self.sequence = message.sequence

    def _event(self, message: kvd_pb2.KvEvent) -> KvEvent:
        self._check_resync(message)
        event = KvEvent(EventKind(message.kind), message.sequence, list(message.keys), message.parent_key, message.tier)
        if event.sequence != self.sequence + 1:
            raise ResyncRequired(f"event {event.sequence} follows event {self.sequence}", event.sequence,
                                 self.instance_id)
        self.sequence = event.sequence
        return event

    @staticmethod
    def _check_resync(message: kvd_pb2.KvEvent) -> None:
        if message.kind == kvd_pb2.KV_EVENT_KIND_RESYNC_REQUIRED:
            reason = kvd_pb2.ResyncReason.Name(message.resync_reason)[len("RESYNC_REASON_"):].lower()
            raise ResyncRequired(reason, message.sequence, message.instance_id)


class EventWatch(_Watch):
    """A blocking watch: iterate for KvEvents; close() (or `with`) ends it."""

    def __init__(self, call: Any) -> None:
        super().__init__(call)
        try:
            message = next(call, None)
            if message is None:
                raise ValueError("a watch ended before its first message")
            self._started(message)
        except BaseException:
            call.cancel()
            raise

    def __iter__(self) -> EventWatch:
        return self

    def __next__(self) -> KvEvent:
        try:
            message = next(self._call)
        except BaseException:
            self._call.cancel()
            raise
        return self._event(message)

    def close(self) -> None:
        self._call.cancel()

    def __enter__(self) -> EventWatch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class AsyncEventWatch(_Watch):
    """The asyncio twin of EventWatch: `async for`, `await close()`, `async with`."""

    async def start(self) -> AsyncEventWatch:
        try:
            message = await self._call.read()
            if message is grpc.aio.EOF:
                raise ValueError("a watch ended before its first message")
            self._started(message)
        except BaseException:
            self._call.cancel()
            raise
        return self

    def __aiter__(self) -> AsyncEventWatch:
        return self

    async def __anext__(self) -> KvEvent:
        message = await self._call.read()
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        return self._event(message)

    async def close(self) -> None:
        self._call.cancel()

    async def __aenter__(self) -> AsyncEventWatch:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
