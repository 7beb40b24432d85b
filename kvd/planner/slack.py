"""Tutti's slack profile: how much disk time each layer of a prefill leaves for writes.

A prefill that reuses a stored prefix reads the prefix's KV layer by layer
while the engine computes the new tokens layer by layer. Layer l's
attention needs layer l of the prefix, so the drive reads layer l + 1
while the engine computes layer l. Tutti profiles, per (input length,
prefix length) and layer, that compute time: the **window** layer l opens
for I/O. Whatever of it the next layer's read does not use is **slack**,
and a write that fits in it costs the prefill nothing:

    read_s(l)    = prefix_tokens * kv_bytes_per_token_layer / read_bps
    slack_s(l)   = max(0, compute_s(l) - read_s(l + 1))     (the last layer: its whole window)
    budget(l)    = slack_s(l) * write_bps                    bytes of writes

`SlackTable` holds the measured windows on a grid of (input, prefix)
lengths (kvd.planner.slack_measure measures a real model) and answers
windows and budgets anywhere on it, interpolating linearly in both
lengths. The disk I/O schedule sizes its write jobs with
`write_chunk_bytes`: the smallest budget of any layer of the prefill the
drive last restored, at the grid's shortest input (the least compute, so
the least slack), so a restore that arrives while a write runs waits no
longer than one layer's slack. While a restore runs, `layer_budgets` says
how many bytes of queued writes may go between its layer groups.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMAT = "kvd-slack-table/1"


@dataclass(frozen=True)
class SlackTable:
    model: str
    layers: int
    kv_bytes_per_token_layer: int   # K and V of one token in one layer
    inputs: tuple[int, ...]         # grid of new-token counts, ascending
    prefixes: tuple[int, ...]       # grid of reused-prefix lengths, ascending
    compute_s: np.ndarray = field(repr=False)  # [len(inputs), len(prefixes), layers] seconds
    device: str = ""                # where it was measured, in words

    def __post_init__(self) -> None:
        shape = (len(self.inputs), len(self.prefixes), self.layers)
        compute = np.asarray(self.compute_s, dtype=np.float64)
        if compute.shape != shape:
            raise ValueError(f"compute_s has shape {compute.shape}, the grid {shape}")
        if self.layers < 1 or self.kv_bytes_per_token_layer <= 0:
            raise ValueError("a slack table needs layers and a positive KV size per token")
        for name, grid in (("inputs", self.inputs), ("prefixes", self.prefixes)):
            if not grid or list(grid) != sorted(set(grid)) or grid[0] < 0:
                raise ValueError(f"{name} must be distinct non-negative lengths in ascending order, got {grid}")
        if not np.all(np.isfinite(compute)) or np.any(compute <= 0):
            raise ValueError("every measured window must be a positive number of seconds")
        object.__setattr__(self, "compute_s", compute)

    def windows(self, input_tokens: int, prefix_tokens: int) -> np.ndarray:
        """Per-layer compute seconds of a prefill of `input_tokens` new tokens after `prefix_tokens`
        reused ones (linear between grid points, held at the grid's edges)."""
        i, wi = _bracket(self.inputs, input_tokens)
        p, wp = _bracket(self.prefixes, prefix_tokens)
        grid = self.compute_s
        low = grid[i[0], p[0]] * (1 - wp) + grid[i[0], p[1]] * wp
        high = grid[i[1], p[0]] * (1 - wp) + grid[i[1], p[1]] * wp
        return low * (1 - wi) + high * wi

    def budgets(self, input_tokens: int, prefix_tokens: int, read_bps: float, write_bps: float,
                kv_bytes_per_token_layer: int | None = None, num_layers: int | None = None) -> np.ndarray:
        """Per-layer bytes of writes that fit in the layer's slack (see the module's formula).

        kv_bytes_per_token_layer and num_layers describe the blocks the drive reads when they are
        not the table's model's: the table's windows are then spread over `num_layers` layers with
        the prefill's total compute kept (a stand-in until the served model itself is profiled)."""
        if read_bps <= 0 or write_bps <= 0:
            raise ValueError("bandwidths must be positive")
        kv_bytes = self.kv_bytes_per_token_layer if kv_bytes_per_token_layer is None else kv_bytes_per_token_layer
        layers = self.layers if num_layers is None else num_layers
        if layers < 1:
            raise ValueError("a restore has at least one layer")
        window = self.windows(input_tokens, prefix_tokens)[np.arange(layers) * self.layers // layers]
        window = window * (self.layers / layers)
        next_read = np.full(layers, prefix_tokens * kv_bytes / read_bps)
        next_read[-1] = 0.0  # nothing to read behind the last layer
        return np.maximum(0.0, window - next_read) * write_bps

    def write_chunk_bytes(self, prefix_tokens: int, read_bps: float, write_bps: float,
                          kv_bytes_per_token_layer: int | None = None, num_layers: int | None = None) -> int:
        """A write job no restore of a `prefix_tokens` prefix notices: the least budget of any layer
        at the grid's shortest input."""
        return int(self.budgets(self.inputs[0], prefix_tokens, read_bps, write_bps, kv_bytes_per_token_layer,
                                num_layers).min())

    # ---- files
    def to_json(self) -> dict:
        return {"format": FORMAT, "model": self.model, "device": self.device, "layers": self.layers,
                "kv_bytes_per_token_layer": self.kv_bytes_per_token_layer, "inputs": list(self.inputs),
                "prefixes": list(self.prefixes), "compute_s": self.compute_s.tolist()}

    @classmethod
    def from_json(cls, data: dict) -> SlackTable:
        if data.get("format") != FORMAT:
            raise ValueError(f"not a slack table ({FORMAT}): format {data.get('format')!r}")
        try:
            return cls(str(data["model"]), int(data["layers"]), int(data["kv_bytes_per_token_layer"]),
                       tuple(int(n) for n in data["inputs"]), tuple(int(p) for p in data["prefixes"]),
                       np.asarray(data["compute_s"], dtype=np.float64), str(data.get("device", "")))
        except (KeyError, TypeError) as error:
            raise ValueError(f"a slack table without a valid {error}") from None

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: Path) -> SlackTable:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read the slack table {path}: {error}") from None
        return cls.from_json(data)


class WriteSizer:
    """Write-back job sizes for the disk I/O schedule, from a slack table and the drive as observed.

    The drive's read and write bandwidths are exponentially weighted averages of the jobs it ran
    (`observe`, with weight `alpha` on the newest); `restore` records the shape of the latest
    restore. `chunk_blocks` is then the table's write budget for such a restore in whole blocks,
    between 1 and `most`; until both bandwidths have been seen it is `default`.
    """

    def __init__(self, table: SlackTable, alpha: float = 0.2) -> None:
        if not 0 < alpha <= 1:
            raise ValueError("alpha is in (0, 1]")
        self.table = table
        self.alpha = alpha
        self.read_bps = 0.0
        self.write_bps = 0.0
        self.prefix_tokens = 0
        self.kv_bytes_per_token_layer = table.kv_bytes_per_token_layer
        self.num_layers: int | None = None

    def observe(self, reading: bool, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / seconds
        if reading:
            self.read_bps = rate if not self.read_bps else self.read_bps + self.alpha * (rate - self.read_bps)
        else:
            self.write_bps = rate if not self.write_bps else self.write_bps + self.alpha * (rate - self.write_bps)

    def restore(self, prefix_tokens: int, kv_bytes_per_token_layer: int, num_layers: int | None = None) -> None:
        self.prefix_tokens = prefix_tokens
        self.kv_bytes_per_token_layer = kv_bytes_per_token_layer
        self.num_layers = num_layers

    def layer_budgets(self, prefix_tokens: int, kv_bytes_per_token_layer: int, num_layers: int) -> np.ndarray | None:
        """Bytes of writes that fit in each of a restore's `num_layers` layers (SlackTable.budgets);
        None until both bandwidths have been seen."""
        if not (self.read_bps and self.write_bps):
            return None
        return self.table.budgets(self.table.inputs[0], prefix_tokens, self.read_bps, self.write_bps,
                                  kv_bytes_per_token_layer, num_layers)

    def chunk_blocks(self, block_bytes: int, default: int, most: int) -> int:
        if not (self.read_bps and self.write_bps):
            return default
        budget = self.table.write_chunk_bytes(self.prefix_tokens, self.read_bps, self.write_bps,
                                              self.kv_bytes_per_token_layer, self.num_layers)
        return max(1, min(most, budget // block_bytes))


def _bracket(grid: tuple[int, ...], value: float) -> tuple[tuple[int, int], float]:
    """The grid indexes around `value` and the weight of the upper one (held at the edges)."""
    if value <= grid[0]:
        return (0, 0), 0.0
    if value >= grid[-1]:
        last = len(grid) - 1
        return (last, last), 0.0
    upper = int(np.searchsorted(grid, value, side="right"))
    lower = upper - 1
    return (lower, upper), (value - grid[lower]) / (grid[upper] - grid[lower])
