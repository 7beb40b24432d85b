"""The scheduler half of the vLLM connector: which blocks to load and to store.

The workers tell the scheduler side their namespaces once (the handshake:
one per (pp stage, tp rank) shard). For each new request it then
computes the prompt's chained keys in every shard, and:

- get_num_new_matched_tokens looks the keys up in every shard (a block
  counts only if every shard has it). A hit served from host memory is
  loaded synchronously, layer by layer during the step that computes the
  rest of the prompt. A hit that needs the disk is streamed the same way
  (kvd reads layer 0 of every block first), or, with load = "async" (or
  "auto" while other requests run), prefetched at once (not with io_ring:
  read straight into the KV cache, it needs no host copy) and reported as
  an asynchronous load: vLLM parks the request until the worker says the
  bytes are in, and runs other requests meanwhile. In a cluster the Lookup
  also counts what a peer holds past the local prefix: the daemon fetches
  it when the worker loads, and it is loaded like a disk hit. With a
  prefill profile (prefill_profile), the Lookup also prices each block's
  load as things stand (disk queue and rate, remote fetch rate), and only
  the leading blocks whose load beats computing them are loaded
  (kvd.planner.prefill); vLLM computes the rest. A request may choose for
  itself in its kv_transfer_params: {"kvd_load": "rule" | "all" | "none"}.
- build_connector_meta turns allocated blocks into load orders, and the
  prompt blocks that become full in a step into save orders.

It never blocks on kvd beyond one Lookup per shard per new request: if kvd
is down, requests simply miss.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np

from kvd.client import Client, Namespace
from kvd.connectors.vllm.config import ConnectorConfig
from kvd.connectors.vllm.logs import log
from kvd.connectors.vllm.metadata import NULL_BLOCK, KvdConnectorMetadata, KvdHandshake, LoadOrder, SaveOrder
from kvd.connectors.vllm.placement import SavePlanner
from kvd.connectors.vllm.requests import prompt_keys
from kvd.connectors.vllm.timeline import Timeline
from kvd.connectors.vllm.transfer import local_namespace, registering
from kvd.planner.prefill import PrefillProfile, best_stop
from kvd.v1 import kvd_pb2


LOAD_CHOICES = ("rule", "all", "none")  # a request's kv_transfer_params {"kvd_load": ...}


@dataclass(slots=True)
class _Tracked:
    """A request the connector knows: its keys per shard, its blocks, what was offered to kvd."""

    keys: list[list[bytes]]
    prompt_tokens: int
    block_ids: list[list[int]] = field(default_factory=list)  # per KV cache group, by position
    offered: int = 0  # blocks [0, offered) were handed to the workers to store
    loading: set[int] = field(default_factory=set)  # engine blocks of its load order, if any
    # A load of it failed: vLLM recomputes it, and asks again; kvd offers nothing more for it
    # (the holder it came from may be gone, and the directory says so only after its lease).
    load_failed: bool = False
    declined: int = 0  # hit blocks the load rule left to vLLM, until a step counts them


@dataclass(slots=True)
class _Plan:
    first: int
    stop: int
    asynchronous: bool
    budget_s: float | None = None  # see LoadOrder.budget_s


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, block_size: int, publish_events: bool = False) -> None:
        self.config = config
        self.publish_events = publish_events
        self.block_size = block_size
        self.client = Client(config.target, token=config.token, timeout_s=config.timeout_s, use_shared_memory=False)
        self.shards: list[Namespace] = []  # one per worker, as the workers index them
        self._distinct: list[int] = []  # the first shard of each namespace
        self.requests: dict[str, _Tracked] = {}
        self._plans: dict[str, _Plan] = {}
        self._loads: list[LoadOrder] = []
        self.events = None  # an EventFeed (kvd.connectors.vllm.events) with publish_events
        self.placement = SavePlanner(self.client, config.placement) if config.placement is not None else None
        self.profile = PrefillProfile.load(config.prefill_profile) if config.prefill_profile else None
        self.timeline = Timeline(config.timeline, "scheduler")

    def set_shards(self, handshakes: dict[tuple[int, int], KvdHandshake]) -> None:
        """Adopt the workers' namespaces, ordered as the workers index them."""
        self.shards = [local_namespace(handshakes[key].spec) for key in sorted(handshakes)]
        # Shards that share a namespace (an MLA latent, the same on every TP rank) are asked once.
        firsts: dict[bytes, int] = {}
        for index, shard in enumerate(self.shards):
            firsts.setdefault(shard.namespace_id, index)
        self._distinct = list(firsts.values())
        for namespace in (self.shards[index] for index in self._distinct):
            try:
                self.client.register_namespace(namespace.spec)
            except grpc.RpcError as error:  # registered again on first use (kvd.connectors.vllm.transfer)
                log.warning("kvd: cannot register the namespace yet (%s); requests miss until kvd answers",
                            error.code().name)
        if self.publish_events:
            from kvd.connectors.vllm.events import EventFeed  # imports vLLM's event types

            self.events = EventFeed(self.client, self.shards[0])

    # ---- per request
    def track(self, request: Any) -> _Tracked | None:
        tracked = self.requests.get(request.request_id)
        if tracked is None and self.shards and request.prompt_token_ids is not None:
            distinct = {self.shards[index].namespace_id: prompt_keys(self.shards[index].spec, request)
                        for index in self._distinct}
            keys = [distinct[namespace.namespace_id] for namespace in self.shards]
            tracked = self.requests[request.request_id] = _Tracked(keys, len(request.prompt_token_ids))
        return tracked

    def load_choice(self, request: Any) -> str:
        """What the request asks of kvd's hit (kv_transfer_params {"kvd_load": ...}): "rule" (the
        prefill profile's choice; the default with one), "all" (load every matched block; the
        default without), "none" (load nothing: vLLM computes the prompt; kvd still stores it)."""
        default = "rule" if self.profile is not None else "all"
        params = getattr(request, "kv_transfer_params", None) or {}
        choice = params.get("kvd_load", default) if isinstance(params, dict) else params
        if not isinstance(choice, str) or choice not in LOAD_CHOICES or (choice == "rule" and self.profile is None):
            log.warning("kvd: request %s asks kvd_load=%r; kvd takes %r (choices: %s%s)", request.request_id,
                        choice, default, ", ".join(LOAD_CHOICES),
                        "; \"rule\" needs prefill_profile" if choice == "rule" else "")
            return default
        return choice

    def matched_tokens(self, request: Any, computed: int) -> tuple[int, bool]:
        tracked = self.track(request)
        if tracked is None or tracked.load_failed:
            return 0, False
        choice = self.load_choice(request)
        if choice == "none":
            return 0, False
        first = computed // self.block_size
        # vLLM computes at least one prompt token itself, so the last block
        # of a block-aligned prompt is left to it.
        usable = min(len(tracked.keys[0]), (tracked.prompt_tokens - 1) // self.block_size)
        if usable <= first:
            return 0, False
        budget_s = None
        began = time.perf_counter_ns()
        try:
            stop, first_slow, load_s = self._lookup(tracked, usable)
            if choice == "rule" and stop > first:
                # What vLLM computes instead of loading, kvd holds already: not offered for saving.
                tracked.offered = max(tracked.offered, stop)
                matched = stop
                stop, budget_s = self._worth_loading(tracked, first, stop, load_s)
                tracked.declined = matched - stop  # counted once vLLM schedules the request
            slow = first_slow < stop
            # "auto": asynchronous only if the scheduler has another request to run meanwhile.
            others = len(self.requests) > 1
            asynchronous = slow and (self.config.load == "async" or (self.config.load == "auto" and others))
            if stop > first and asynchronous and not self.config.io_ring:
                # The request waits: its disk blocks are read into host memory from now on. A layerwise
                # load is not prefetched: its step's GetLayers reads layer 0 of every block first, so
                # the later layers' reads overlap the compute (a whole-block prefetch would land every
                # layer at once). With io_ring a disk hit is read straight into the KV cache.
                self._prefetch(tracked, first, stop)
        except grpc.RpcError as error:
            log.warning("kvd: lookup failed, the request misses: %s", error.details())
            return 0, False
        self.timeline.mark("lookup", max(stop - first, 0), began)
        if stop <= first:
            return 0, False
        self._plans[request.request_id] = _Plan(first, stop, asynchronous, budget_s)
        return (stop - first) * self.block_size, asynchronous

    def _lookup(self, tracked: _Tracked, usable: int) -> tuple[int, int, np.ndarray | None]:
        """The prefix every shard can have (its kvd's tiers, then a peer's in a cluster); the first
        block of it on disk or on another node in any shard (a load that should not hold up a step;
        `stop` if none); with a prefill profile, per block the seconds until the shards' blocks up to
        it are in host memory (their sum over the shards' distinct namespaces: they share the node's
        drives)."""
        stop, first_slow, load_s = usable, usable, None
        timed = self.profile is not None
        for namespace, keys in self._each_namespace(tracked):
            result = registering(self.client, namespace, lambda: self.client.lookup(
                namespace, keys[:usable], include_remote=None, load_times=timed))
            stop = min(stop, result.matched)
            first_slow = min(first_slow, next((index for index, tier in enumerate(result.tiers[:stop])
                                               if tier != kvd_pb2.TIER_HOST), stop))
            if timed:
                times = np.asarray(result.load_s[:stop], dtype=np.float64)
                load_s = times if load_s is None else load_s[:stop] + times[:len(load_s)]
        return stop, min(first_slow, stop), None if load_s is None else load_s[:stop]

    def _each_namespace(self, tracked: _Tracked) -> Iterator[tuple[Namespace, list[bytes]]]:
        return ((self.shards[index], tracked.keys[index]) for index in self._distinct)

    def _worth_loading(self, tracked: _Tracked, first: int, stop: int,
                       load_s: np.ndarray | None) -> tuple[int, float]:
        """The end of the leading matched blocks worth loading rather than computing again, and the
        load's budget: by then, had vLLM computed them instead, they would be done."""
        choice = best_stop(self.profile, first, stop, self.block_size, tracked.prompt_tokens, load_s)
        if choice.stop < stop:
            log.info("kvd: loading %d of %d hit blocks, computing the rest: about %.3f s to the first token, "
                     "against %.3f s loading them all and %.3f s computing them all", choice.stop - first,
                     stop - first, choice.load_s + choice.compute_s, choice.load_all_s, choice.recompute_s)
        return choice.stop, choice.recompute_s - choice.compute_s

    def _prefetch(self, tracked: _Tracked, first: int, stop: int) -> None:
        for namespace, keys in self._each_namespace(tracked):
            parent = keys[first - 1] if first else b""
            registering(self.client, namespace,
                        lambda: self.client.prefetch(namespace, keys[first:stop], parent_key=parent))

    def after_alloc(self, request: Any, block_ids: tuple[list[int], ...], external_tokens: int) -> None:
        """vLLM allocated the request's blocks (block_ids: per KV cache group)."""
        plan = self._plans.pop(request.request_id, None)
        if plan is None or external_tokens == 0:
            return
        tracked = self.requests[request.request_id]
        stop = plan.first + external_tokens // self.block_size
        loading = [list(group[plan.first:stop]) for group in block_ids]
        tracked.loading = {block for group in loading for block in group} - {NULL_BLOCK}
        self._loads.append(LoadOrder(
            req_id=request.request_id,
            keys=[keys[:stop] for keys in tracked.keys],
            first=plan.first,
            block_ids=loading,
            asynchronous=plan.asynchronous,
            budget_s=plan.budget_s,
        ))

    def load_failed(self, block_ids: set[int]) -> None:
        """Blocks a worker could not load are recomputed by vLLM: offer them to kvd again, and
        load nothing more for their request."""
        for tracked in self.requests.values():
            tracked.load_failed = tracked.load_failed or not tracked.loading.isdisjoint(block_ids)
            for group in tracked.block_ids:
                position = next((index for index, block in enumerate(group[:tracked.offered]) if block in block_ids),
                                None)
                if position is not None:
                    tracked.offered = position

    def finished(self, request: Any) -> None:
        self.requests.pop(request.request_id, None)
        self._plans.pop(request.request_id, None)

    # ---- per step
    def build(self, scheduler_output: Any) -> KvdConnectorMetadata:
        self.timeline.end_step()
        self.timeline.begin_step()
        metadata = KvdConnectorMetadata(loads=self._loads, declined_blocks=self._take_declined(scheduler_output))
        self._loads = []
        if not self.config.save:
            return metadata
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self.requests.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = [list(group) for group in new.block_ids]
                self._offer(metadata, new.req_id, tracked, new.num_computed_tokens + scheduled[new.req_id])
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            tracked = self.requests.get(req_id)
            if tracked is None:
                continue
            new_blocks = cached.new_block_ids[index]
            if req_id in cached.resumed_req_ids:
                tracked.block_ids = [list(group) for group in new_blocks] if new_blocks else []
            elif new_blocks:
                for group, more in zip(tracked.block_ids, new_blocks, strict=True):
                    group.extend(more)
            self._offer(metadata, req_id, tracked, cached.num_computed_tokens[index] + scheduled.get(req_id, 0))
        if self.placement is not None and self.shards:
            spec = self.shards[0].spec
            self.placement.place(metadata.saves, spec.num_layers, spec.layer_bytes, self.block_size)
        return metadata

    def _take_declined(self, scheduler_output: Any) -> int:
        """The hit blocks the rule left to vLLM in the requests this step schedules first (the workers
        count them: a request asked about again before it runs is counted once)."""
        declined = 0
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self.requests.get(new.req_id)
            if tracked is not None:
                declined, tracked.declined = declined + tracked.declined, 0
        return declined

    def _offer(self, metadata: KvdConnectorMetadata, req_id: str, tracked: _Tracked, computed: int) -> None:
        """A save order for the prompt blocks that are full once this step has run."""
        full = min(min(computed, tracked.prompt_tokens) // self.block_size, len(tracked.keys[0]),
                   *(len(group) for group in tracked.block_ids)) if tracked.block_ids else 0
        if full <= tracked.offered:
            return
        metadata.saves.append(SaveOrder(req_id, [keys[:full] for keys in tracked.keys],
                                        [group[:full] for group in tracked.block_ids]))
        tracked.offered = full

    def close(self) -> None:
        self.timeline.end_step()
        if self.events is not None:
            self.events.close()
        self.client.close()
