"""The placement search: one offload distance per request, the smallest step latency within the GPU
budget (kvd.planner.latency), over the pruned distances (kvd.planner.distance).

- `exhaustive`: every combination; the oracle for tests, fine for a few requests.
- `branch_and_bound` (native/planner.c): requests largest first, each trying its distances from
  "all on the GPU" to "most offloaded"; requests of equal size take their distances in one order
  only (they are interchangeable). A partial placement is dropped when
  - even the most frugal distances for the requests still open would not fit the budget, or
  - a lower bound reaches the best complete placement: its latency with the open requests kept on
    the GPU (offloading only adds transfers, and a transfer can only delay a layer), or the link's
    time for what is fetched already plus what the open requests must still free (a layer freed is
    a layer fetched), plus the shortest layer that could follow the last fetch.
  It returns what exhaustive search over the same space returns (the same latency; tests check).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from kvd._native import plan_search, plan_step_latency
from kvd.planner.distance import distance_options
from kvd.planner.latency import Batch, gpu_bytes, step_latency

# The native search's limits (native/planner.h).
MAX_REQUESTS = 256
# A plan's node limit unless its caller sets one: about 0.6 ms at p99 for 16 requests x 32 layers on
# the development VM (bench/bench_planner.py). The daemon, the decode simulation and the benchmark use it.
DEFAULT_MAX_NODES = 600
MAX_LAYERS = 1024


@dataclass(frozen=True, slots=True)
class Placement:
    distances: tuple[int, ...]   # per request, in the batch's order
    latency_s: float
    gpu_bytes: int
    explored: int = 0            # placements whose latency was computed
    exact: bool = True           # the search finished: no placement in the space is better
    bound_s: float = 0.0         # no placement in the space is faster (latency_s when exact)


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


def branch_and_bound(batch: Batch, budget_bytes: int, max_nodes: int = 0) -> Placement | None:
    """The same answer as `exhaustive` (the same latency), exploring far fewer placements; in native
    code (native/planner.c). After max_nodes latency evaluations (0: no limit) it answers with the
    best placement found so far, marked not exact, and a lower bound on the best there is (the
    bound at the root: what the open requests must fetch to free the memory the budget lacks)."""
    options = np.asarray(distance_options(batch.layers), dtype=np.int32)
    found = plan_search(_compute(batch), _sizes(batch), batch.bandwidth_bps, options, float(budget_bytes),
                        max_nodes)
    if found is None:
        return None
    distances, latency, bound, used, explored, exact = found
    return Placement(distances, latency, int(used), explored, exact, bound)


def native_step_latency(batch: Batch, distances) -> float:
    """kvd.planner.latency.step_latency, computed by native/planner.c."""
    return plan_step_latency(_compute(batch), _sizes(batch), batch.bandwidth_bps,
                             np.asarray(distances, dtype=np.int32))


def _compute(batch: Batch) -> np.ndarray:
    return np.asarray(batch.compute_s, dtype=np.float64)


def _sizes(batch: Batch) -> np.ndarray:
    return np.asarray(batch.kv_bytes, dtype=np.float64)
