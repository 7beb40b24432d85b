"""KV events: WatchEvents streams and EventSnapshot, and their publication.

A part of kvd.server.service.KvdService (its handlers by concern); they share the
service's state and reach each other's helpers through self."""

from __future__ import annotations

import asyncio


from kvd.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvd.server import convert
from kvd.server.rpc import stream_rpc


# Events a subscriber takes from the ring at a time: what it holds while
# a slow client keeps it waiting (at most this many x MAX_EVENT_KEYS keys).
WATCH_READ_EVENTS = 8
# Blocks per EventSnapshot message (about 70 bytes each on the wire), and
# per step of its build (kvd.core.event_snapshot): each step and each
# message costs the event loop about the same, however many blocks the
# namespace holds.
SNAPSHOT_PART_BLOCKS = 4096
SNAPSHOT_STEP_BLOCKS = 4096


class EventHandlers:
    @stream_rpc("WatchEvents")
    async def WatchEvents(self, request, context):
        events = self.engine.events
        state = self.engine.namespace(request.namespace_id)
        # Events carry the id the client knows (a tenant's differs from the engine's).
        namespace_id, public_id = state.namespace_id, state.public_id
        if self._draining:
            raise Unavailable("kvd is draining; watch again once it is back, from a new snapshot")
        if self._subscribers >= self.max_subscribers:
            raise ResourceExhausted(f"too many event subscribers (max {self.max_subscribers}); close a watch first")
        last = events.last_sequence(namespace_id)
        if request.instance_id and request.instance_id != self.arena.instance_id:
            yield self._resync(public_id, last, "instance_changed")
            return
        if request.from_sequence > last + 1:
            raise InvalidArgument(
                f"from_sequence {request.from_sequence} is ahead of this namespace's newest event {last}; "
                f"watch from at most {last + 1}, or from 0 for new events only"
            )
        next_sequence = request.from_sequence or last + 1
        if next_sequence < events.first_sequence(namespace_id):
            yield self._resync(public_id, last, "sequence_too_old")
            return
        self._subscribe(+1)
        try:
            yield convert.watching_event(next_sequence - 1, public_id, self.arena.instance_id)
            while True:
                published = self._events_published
                if self._draining:
                    raise Unavailable("kvd is draining; watch again once it is back, from a new snapshot")
                batch = events.read(namespace_id, next_sequence, WATCH_READ_EVENTS)
                if batch is None:
                    yield self._resync(public_id, events.last_sequence(namespace_id), "subscriber_too_slow")
                    return
                if not batch:
                    await published.wait()
                    continue
                for event in batch:
                    yield convert.event_message(event, public_id)
                next_sequence = batch[-1].sequence + 1
        finally:
            self._subscribe(-1)

    @stream_rpc("EventSnapshot")
    async def EventSnapshot(self, request, context):
        engine = self.engine
        state = engine.namespace(request.namespace_id)
        # Built a bounded step at a time, the loop turning in between; exactly
        # the blocks served after event `build.sequence`, parents first.
        build = engine.event_snapshot(state.namespace_id, SNAPSHOT_STEP_BLOCKS)
        try:
            while not build.step():
                await asyncio.sleep(0)
        finally:
            build.close()
        for part in build.parts(SNAPSHOT_PART_BLOCKS):
            yield convert.event_snapshot_response(self.arena.instance_id, build.sequence, build.block_count, part)

    def _resync(self, namespace_id: bytes, sequence: int, reason: str):
        """The message that ends a watch: start over from a snapshot, for `reason` (sequence_too_old,
        subscriber_too_slow, instance_changed: kvd_event_resyncs_total's label)."""
        self.metrics.event_resyncs.labels(reason).inc()
        return convert.resync_event(namespace_id, sequence, reason, self.arena.instance_id)

    def _subscribe(self, change: int) -> None:
        self._subscribers += change
        self.metrics.event_subscribers.inc(change)
        # The engine calls back only while someone listens: without
        # subscribers events are published lazily, by the next reader.
        self.engine.events.listener = self._on_event_opened if self._subscribers else None

    def _on_event_opened(self) -> None:
        # Called inside an engine call, on the loop: publish once this turn
        # of the loop is over, so one turn's changes go out together.
        if not self._publish_scheduled:
            self._publish_scheduled = True
            asyncio.get_running_loop().call_soon(self._publish_events)

    def _publish_events(self) -> None:
        self._publish_scheduled = False
        self.engine.events.flush()
        published, self._events_published = self._events_published, asyncio.Event()
        published.set()
