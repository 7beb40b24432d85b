"""Offload distances: d = -1 keeps every layer on the GPU; d >= 1 keeps d layers between two that live
on the host (layers j with j % (d + 1) == 0, 1-based), each fetched d layers ahead of its use.

Many distances offload the same number of layers; for each count only the largest distance is kept
(the longest look-ahead for the same transfer volume), which leaves ~sqrt(2L) options: 9 for 32
layers, 15 for 80 (the pruned space the planner searches).
"""

from __future__ import annotations

from functools import cache

NONE = -1  # no layer offloaded


def offloaded_count(distance: int, layers: int) -> int:
    return 0 if distance == NONE else layers // (distance + 1)


def is_offloaded(distance: int, layer: int) -> bool:
    """Whether 1-based `layer` lives on the host at this distance."""
    return distance != NONE and layer % (distance + 1) == 0


@cache
def distance_options(layers: int) -> tuple[int, ...]:
    """NONE, then the largest distance for each distinct offloaded-layer count, most offloaded last."""
    largest: dict[int, int] = {}
    for distance in range(1, layers):
        count = offloaded_count(distance, layers)
        if count:
            largest[count] = max(largest.get(count, 0), distance)
    return (NONE, *(largest[count] for count in sorted(largest)))


def resident_layers(distance: int, layers: int) -> int:
    return layers - offloaded_count(distance, layers)
