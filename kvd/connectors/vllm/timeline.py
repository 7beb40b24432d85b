"""Per-layer timelines of the connector's steps (the `timeline` option).

Off by default: then every call here is one attribute test. When a
directory is named, each worker appends one JSON line per step that loaded
or saved anything to <directory>/worker<shard>.jsonl, and the scheduler
side one per scheduler step that looked anything up to scheduler.jsonl:

    {"step": 12, "start_ns": ..., "events": [[what, layer, t0_us, t1_us], ...]}

with times in microseconds from the step's start (time.perf_counter_ns).
What is recorded, in vLLM's call order: `open` (a layer-streaming Get
started, up to its first message), `landed` (the daemon said a layer of a
load is in the arena: an instant, from the stream's reader thread), `wait`
(a layer waited for its loaded bytes, the copy into the engine included),
`copy_in` (that copy alone), `save` (a layer's new blocks copied out),
`reserve` (the step's saves waited for their slots), `drain` (the step's
end waited for the copy thread), `close` (loads
ended, their leases given back), `commit` (saves committed). The layer's
own compute is what lies between its `wait` and its `save`, and between
its `save` and the next layer's `wait` (bench/plot_timeline.py draws it).
The scheduler side records `lookup` (a new request's Lookup, and with a
prefill profile the choice of what to load; its "layer" field is the
number of blocks it chose to load).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path


class Timeline:
    def __init__(self, directory: str | None, name: str) -> None:
        self.on = directory is not None
        self._path = Path(directory) / f"{name}.jsonl" if directory is not None else None
        if self._path is not None:
            self._path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._steps = 0
        self._start = time.perf_counter_ns()
        self._events: list[list] = []

    def begin_step(self) -> None:
        if self.on:
            with self._lock:
                self._steps += 1
                self._start, self._events = time.perf_counter_ns(), []

    def mark(self, what: str, layer: int = -1, began_ns: int | None = None) -> None:
        """An event that ends now (an instant unless began_ns says when it began)."""
        if self.on:
            now = time.perf_counter_ns()
            with self._lock:
                self._events.append([what, layer, self._us(began_ns or now), self._us(now)])

    @contextlib.contextmanager
    def span(self, what: str, layer: int = -1) -> Iterator[None]:
        began = time.perf_counter_ns() if self.on else 0
        try:
            yield
        finally:
            self.mark(what, layer, began)

    def end_step(self) -> None:
        """Writes the step's line if it did anything kvd-related."""
        if not self.on:
            return
        with self._lock:
            events, self._events = self._events, []
            line = {"step": self._steps, "start_ns": self._start, "events": events}
        if events:
            with open(self._path, "a") as sink:
                sink.write(json.dumps(line) + "\n")

    def _us(self, ns: int) -> float:
        return round((ns - self._start) / 1e3, 1)
