"""What a connector worker counts; reported through vLLM's KV connector
stats (kvd.connectors.vllm.connector.KvdConnectorStats)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass
class Counters:
    """Counted from the model's thread and the connector's own threads (asynchronous loads, saves):
    every change goes through `add`, under the lock `take` holds, so none is lost between the two."""

    loaded_blocks: int = 0  # blocks loaded into the engine, every layer landed
    loaded_tokens: int = 0  # their tokens: what vLLM did not compute (its own counts include failed loads)
    async_loads: int = 0  # requests whose hit was loaded while vLLM ran other requests
    load_errors: int = 0  # blocks reported to vLLM as not loaded (it recomputes them)
    recomputed_tokens: int = 0  # their tokens
    corrupt_blocks: int = 0  # of those, blocks after a block kvd found corrupt (failed its checksum)
    saved_blocks: int = 0  # blocks committed to kvd
    saved_tokens: int = 0  # their tokens
    save_errors: int = 0  # reservations or commits that failed (the blocks are not stored)
    load_wait_s: float = 0.0  # time the model's layers waited for loaded bytes
    cut_loads: int = 0  # loads cut past their budget (prefill_profile): vLLM computed their blocks
    declined_blocks: int = 0  # hit blocks the load rule (prefill_profile) left to vLLM: computing was sooner
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, **amounts: float) -> None:
        with self._lock:
            for name, amount in amounts.items():
                setattr(self, name, getattr(self, name) + amount)

    def take(self, totals: dict[str, Any]) -> dict[str, Any]:
        """The counts since the last take, zeroing them and adding them to `totals`."""
        with self._lock:
            values = {item.name: getattr(self, item.name) for item in fields(self) if not item.name.startswith("_")}
            for name, value in values.items():
                setattr(self, name, type(value)())
                totals[name] = totals.get(name, 0) + value
        return values
