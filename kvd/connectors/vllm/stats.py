"""What a connector worker counts; reported through vLLM's KV connector
stats (kvd.connectors.vllm.connector.KvdConnectorStats)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class Counters:
    loaded_blocks: int = 0  # blocks loaded into the engine, every layer landed
    async_loads: int = 0  # requests whose hit was loaded while vLLM ran other requests
    load_errors: int = 0  # blocks reported to vLLM as not loaded (it recomputes them)
    saved_blocks: int = 0  # blocks committed to kvd
    save_errors: int = 0  # reservations or commits that failed (the blocks are not stored)
    load_wait_s: float = 0.0  # time the model's layers waited for loaded bytes

    def take(self, totals: dict[str, Any]) -> dict[str, Any]:
        """The counts since the last take, zeroing them and adding them to `totals`."""
        values = asdict(self)
        for item in fields(self):
            setattr(self, item.name, type(getattr(self, item.name))())
            totals[item.name] = totals.get(item.name, 0) + values[item.name]
        return values
