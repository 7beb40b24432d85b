"""Offload distances for a step's saves, from kvd's placement planner (PlanPlacement).

With kv_connector_extra_config `placement` set, the scheduler side asks kvd, once per step with
saves, how to place the KV of the requests it saves within `budget_bytes` of device memory (the
share of kvd's device tier these requests may take): each request gets an offload distance, and its
SaveLayers carries it, so kvd's device tier keeps the layers the plan keeps on the GPU and leaves the
others in host memory (docs/planner.md, docs/GPU.md). A load later streams those layers from host
memory while the layers before them compute: the plan picks the distances that keep that step the
shortest the budget allows.

The step model is given here, not learned: per-layer decode compute `layer_s + per_token_s x (the
batch's context tokens)` and the host-to-device link's `bandwidth_bps`. `slo_s` is the engine's
time-per-output-token target (default 1 s, loose enough that no request pauses for it); a request the
plan pauses, whose KV does not fit even at its most frugal, is saved at that most frugal distance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from kvd.connectors.vllm.logs import log
from kvd.connectors.vllm.metadata import SaveOrder
from kvd.planner.distance import distance_options
from kvd.v1 import kvd_pb2

OPTIONAL = {"per_token_s": 0.0, "slo_s": 1.0}  # the keys a placement table may leave out, with their defaults


@dataclass(frozen=True, slots=True)
class PlacementOptions:
    budget_bytes: int
    layer_s: float
    bandwidth_bps: float
    per_token_s: float = OPTIONAL["per_token_s"]
    slo_s: float = OPTIONAL["slo_s"]

    @classmethod
    def from_extra(cls, value: Any) -> PlacementOptions:
        """kv_connector_extra_config["placement"], checked (ValueError naming the key)."""
        if not isinstance(value, Mapping):
            raise ValueError(f"kvd connector: placement must be a table of budget_bytes, layer_s, bandwidth_bps, "
                             f"per_token_s and slo_s, got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        missing = sorted({"budget_bytes", "layer_s", "bandwidth_bps"} - set(value))
        if unknown:
            raise ValueError(f"kvd connector: unknown placement keys {unknown}; known: {sorted(known)}")
        if missing:
            raise ValueError(f"kvd connector: placement needs {missing} too")
        for name in sorted(known):
            number = value.get(name, OPTIONAL.get(name))
            if not _number_for(name, number):
                least = "finite 0 or more" if name == "per_token_s" else "finite positive"
                raise ValueError(f"kvd connector: placement.{name} must be a {least} "
                                 f"{'whole number of bytes' if name == 'budget_bytes' else 'number'}, got {number!r}")
        return cls(int(value["budget_bytes"]), float(value["layer_s"]), float(value["bandwidth_bps"]),
                   *(float(value.get(name, default)) for name, default in OPTIONAL.items()))


def _number_for(name: str, number: Any) -> bool:
    if not isinstance(number, (int, float)) or isinstance(number, bool):
        return False
    if not math.isfinite(number) or (name == "budget_bytes" and number != int(number)):
        return False
    return number >= 0 if name == "per_token_s" else number > 0


class SavePlanner:
    """Sets each SaveOrder's offload distance from one PlanPlacement per step."""

    def __init__(self, client, options: PlacementOptions) -> None:
        self.client = client
        self.options = options
        self.failed = False  # a failure is logged once, until a plan works again

    def place(self, saves: Sequence[SaveOrder], layers: int, layer_bytes: int, block_tokens: int) -> None:
        if not saves:
            return
        sizes = [len(order.keys[0]) for order in saves]
        tokens = sum(sizes) * block_tokens
        layer_s = self.options.layer_s + self.options.per_token_s * tokens
        request = kvd_pb2.PlanPlacementRequest(
            requests=[kvd_pb2.PlanRequestEntry(kv_bytes=blocks * layer_bytes, context_tokens=blocks * block_tokens,
                                               slo_s=self.options.slo_s, token_bytes=layer_bytes // block_tokens)
                      for blocks in sizes],
            layer_compute_s=[layer_s] * layers, bandwidth_bps=self.options.bandwidth_bps,
            budget_bytes=self.options.budget_bytes)
        try:
            plan = self.client.plan_placement(request)
        except grpc.RpcError as error:
            if not self.failed:
                log.warning("kvd: no placement plan for this step's saves (%s); saving every layer to the "
                            "device tier until a plan works", error.details() if hasattr(error, "details") else error)
            self.failed = True
            return
        self.failed = False
        frugal = distance_options(layers)[-1]
        paused = set(plan.paused)
        for index, order in enumerate(saves):
            # A paused request does not fit even at its most frugal: keep as little of it as a plan can.
            order.distance = frugal if index in paused else plan.distances[index]
        if paused:
            log.debug("kvd: %d of %d saved requests do not fit the placement budget", len(paused), len(saves))

