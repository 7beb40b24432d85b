"""Faults injected into the modelled devices: block writes that fail and block reads that come
back corrupt, each with the configured probability.

They are drawn from a source of their own (seeded with the run's seed), apart from the trace,
which every policy of a sweep shares, so a run with faults sees the same requests as one without.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvd.core.transfer import Transfer


class Faults:
    def __init__(self, rate: float, seed: int) -> None:
        self.rate = rate
        self._draws = random.Random(seed)

    def _fails(self) -> bool:
        return self.rate > 0 and self._draws.random() < self.rate

    def failing_writes(self, writes: Sequence[Transfer]) -> set[bytes]:
        """The keys of the blocks whose write fails (one draw per write, in order)."""
        return {write.block.key for write in writes if self._fails()}

    def corrupt_loads(self, loads: Sequence[Transfer]) -> set[int]:
        """The source slots of the loads that read back corrupt (one draw per load, in order)."""
        return {load.source_slot for load in loads if self._fails()}
