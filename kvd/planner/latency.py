"""The step-latency model of layer-wise prefetch over one shared host-to-GPU link.

The system it models (tests/property/test_planner.py checks the model against a discrete-event
simulation of exactly this):

- a decode step runs layers 1..L in order; layer j computes for compute_s[j];
- request r at distance d has layer j on the host when j % (d + 1) == 0; that layer's KV
  (kv_bytes[r]) is requested from the host when layer j - d starts, and layer j cannot start before
  it has arrived;
- one link carries every transfer at bandwidth_bps, first come first served (ties: by the layer the
  transfer is for, then by request), one at a time;
- the step takes until layer L ends.

Because every transfer is requested when some earlier layer starts, and layer start times only grow,
transfers reach the link in the order they are requested: the link's schedule can be built while the
layers are walked in order, O(L + transfers), no event queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvd.planner.distance import NONE, offloaded_count, resident_layers


@dataclass(frozen=True, slots=True)
class Batch:
    """One decode step's inputs: per-layer compute seconds, per-request KV bytes of one layer, the link."""

    compute_s: tuple[float, ...]
    kv_bytes: tuple[int, ...]
    bandwidth_bps: float

    @property
    def layers(self) -> int:
        return len(self.compute_s)

    def __post_init__(self) -> None:
        if not self.compute_s or min(self.compute_s) <= 0 or self.bandwidth_bps <= 0:
            raise ValueError("a batch needs layers of positive compute time and a positive bandwidth")
        if any(size < 0 for size in self.kv_bytes):
            raise ValueError("KV sizes are not negative")


def step_latency(batch: Batch, distances: Sequence[int]) -> float:
    """Seconds from the step's start to the end of its last layer, with request r at distances[r]."""
    fetches = []
    for request, distance in enumerate(distances):
        if distance == NONE:
            continue
        for layer in range(distance + 1, batch.layers + 1, distance + 1):
            fetches.append((layer - distance, layer, request))
    return fetch_latency(batch, fetches)


def fetch_latency(batch: Batch, fetches: Iterable[tuple[int, int, int]]) -> float:
    """The same for any set of fetches (asked_at, layer, request): layer `layer` of request's KV is
    asked for when layer `asked_at` starts (1 <= asked_at <= layer) and must land before `layer`
    starts. Placements other than distances use it (the simulator's baselines)."""
    layers = batch.layers
    # requested[k]: (layer it is for, request) of the transfers requested when layer k starts
    requested: list[list[tuple[int, int]]] = [[] for _ in range(layers + 1)]
    for asked_at, layer, request in fetches:
        if not 1 <= asked_at <= layer <= layers:
            raise ValueError(f"a fetch for layer {layer} asked at layer {asked_at} of {layers}")
        requested[asked_at].append((layer, request))
    arrived = np.zeros(layers + 1)  # when the last transfer for each layer arrives
    link_free = 0.0
    end = 0.0
    for layer in range(1, layers + 1):
        start = max(end, arrived[layer])
        for target, request in sorted(requested[layer]):
            link_free = max(link_free, start) + batch.kv_bytes[request] / batch.bandwidth_bps
            arrived[target] = max(arrived[target], link_free)
        end = start + batch.compute_s[layer - 1]
    return end


def gpu_bytes(batch: Batch, distances: Sequence[int]) -> int:
    """GPU memory a placement takes: every request's resident layers, plus one layer of prefetch room
    for each request that offloads any (its fetches never overlap: the next is requested only after
    the layer the last one was for has ended)."""
    total = 0
    for size, distance in zip(batch.kv_bytes, distances, strict=True):
        total += size * resident_layers(distance, batch.layers)
        total += size if offloaded_count(distance, batch.layers) else 0
    return total
