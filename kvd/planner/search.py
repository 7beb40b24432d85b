"""The placement search: one offload distance per request, the smallest step latency within the GPU
budget (kvd.planner.latency), over the pruned distances (kvd.planner.distance).

- `exhaustive`: every combination; the oracle for tests, fine for a few requests.
- `branch_and_bound`: requests largest first, each trying its distances from "all on the GPU" to
  "most offloaded". A partial placement is dropped when
  - even the most frugal distances for the requests still open would not fit the budget, or
  - its latency with the open requests kept on the GPU, a lower bound (offloading only adds
    transfers, and a transfer can only delay a layer), already reaches the best complete one.
  It returns what exhaustive search over the same space returns (the same latency; tests check).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

from kvd.planner.distance import NONE, distance_options
from kvd.planner.latency import Batch, gpu_bytes, step_latency


@dataclass(frozen=True, slots=True)
class Placement:
    distances: tuple[int, ...]   # per request, in the batch's order
    latency_s: float
    gpu_bytes: int
    explored: int = 0            # placements whose latency was computed


def exhaustive(batch: Batch, budget_bytes: int) -> Placement | None:
    """The best placement by trying every combination; None when none fits."""
    options = distance_options(batch.layers)
    best: Placement | None = None
    explored = 0
    for distances in itertools.product(options, repeat=len(batch.kv_bytes)):
        used = gpu_bytes(batch, distances)
        if used > budget_bytes:
            continue
        explored += 1
        latency = step_latency(batch, distances)
        if best is None or latency < best.latency_s:
            best = Placement(distances, latency, used)
    return None if best is None else Placement(best.distances, best.latency_s, best.gpu_bytes, explored)


def branch_and_bound(batch: Batch, budget_bytes: int) -> Placement | None:
    """The same answer as `exhaustive` (the same latency), exploring far fewer placements."""
    count = len(batch.kv_bytes)
    options = distance_options(batch.layers)
    order = sorted(range(count), key=lambda r: -batch.kv_bytes[r])  # the big requests decide most
    frugal = [min(_one_request_bytes(batch, r, d) for d in options) for r in range(count)]
    # frugal_after[i]: the least the requests order[i:] can take together
    frugal_after = [0] * (count + 1)
    for i in range(count - 1, -1, -1):
        frugal_after[i] = frugal_after[i + 1] + frugal[order[i]]
    state = _Search(batch, budget_bytes, order, options, frugal_after)
    state.descend(0, [NONE] * count, 0)
    return None if state.best is None else dataclasses.replace(state.best, explored=state.explored)


def _one_request_bytes(batch: Batch, request: int, distance: int) -> int:
    distances = [NONE] * len(batch.kv_bytes)
    distances[request] = distance
    alone = gpu_bytes(batch, distances)
    others = sum(size * batch.layers for r, size in enumerate(batch.kv_bytes) if r != request)
    return alone - others


class _Search:
    def __init__(self, batch: Batch, budget_bytes: int, order: list[int], options: tuple[int, ...],
                 frugal_after: list[int]) -> None:
        self.batch, self.budget, self.order, self.options = batch, budget_bytes, order, options
        self.frugal_after = frugal_after
        self.best: Placement | None = None
        self.explored = 0

    def descend(self, depth: int, distances: list[int], used: int) -> None:
        """Try every distance for request order[depth]; the requests after it are still on the GPU."""
        if used + self.frugal_after[depth] > self.budget:
            return
        bound = step_latency(self.batch, distances)  # the open requests on the GPU: a lower bound
        self.explored += 1
        if self.best is not None and bound >= self.best.latency_s:
            return
        if depth == len(self.order):
            self.best = Placement(tuple(distances), bound, used, self.explored)
            return
        request = self.order[depth]
        for distance in self.options:
            distances[request] = distance
            self.descend(depth + 1, distances, used + _one_request_bytes(self.batch, request, distance))
        distances[request] = NONE
