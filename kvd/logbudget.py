"""Log lines within a budget: damage that repeats is logged, without flooding the log.

`LogBudget(log, lines=20, per_s=60)` lets 20 lines through per 60 s
window; the first line after a window in which some were held back says
how many were. Thread-safe (the disk tier logs from its I/O thread).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable


class LogBudget:
    def __init__(self, log: logging.Logger, lines: int, per_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._lines = lines
        self._per_s = per_s
        self._clock = clock
        self._lock = threading.Lock()
        self._window_start = -float("inf")
        self._used = 0
        self.suppressed = 0  # lines held back in the current window

    def warning(self, message: str, **kwargs) -> bool:
        """Log `message` at WARNING if the budget allows; whether it did."""
        with self._lock:
            now = self._clock()
            held_back = 0
            if now - self._window_start >= self._per_s:
                held_back, self.suppressed = self.suppressed, 0
                self._window_start, self._used = now, 0
            if self._used >= self._lines:
                self.suppressed += 1
                return False
            self._used += 1
        if held_back:
            self._log.warning("%d more such lines were held back in the last %.0f s", held_back, self._per_s)
        self._log.warning(message, **kwargs)
        return True
