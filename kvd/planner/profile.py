"""What the planner believes about a model on a GPU, corrected by what the engine observes.

Per-layer decode compute is OrbitFlow's linear fit in the batch's total context, A * tokens + B
seconds, times a correction the engine's step reports keep up to date with an exponentially
weighted average (weight `alpha` on the newest report); the host-to-GPU bandwidth is averaged the
same way from the transfers the engine timed. A report whose step took more than `mismatch` away
from the prediction asks for a new plan (OrbitFlow re-plans on model/measurement mismatch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepProfile:
    layers: int
    base_s: float               # B: per-layer compute of an empty batch
    per_token_s: float          # A: what each token of the batch's context adds to a layer
    bandwidth_bps: float        # host-to-GPU link, as averaged from reports
    alpha: float = 0.2
    mismatch: float = 0.1
    compute_scale: float = 1.0  # observed / modelled compute, as averaged from reports
    reports: int = 0

    def __post_init__(self) -> None:
        if self.layers < 1 or self.base_s <= 0 or self.per_token_s < 0 or self.bandwidth_bps <= 0:
            raise ValueError("a profile needs layers, a positive base time and bandwidth, a non-negative slope")
        if not 0 < self.alpha <= 1 or self.mismatch <= 0:
            raise ValueError("alpha is in (0, 1] and the mismatch threshold is positive")

    def compute_s(self, total_tokens: int) -> tuple[float, ...]:
        """Per-layer compute seconds for a decode step over `total_tokens` of context."""
        layer = (self.base_s + self.per_token_s * total_tokens) * self.compute_scale
        return (layer,) * self.layers

    def observe(self, predicted_s: float, observed_s: float, *, moved_bytes: int = 0,
                transfer_s: float = 0.0) -> bool:
        """Fold one step's report in (predicted_s: what this profile predicted for it); whether the
        engine should re-plan now."""
        if predicted_s <= 0 or observed_s <= 0:
            raise ValueError("step times are positive")
        self.compute_scale += self.alpha * (self.compute_scale * observed_s / predicted_s - self.compute_scale)
        if moved_bytes > 0 and transfer_s > 0:
            self.bandwidth_bps += self.alpha * (moved_bytes / transfer_s - self.bandwidth_bps)
        self.reports += 1
        return abs(observed_s / predicted_s - 1) > self.mismatch
