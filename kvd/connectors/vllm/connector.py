"""KvdConnector: vLLM's KV connector interface, delegating to the two halves.

vLLM builds one instance per role: the scheduler's (kvd.connectors.vllm.
scheduler) decides what to load and store; each worker's (kvd.connectors.
vllm.worker) moves the bytes. This class only adapts vLLM's calls.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from kvd.connectors.vllm.config import ConnectorConfig
from kvd.connectors.vllm.device_worker import DeviceWorkerSide
from kvd.connectors.vllm.layout import UnsupportedLayout, kv_groups, namespace_spec, paged_layout
from kvd.connectors.vllm.logs import log
from kvd.connectors.vllm.metadata import KvdConnectorMetadata, KvdHandshake
from kvd.connectors.vllm.scheduler import SchedulerSide
from kvd.connectors.vllm.transfer import local_namespace
from kvd.connectors.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request



class KvdConnectorStats(KVConnectorStats):
    """The workers' counters of an interval, summed; vLLM logs them as
    "KV Transfer metrics: loaded_blocks=..., load_errors=..., ..."."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(value, 4) if isinstance(value, float) else value for name, value in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KvdPromMetrics(KVConnectorPromMetrics):
    """The same counters on vLLM's /metrics, as vllm:kvd_<counter>_total."""

    HELP = {
        "loaded_blocks": "Blocks loaded from kvd into the engine (every layer).",
        "loaded_tokens": "Tokens loaded from kvd, not computed: the connector's count (vLLM's prefix-cache "
                         "counters also count a load that then failed).",
        "recomputed_tokens": "Tokens vLLM recomputed because their load from kvd failed.",
        "async_loads": "Requests whose hit was loaded from disk while vLLM ran other requests.",
        "load_errors": "Blocks that could not be loaded from kvd; vLLM recomputed them.",
        "corrupt_blocks": "Of those, blocks lost because kvd found one corrupt on disk (failed its checksum).",
        "saved_blocks": "Blocks stored in kvd.",
        "saved_tokens": "Tokens whose KV was stored in kvd.",
        "save_errors": "Reservations or commits in kvd that failed; those blocks were not stored.",
        "load_wait_seconds": "Time the model's attention layers waited for bytes from kvd.",
        "cut_loads": "Loads cut because they fell behind the time computing their blocks would take "
                     "(prefill_profile); vLLM computed those blocks.",
        "declined_blocks": "Hit blocks the load rule (prefill_profile) left to vLLM to compute, because "
                           "loading them would have been slower.",
    }
    RENAMED = {"load_wait_s": "load_wait_seconds"}

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {name: self._counter_cls(name=f"vllm:kvd_{name}", documentation=text,
                                                  labelnames=labelnames)
                          for name, text in self.HELP.items()}
        for counter in self._counters.values():  # every engine's series exists from the start, at 0
            for labels in per_engine_labelvalues.values():
                counter.labels(*labels)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for name, value in transfer_stats_data.items():
            counter = self._counters.get(self.RENAMED.get(name, name))
            if counter is not None and value:
                counter.labels(*labels).inc(value)


class KvdConnector(KVConnectorBase_V1, SupportsHMA):
    """Stores prompt KV blocks in kvd and loads hits back, layer by layer.

    It supports vLLM's hybrid KV cache manager (SupportsHMA): with a model whose layers
    mix full and sliding-window attention, vLLM keeps a block table per KV cache group
    (dropping a windowed group's blocks the window has left), and kvd still stores each
    position as one block of every layer, gathered from each layer's own group's block
    (kvd.connectors.vllm.layout.KvGroups). A model with state-space or linear-attention
    layers (per-request state, not blocks) runs without kvd: the worker says why."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.config = ConnectorConfig.from_extra(dict(self._kv_transfer_config.kv_connector_extra_config))
        self.block_size = vllm_config.cache_config.block_size
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self._spec = None
        self._saves = True
        if role == KVConnectorRole.SCHEDULER:
            events = vllm_config.kv_events_config
            publish = bool(events is not None and events.enable_kv_cache_events)
            self.scheduler = SchedulerSide(self.config, self.block_size, publish_events=publish)

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        # Read by vLLM's VllmConfig while it picks the CUDA-graph mode; True
        # turns its default FULL_AND_PIECEWISE into PIECEWISE. Replaying a
        # full graph launches the recorded kernels and runs no Python, so the
        # per-layer hooks (wait_for_layer_load, save_kv_layer) are skipped.
        # vLLM replays full graphs for uniform decode batches, and a request
        # whose prefix kvd loads with one prompt token left to compute runs
        # in one: its attention would read pages kvd had not yet filled, a
        # wrong answer with no error. Piecewise graphs stop at every attention
        # call, where the hooks live. Every kvd mode waits in those hooks, so
        # the answer does not depend on extra_config.
        return True

    # ---- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tp_group

        tp, pp = get_tp_group(), get_pp_group()
        try:
            groups = kv_groups(self._kv_cache_config, tuple(kv_caches))  # first: it names a group kvd cannot store
            layout = paged_layout(kv_caches, self._kv_cache_config.num_blocks)
            if groups is not None and self.config.transfer == "daemon":
                raise UnsupportedLayout(f"transfer = \"daemon\" moves one KV cache group, and this hybrid model has "
                                        f"{groups.count}: use transfer = \"client\"")
            layout = dataclasses.replace(layout, groups=groups)
            dtype = next(iter(kv_caches.values())).dtype
            spec = namespace_spec(self._vllm_config, layout, dtype, namespace=self.config.namespace,
                                  tp=(tp.rank_in_group, tp.world_size), pp=(pp.rank_in_group, pp.world_size))
        except UnsupportedLayout as error:
            log.error("kvd connector disabled on this worker: %s", error)
            return
        shard = pp.rank_in_group * tp.world_size + tp.rank_in_group
        # A namespace every TP rank shares (an MLA latent) is stored by rank 0; the others only load.
        self._saves = spec.tp_size == tp.world_size or tp.rank_in_group == 0
        namespace = local_namespace(spec)  # registered with kvd on first use, again after a restart
        if self.config.transfer == "daemon":
            tensors = [kv_caches[name] for name in layout.names]
            self.worker = DeviceWorkerSide(self.config, layout, namespace, shard, tensors)
        else:
            self.worker = WorkerSide(self.config, layout, namespace, shard)
        self._spec = spec
        grouping = (f" in {layout.groups.count} KV cache groups ({len(layout.groups.windowed)} windowed)"
                    if layout.groups is not None else "")
        log.info("kvd connector: %d layers%s, namespace %s (%s)", len(layout.names), grouping,
                 namespace.namespace_id.hex()[:16], spec.model_revision)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return KvdHandshake(self._spec) if self._spec is not None else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # The step starts here: vLLM calls start_load_kv after the forward
        # when the step has no synchronous load, too late to reserve slots.
        super().bind_connector_metadata(connector_metadata)
        if self.worker is not None and isinstance(connector_metadata, KvdConnectorMetadata):
            if connector_metadata.declined_blocks:
                self.worker.counters.add(declined_blocks=connector_metadata.declined_blocks)
            if not self._saves:
                connector_metadata = dataclasses.replace(connector_metadata, saves=[])
            if connector_metadata:
                self.worker.start(connector_metadata)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        pass  # started at bind_connector_metadata

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker is not None:
            self.worker.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if self.worker is not None:
            self.worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self.worker is not None:
            self.worker.finish_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.finished() if self.worker is not None else (None, None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.load_errors() if self.worker is not None else set()

    def get_kv_connector_stats(self) -> KvdConnectorStats | None:
        if self.worker is None:
            return None
        stats = KvdConnectorStats(data=self.worker.counters.take(self.worker.totals))
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvdConnectorStats:
        return KvdConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> KvdPromMetrics:
        return KvdPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        for side in (self.worker, self.scheduler):
            if side is not None:
                side.close()

    # ---- scheduler side
    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        handshakes = {key: value for key, value in metadata.items() if isinstance(value, KvdHandshake)}
        if self.scheduler is not None and handshakes:
            self.scheduler.set_shards(handshakes)

    def on_new_request(self, request: Request) -> None:
        self.scheduler.track(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return self.scheduler.build(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        if connector_output.invalid_block_ids:
            self.scheduler.load_failed(set(connector_output.invalid_block_ids))

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # The bytes were copied into kvd's arena during the steps that
        # computed them and committed at the end of each step, so vLLM may
        # free the blocks at once.
        self.scheduler.finished(request)
        return False, None

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0])

    def take_events(self):
        feed = self.scheduler.events if self.scheduler is not None else None
        return feed.take() if feed is not None else ()
