"""How long a hit would take to load, from what kvd measured and what is queued (issue 38).

A hit is worth loading only if it arrives sooner than the engine could compute it again, and that
depends on the moment: a drive busy with other requests' restores serves this one later, a slow
or shared drive serves it slower. kvd knows both: the bytes queued for the drives ahead of a new
read, and the rate its recent reads ran at. `load_seconds` turns them into, per matched block,
the seconds until it and every block before it could be in kvd's host memory; a caller (the
vLLM connector's scheduler, a KV-aware router) adds its own copy into the engine and weighs the
result against recomputing.

    rates = {TIER_DISK: disk_meter.bytes_per_s, TIER_REMOTE: fetch_meter.bytes_per_s}
    load_seconds(tiers, block_bytes, queued_bytes={TIER_DISK: queued}, rates=rates)

Pure: no clock of its own, no I/O; the daemon and the tests feed it the same way (each transfer
with the time it ended, on the caller's clock).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from kvd.invariants import check

# A transfer's weight halves with every this many bytes moved after it, and with every
# HALF_LIFE_S seconds between it and the latest one: the rate follows the last few hundred MiB or
# the last seconds, whichever is less. Bytes alone would leave a drive that slowed down (another
# tenant's restores, a throttle) looking fast for long: at 12 MiB/s, 256 MiB take 20 s to move.
HALF_LIFE_BYTES = 256 << 20
HALF_LIFE_S = 1.0


class RateMeter:
    """Bytes per second of one kind of transfer: the ratio of decayed sums of bytes and seconds,
    each transfer weighing 2 ** -(bytes moved after it / half_life_bytes + seconds from its end to
    the latest transfer's / half_life_s). With no transfer since, the rate stays what the last
    ones said. Written by one thread, read by any: the state is one tuple, replaced whole."""

    def __init__(self, half_life_bytes: int = HALF_LIFE_BYTES, half_life_s: float = HALF_LIFE_S) -> None:
        check(half_life_bytes > 0 and half_life_s > 0, "half-lives of {} bytes and {} s", half_life_bytes,
              half_life_s)
        self.half_life_bytes, self.half_life_s = half_life_bytes, half_life_s
        self._sums: tuple[float, float, float | None] = (0.0, 0.0, None)  # (bytes, seconds) decayed; last end

    def add(self, nbytes: int, seconds: float, ended: float) -> None:
        """A transfer of nbytes that took `seconds` and ended at `ended` (the caller's monotonic clock)."""
        if nbytes <= 0 or not seconds > 0:
            return  # nothing moved, or no time measured: no evidence of a rate
        moved, spent, last = self._sums
        since = 0.0 if last is None else max(ended - last, 0.0)
        decay = 0.5 ** (nbytes / self.half_life_bytes + since / self.half_life_s)
        self._sums = (moved * decay + nbytes, spent * decay + seconds, ended if last is None else max(ended, last))

    @property
    def bytes_per_s(self) -> float | None:
        """None until a transfer was measured."""
        moved, spent, _ = self._sums
        return moved / spent if spent > 0 else None


def load_seconds(tiers: bytes, block_bytes: int, queued_bytes: Mapping[int, int],
                 rates: Mapping[int, float | None]) -> np.ndarray:
    """Per block of a matched prefix (its tier in `tiers`, one byte each as in a Lookup): the
    seconds until it and every block before it could be in host memory. A block of a tier with a
    rate in `rates` costs block_bytes at that rate, after the bytes queued for that tier
    (`queued_bytes`, once per tier, before its first block); a tier not in `rates` (host memory,
    the device tier) costs nothing; a tier whose rate is None (not measured yet) makes that block
    and every later one NaN: unknown."""
    cost = np.zeros(len(tiers), dtype=np.float64)
    levels = np.frombuffer(tiers, dtype=np.uint8)
    for tier, rate in rates.items():
        rows = np.nonzero(levels == tier)[0]
        if not rows.size:
            continue
        if rate is None or not math.isfinite(rate) or rate <= 0:
            cost[rows] = np.nan
            continue
        cost[rows] = block_bytes / rate
        cost[rows[0]] += queued_bytes.get(tier, 0) / rate
    return np.cumsum(cost).astype(np.float32)
