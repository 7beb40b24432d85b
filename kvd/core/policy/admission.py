"""Frequency-based admission to the disk tier: write only blocks seen at
least `min_hits` times, so blocks nobody asks for again never cost SSD
writes (an SSD's endurance is a budget of bytes written).

A sighting is the Put that seals a block, a Get that serves it,
or a Put that finds it already stored (EXISTS). A Lookup is not one: an
engine's scheduler may ask "how much is cached?" many times for one request
(vLLM asks again each step until the request is scheduled), and a Lookup
followed by its Get would count twice for one use. `min_hits = 1` admits
everything and counts nothing: the filter is off.

The engine asks once, when a block is sealed, and again whenever a sighting
makes a block's estimate reach `min_hits` (`record_many` reports those).
A block the filter turned away stays in host memory only; when host
eviction takes it, it is dropped like any dirty block, and counted.

Counts live in a count-min sketch: ROWS rows of `width` one-byte saturating
counters. The block key is already a SHA-256 digest, so its four 64-bit
words are four independent hashes; nothing is hashed here. A key's estimate
is the minimum of its counters: never below its (aged) count, sometimes
above it when every row collides, which admits a block early and never
turns one away wrongly. A batch that puts two keys in one counter raises
it once, not twice: still no lower than either key's own count.

Aging (TinyLFU's reset): every `width // 4` sightings all counters are
halved, so the sightings must come within a recent window, a counter of 1
(one sighting long ago) falls to 0, and the load stays low enough that
collisions in all four rows are rare: with a steady stream of blocks each
seen once, under 0.1% of new blocks read as seen twice
(tests/unit/test_admission.py asserts under 5%).

Memory is fixed when the filter is made, ROWS x width bytes, and nothing is
kept per block. `for_slots` sizes the sketch so that the aging window is
twice the disk tier's slots in sightings: 256 KiB for 8,192 slots, 16 MiB
at most.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvd.invariants import check

ROWS = 4  # one per 64-bit word of a 32-byte key
COUNTER_MAX = 255
WIDTH_MIN = 1 << 10
WIDTH_MAX = 1 << 22  # 16 MiB of counters at most
WIDTH_PER_SLOT = 8


class AdmissionFilter:
    def __init__(self, min_hits: int, width: int = WIDTH_MIN) -> None:
        check(1 <= min_hits <= COUNTER_MAX, f"admission min_hits {min_hits} outside 1..{COUNTER_MAX}")
        check(width >= 16 and width & (width - 1) == 0, f"sketch width {width} is not a power of two >= 16")
        self.min_hits = min_hits
        self.active = min_hits > 1
        # Nothing is allocated while the filter is off.
        self.width = width if self.active else 0
        self.aging_interval = width // 4
        self.sightings = 0  # since the last aging
        self.agings = 0
        self._mask = width - 1
        self._table = np.zeros(ROWS * self.width, dtype=np.uint8)
        self._row_offsets = np.arange(ROWS, dtype=np.uint64) * np.uint64(self.width)
        # The same bytes, for one key at a time without numpy's per-call cost.
        self._cells = memoryview(self._table)

    @classmethod
    def for_slots(cls, min_hits: int, slot_count: int) -> AdmissionFilter:
        """A filter whose aging window is about two disk tiers' worth of sightings."""
        width = 1 << max(0, WIDTH_PER_SLOT * slot_count - 1).bit_length()
        return cls(min_hits, min(max(width, WIDTH_MIN), WIDTH_MAX))

    def _cells_of(self, key: bytes) -> list[int]:
        mask, width = self._mask, self.width
        return [row * width + (int.from_bytes(key[8 * row : 8 * row + 8], "little") & mask) for row in range(ROWS)]

    def estimate(self, key: bytes) -> int:
        cells = self._cells
        return min(cells[cell] for cell in self._cells_of(key)) if self.active else 0

    def admits(self, key: bytes) -> bool:
        return not self.active or self.estimate(key) >= self.min_hits

    def record(self, key: bytes) -> bool:
        """One sighting of `key`; whether it is admitted now."""
        if not self.active:
            return True
        cells = self._cells
        estimate = COUNTER_MAX
        for cell in self._cells_of(key):
            value = cells[cell]
            if value < COUNTER_MAX:
                value += 1
                cells[cell] = value
            estimate = min(estimate, value)
        self._age(1)
        return estimate >= self.min_hits

    def record_many(self, keys: Sequence[bytes]) -> list[int]:
        """One sighting of each (distinct) key; positions of the keys this
        made admissible (estimate below min_hits before, at least after)."""
        if not self.active or not keys:
            return []
        words = np.frombuffer(b"".join(keys), dtype="<u8").reshape(len(keys), ROWS)
        cells = (words & np.uint64(self._mask)) + self._row_offsets
        before = self._table[cells]
        after = np.minimum(before, COUNTER_MAX - 1) + 1
        self._table[cells] = after
        self._age(len(keys))
        crossed = (before.min(axis=1) < self.min_hits) & (after.min(axis=1) >= self.min_hits)
        return np.flatnonzero(crossed).tolist()

    def _age(self, sightings: int) -> None:
        halvings, self.sightings = divmod(self.sightings + sightings, self.aging_interval)
        if halvings:
            # Eight halvings empty a one-byte counter: a larger shift is no different.
            np.right_shift(self._table, min(halvings, 8), out=self._table)
            self.agings += halvings

    def verify(self) -> None:
        check(self._table.size == ROWS * self.width, "sketch size changed")
        check(0 <= self.sightings < max(1, self.aging_interval), "{} sightings since aging", self.sightings)
