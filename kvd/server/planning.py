"""PlanPlacement and ReportStep: kvd.planner served to engines, with profiles kept per tenant.

A profile (kvd.planner.profile.StepProfile) is named by its caller and lives in the caller's
tenant; a request either gives the per-layer compute times and the bandwidth itself or takes them
from its profile. Every number is checked before the planner sees it (INVALID_ARGUMENT naming the
field), the search runs off the event loop (native code, the GIL released), and its node limit is
capped so one call cannot hold a thread for long.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict

from kvd.errors import InvalidArgument, NotFound
from kvd.planner.plan import Request, plan
from kvd.planner.profile import StepProfile
from kvd.planner.search import DEFAULT_MAX_NODES, MAX_LAYERS, MAX_REQUESTS
from kvd.server import convert

MAX_NODES = 100_000
DEFAULT_MAX_WINDOW = 64
MAX_WINDOW = 1 << 20
MAX_PROFILES = 1024          # across tenants; the least recently used goes first
# A placement's latency costs about layers x requests steps, and a plan may search once per request
# it pauses: the node limit shrinks so that one call stays within about this many steps (~0.1 s).
WORK_LIMIT = 50_000_000


def _positive(value: float, field: str, *, zero: bool = False) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise InvalidArgument(f"{field} must be a finite number above 0{' or 0' if zero else ''}, got {value!r}")
    return value


class Planning:
    def __init__(self, max_profiles: int = MAX_PROFILES) -> None:
        self.max_profiles = max_profiles
        self._profiles: OrderedDict[tuple[str, str], StepProfile] = OrderedDict()
        self.plans = 0
        self.paused = 0
        self.reports = 0

    # -- profiles

    def _profile(self, tenant: str, name: str) -> StepProfile:
        profile = self._profiles.get((tenant, name))
        if profile is None:
            raise NotFound(f"no plan profile {name!r}: define it in a PlanPlacement first")
        self._profiles.move_to_end((tenant, name))
        return profile

    def _define(self, tenant: str, name: str, define) -> StepProfile:
        """A profile named `name` from a PlanProfile message, `define`."""
        if not name:
            raise InvalidArgument("define needs a profile name")
        if not 1 <= define.layers <= MAX_LAYERS:
            raise InvalidArgument(f"define.layers must be in [1, {MAX_LAYERS}], got {define.layers}")
        alpha = define.alpha or 0.2
        mismatch = define.mismatch or 0.1
        if not 0 < alpha <= 1:
            raise InvalidArgument(f"define.alpha must be in (0, 1], got {alpha!r}")
        profile = StepProfile(define.layers, _positive(define.base_s, "define.base_s"),
                              _positive(define.per_token_s, "define.per_token_s", zero=True),
                              _positive(define.bandwidth_bps, "define.bandwidth_bps"), alpha=alpha,
                              mismatch=_positive(mismatch, "define.mismatch"))
        self._profiles[(tenant, name)] = profile
        self._profiles.move_to_end((tenant, name))
        while len(self._profiles) > self.max_profiles:
            self._profiles.popitem(last=False)
        return profile

    # -- the calls

    async def plan(self, request, tenant: str):
        """PlanPlacement: a placement for `request` (a PlanPlacementRequest)."""
        requests = self._requests(request)
        compute, bandwidth = self._model(request, tenant, requests)
        if request.budget_bytes == 0:
            raise InvalidArgument("budget_bytes must be above 0")
        max_window = request.max_window or DEFAULT_MAX_WINDOW
        max_nodes = request.max_nodes or DEFAULT_MAX_NODES
        if max_window > MAX_WINDOW or max_nodes > MAX_NODES:
            raise InvalidArgument(f"max_window is at most {MAX_WINDOW} and max_nodes at most {MAX_NODES}, got "
                                  f"{max_window} and {max_nodes}")
        count = max(1, len(requests))
        max_nodes = max(1, min(max_nodes, WORK_LIMIT // (len(compute) * count * count)))
        result = await asyncio.to_thread(plan, [entry for entry, _ in requests], compute, bandwidth,
                                         request.budget_bytes, max_window=max_window, max_nodes=max_nodes)
        self.plans += 1
        self.paused += len(result.paused)
        return convert.plan_placement_response(result, compute, bandwidth)

    def report(self, request, tenant: str):
        """ReportStep: a step's `request` (a ReportStepRequest) observed into its profile."""
        profile = self._profile(tenant, request.profile)
        _positive(request.predicted_s, "predicted_s")
        _positive(request.observed_s, "observed_s")
        _positive(request.transfer_s, "transfer_s", zero=True)
        replan = profile.observe(request.predicted_s, request.observed_s, moved_bytes=request.moved_bytes,
                                 transfer_s=request.transfer_s)
        self.reports += 1
        return convert.report_step_response(replan, profile)

    # -- checking a request

    @staticmethod
    def _requests(request) -> list[tuple[Request, int]]:
        if len(request.requests) > MAX_REQUESTS:
            raise InvalidArgument(f"at most {MAX_REQUESTS} requests per plan, got {len(request.requests)}")
        out = []
        for i, entry in enumerate(request.requests):
            _positive(entry.slo_s, f"requests[{i}].slo_s")
            if entry.kv_bytes >= 1 << 53 or entry.token_bytes >= 1 << 53:
                raise InvalidArgument(f"requests[{i}]: kv_bytes and token_bytes must be below 2**53")
            out.append((Request(entry.kv_bytes, entry.slo_s, entry.deposit_tokens, entry.token_bytes),
                        entry.context_tokens))
        return out

    def _model(self, request, tenant: str,
               requests: list[tuple[Request, int]]) -> tuple[tuple[float, ...], float]:
        """Per-layer compute seconds and bandwidth: the request's own, else its profile's."""
        profile = None
        if request.HasField("define"):
            profile = self._define(tenant, request.profile, request.define)
        elif request.profile:
            profile = self._profile(tenant, request.profile)
        if request.layer_compute_s:
            if len(request.layer_compute_s) > MAX_LAYERS:
                raise InvalidArgument(f"at most {MAX_LAYERS} layers, got {len(request.layer_compute_s)}")
            compute = tuple(_positive(c, f"layer_compute_s[{i}]") for i, c in enumerate(request.layer_compute_s))
        elif profile is not None:
            compute = profile.compute_s(sum(tokens for _, tokens in requests))
        else:
            raise InvalidArgument("give layer_compute_s, or name a profile (and define it once)")
        if request.bandwidth_bps:
            bandwidth = _positive(request.bandwidth_bps, "bandwidth_bps")
        elif profile is not None:
            bandwidth = profile.bandwidth_bps
        else:
            raise InvalidArgument("give bandwidth_bps, or name a profile (and define it once)")
        return compute, bandwidth

