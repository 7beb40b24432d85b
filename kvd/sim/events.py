"""Simulated time and the events that move it.

Time is an integer count of microseconds that only the event queue moves;
the engine sees it, in milliseconds, as the injected `ManualClock`. Events
at one instant run in the order they were scheduled (a sequence number
breaks ties), so a seed gives the same run, event for event, everywhere.
"""

from __future__ import annotations

import enum
import heapq

from kvd.clock import ManualClock
from kvd.invariants import check


class EventKind(enum.IntEnum):
    ARRIVAL = 1
    DISK_DONE = 2
    PREFILL_DONE = 3
    DECODE_DONE = 4
    STARVED_TIMEOUT = 5
    DURABLE_TIMEOUT = 6
    GET = 7


class Timeline:
    """The simulated clock and the events queued on it."""

    def __init__(self) -> None:
        self.clock = ManualClock(0)
        self.now_us = 0
        self._events: list[tuple[int, int, EventKind, object]] = []
        self._sequence = 0

    def __len__(self) -> int:
        return len(self._events)

    def schedule(self, time_us: int, kind: EventKind, payload: object) -> None:
        check(time_us >= self.now_us, "an event scheduled in the past")
        heapq.heappush(self._events, (time_us, self._sequence, kind, payload))
        self._sequence += 1

    def pop(self) -> tuple[int, EventKind, object]:
        """The next event: its time, kind and payload (time does not move until `advance`)."""
        time_us, _, kind, payload = heapq.heappop(self._events)
        return time_us, kind, payload

    def advance(self, time_us: int) -> int:
        """Move time forward to `time_us`; the clock's new time in milliseconds."""
        check(time_us >= self.now_us, "simulated time went back")
        self.now_us = time_us
        self.clock.advance(time_us // 1000 - self.clock.now_ms())
        return self.clock.now_ms()
