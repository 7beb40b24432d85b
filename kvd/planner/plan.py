"""A decode batch's plan: a distance per request, the decode window it holds for, and who pauses.

`plan` wraps the search (kvd.planner.search) with what a serving engine needs around it, after
OrbitFlow:

- the SLO: request r may take slo_s per token, but tokens it produced ahead of its SLO (its deposit)
  are slack it may spend within the window: over W steps it tolerates steps of
  slo_s * (1 + deposit / W);
- the decode window: every step adds a token to each request, so the plan holds until the resident
  KV outgrows the budget (or max_window steps, after which the engine re-plans anyway);
- pause: when no placement fits the budget, the request whose pausing helps most and costs least
  leaves the batch for this window, the one with the largest KV weighted by its deposit,
  kv * (1 + deposit / W), and the rest is planned again; a lone request is never paused (it then
  runs with the best placement there is, or none). When the best placement breaks some request's
  SLO, requests are paused the same way only if that lets the rest meet theirs, at most half of
  the batch; otherwise every request runs, late.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvd.planner.distance import NONE
from kvd.planner.latency import Batch, gpu_bytes
from kvd.planner.search import Placement, branch_and_bound


@dataclass(frozen=True, slots=True)
class Request:
    kv_bytes: int             # one layer of its KV now
    slo_s: float              # its time-per-output-token target
    deposit_tokens: int = 0   # tokens produced ahead of its SLO
    token_bytes: int = 0      # what one more token adds to one layer of its KV

    def allowed_step_s(self, window: int) -> float:
        return self.slo_s * (1 + self.deposit_tokens / window)

    def pause_score(self, window: int) -> float:
        return self.kv_bytes * (1 + self.deposit_tokens / window)


@dataclass(frozen=True, slots=True)
class Plan:
    distances: tuple[int, ...]   # per request in the caller's order; NONE for paused requests
    paused: tuple[int, ...]      # requests to pause for this window, in the caller's order
    latency_s: float             # predicted step latency of the running requests
    window_steps: int            # decode steps before the next plan
    gpu_bytes: int
    fits: bool                   # the running requests fit the budget
    meets_slo: bool              # and every one of them meets its SLO, deposits counted
    exact: bool                  # the search finished (else: the best found within its node limit)
    explored: int
    bound_s: float = 0.0         # no placement of the running requests is faster


def plan(requests: Sequence[Request], compute_s: Sequence[float], bandwidth_bps: float, budget_bytes: int, *,
         max_window: int = 64, max_nodes: int = 200_000) -> Plan:
    """The batch's plan (see the module's docstring)."""
    if not requests:
        return Plan((), (), 0.0, max_window, 0, True, True, True, 0, 0.0)
    search = _Searcher(requests, compute_s, bandwidth_bps, budget_bytes, max_window, max_nodes)
    running = list(range(len(requests)))
    paused: list[int] = []
    # Memory first: pause until a placement fits (never the last request).
    placement = search(running)
    while placement is None and len(running) > 1:
        paused.append(search.victim(running))
        placement = search(running)
    if placement is None or search.meets(running, placement):
        return search.finish(running, paused, placement)
    # Then the SLO: pause more only where that lets the others meet theirs, at most half of them;
    # else keep them all running, late (pausing them would make them later still).
    trial, trial_paused = list(running), list(paused)
    for _ in range(len(running) // 2):
        trial_paused.append(search.victim(trial))
        better = search(trial)
        if better is not None and search.meets(trial, better):
            return search.finish(trial, trial_paused, better)
    return search.finish(running, paused, placement)


class _Searcher:
    """plan's searches over subsets of its requests, and what it asks of their answers."""

    def __init__(self, requests: Sequence[Request], compute_s: Sequence[float], bandwidth_bps: float,
                 budget_bytes: int, max_window: int, max_nodes: int) -> None:
        self.requests, self.compute_s, self.bandwidth_bps = requests, tuple(compute_s), bandwidth_bps
        self.budget_bytes, self.max_window, self.max_nodes = budget_bytes, max_window, max_nodes
        self.explored = 0

    def batch(self, running: list[int]) -> Batch:
        return Batch(self.compute_s, tuple(self.requests[r].kv_bytes for r in running), self.bandwidth_bps)

    def __call__(self, running: list[int]) -> Placement | None:
        placement = branch_and_bound(self.batch(running), self.budget_bytes, max_nodes=self.max_nodes)
        self.explored += placement.explored if placement is not None else 0
        return placement

    def meets(self, running: list[int], placement: Placement) -> bool:
        return all(placement.latency_s <= self.requests[r].allowed_step_s(self.max_window) for r in running)

    def victim(self, running: list[int]) -> int:
        """Takes the request to pause out of `running` and returns it."""
        victim = max(running, key=lambda r: (self.requests[r].pause_score(self.max_window), -r))
        running.remove(victim)
        return victim

    def finish(self, running: list[int], paused: list[int], placement: Placement | None) -> Plan:
        """The plan with `running` placed as `placement` says and `paused` paused."""
        distances = [NONE] * len(self.requests)
        if placement is None:
            return Plan(tuple(distances), tuple(sorted(paused)), float("inf"), 1, 0, False, False, True,
                        self.explored)
        for r, distance in zip(running, placement.distances):
            distances[r] = distance
        window = decode_window([self.requests[r] for r in running], placement.distances, self.batch(running),
                               self.budget_bytes - placement.gpu_bytes, self.max_window)
        return Plan(tuple(distances), tuple(sorted(paused)), placement.latency_s, window, placement.gpu_bytes, True,
                    self.meets(running, placement), placement.exact, self.explored, placement.bound_s)


def decode_window(requests: Sequence[Request], distances: Sequence[int], batch: Batch, headroom_bytes: int,
                  max_window: int) -> int:
    """Steps until the KV the placement keeps on the GPU outgrows the budget (one token per request
    per step), at least 1, at most max_window."""
    # What the placement keeps per byte of one layer is linear in the KV: a step's growth is the
    # placement's bytes for KV the size of one token.
    growth = gpu_bytes(replace(batch, kv_bytes=tuple(r.token_bytes for r in requests)), distances)
    if growth == 0:
        return max_window
    return max(1, min(max_window, headroom_bytes // growth))
