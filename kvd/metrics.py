"""Every Prometheus metric kvd exports, defined here and only here.

Gauges and totals that the engine already counts are read at scrape time by
`EngineCollector` (the engine stays free of prometheus_client); per-RPC
latency and outcome, and the KV event streams' subscribers and forced
resyncs, are observed by the server through `RpcMetrics`.

| metric | type | labels | meaning |
|---|---|---|---|
| kvd_tier_blocks | gauge | tier | blocks resident in the tier |
| kvd_tier_used_bytes | gauge | tier | capacity taken by resident blocks (whole slots) |
| kvd_tier_payload_bytes | gauge | tier | bytes of the resident blocks themselves |
| kvd_tier_capacity_bytes | gauge | tier | configured capacity |
| kvd_tier_pinned_blocks | gauge | tier | blocks pinned by a handle or lease |
| kvd_tier_evictions_total | counter | tier | blocks evicted to make room |
| kvd_tier_moves_total | counter | source_tier, target_tier | blocks written to disk / loaded back |
| kvd_host_demotions_total | counter | | host copies dropped because a disk copy exists |
| kvd_disk_failures_total | counter | operation | disk blocks that failed to write, load (corrupt or unreadable) or recover |
| kvd_disk_write_queue | gauge | | sealed blocks waiting for write-through |
| kvd_disk_admission_rejected_total | counter | | blocks dropped from host memory unwritten because the disk admission filter (disk.admission_min_hits) never admitted them |
| kvd_blocks_sealed_total | counter | tier | blocks committed |
| kvd_blocks_aborted_total | counter | tier | reservations aborted or expired unwritten |
| kvd_blocks_deleted_total | counter | tier | blocks removed by Delete |
| kvd_namespace_blocks | gauge | namespace, model | blocks indexed per namespace |
| kvd_lookup_blocks_total | counter | namespace, result | Lookup keys found (hit) or not (miss) |
| kvd_get_blocks_total | counter | namespace, result | Get keys served (hit) or not (miss) |
| kvd_leases | gauge | | open leases |
| kvd_leases_expired_total | counter | | leases ended by their deadline |
| kvd_block_handles | gauge | | live block handles |
| kvd_leaked_handles_total | counter | | handles collected unreleased (a bug) |
| kvd_events_total | counter | kind | KV events published (stored, removed, tier_changed); one event carries a batch of keys |
| kvd_event_keys_total | counter | kind | block keys those events carried |
| kvd_event_ring_keys | gauge | | keys held by the ring of recent events |
| kvd_event_subscribers | gauge | | open WatchEvents streams |
| kvd_event_resyncs_total | counter | reason | subscribers told to resynchronise (sequence_too_old, subscriber_too_slow, instance_changed) |
| kvd_rpc_duration_seconds | histogram | method | server-side RPC latency |
| kvd_rpc_total | counter | method, code | RPCs by outcome |
| kvd_rpc_in_flight | gauge | | RPCs being handled |
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvd.core.events import EventKind

if TYPE_CHECKING:
    from kvd.core.engine import Engine

# RPCs here take from tens of microseconds (Lookup) to tens of milliseconds
# (inline transfers of large batches).
RPC_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        host = engine.host
        counters = host.counters

        disk = engine.disk

        def tier_gauge(name: str, doc: str, host_value: float, disk_value: float | None = None) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["tier"])
            family.add_metric(["host"], host_value)
            if disk is not None and disk_value is not None:
                family.add_metric(["disk"], disk_value)
            return family

        def tier_counter(name: str, doc: str, host_value: float, disk_value: float | None = None) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["tier"])
            family.add_metric(["host"], host_value)
            if disk is not None and disk_value is not None:
                family.add_metric(["disk"], disk_value)
            return family

        yield tier_gauge("kvd_tier_blocks", "Blocks resident in the tier.", host.resident_blocks,
                         disk.resident_blocks if disk else None)
        yield tier_gauge("kvd_tier_used_bytes", "Capacity taken by resident blocks (whole slots).", host.occupied_bytes,
                         disk.resident_blocks * disk.slot_bytes if disk else None)
        yield tier_gauge("kvd_tier_payload_bytes", "Bytes of the resident blocks themselves.", host.used_bytes,
                         disk.used_bytes if disk else None)
        yield tier_gauge("kvd_tier_capacity_bytes", "Configured capacity of the tier.", host.capacity_bytes,
                         disk.capacity_bytes if disk else None)
        yield tier_gauge("kvd_tier_pinned_blocks", "Blocks pinned by a handle or lease.", engine.pinned_blocks)
        yield tier_counter("kvd_tier_evictions", "Blocks evicted to make room.", counters.evictions,
                           disk.counters.evictions if disk else None)
        if disk is not None:
            disk_counters = disk.counters
            moves = CounterMetricFamily(
                "kvd_tier_moves", "Blocks moved between tiers.", labels=["source_tier", "target_tier"]
            )
            moves.add_metric(["host", "disk"], disk_counters.written)
            moves.add_metric(["disk", "host"], disk_counters.loaded)
            yield moves
            yield CounterMetricFamily("kvd_host_demotions", "Host copies dropped because a disk copy exists.",
                                      value=counters.demotions)
            failures = CounterMetricFamily("kvd_disk_failures", "Disk blocks that failed.", labels=["operation"])
            failures.add_metric(["write"], disk_counters.write_failures)
            failures.add_metric(["load"], disk_counters.load_failures)
            failures.add_metric(["recovery_drop"], disk_counters.recovery_dropped)
            yield failures
            yield GaugeMetricFamily("kvd_disk_write_queue", "Sealed blocks waiting for write-through.",
                                    value=len(engine.write_queue))
            yield CounterMetricFamily(
                "kvd_disk_admission_rejected",
                "Blocks dropped from host memory unwritten: the disk admission filter never admitted them.",
                value=disk_counters.admission_rejected,
            )
        yield tier_counter("kvd_blocks_sealed", "Blocks committed.", counters.sealed)
        yield tier_counter("kvd_blocks_aborted", "Reservations aborted or expired unwritten.", counters.aborted)
        yield tier_counter("kvd_blocks_deleted", "Blocks removed by Delete.", counters.deleted)

        blocks = GaugeMetricFamily("kvd_namespace_blocks", "Blocks indexed per namespace.", labels=["namespace", "model"])
        lookups = CounterMetricFamily("kvd_lookup_blocks", "Lookup keys by result.", labels=["namespace", "result"])
        gets = CounterMetricFamily("kvd_get_blocks", "Get keys by result.", labels=["namespace", "result"])
        for state in engine.namespaces():
            label = state.namespace_id.hex()[:16]
            blocks.add_metric([label, state.spec.model_id], len(state.index))
            lookups.add_metric([label, "hit"], state.lookup_hits)
            lookups.add_metric([label, "miss"], state.lookup_misses)
            gets.add_metric([label, "hit"], state.get_hits)
            gets.add_metric([label, "miss"], state.get_misses)
        yield blocks
        yield lookups
        yield gets

        events = engine.events
        published = CounterMetricFamily("kvd_events", "KV events published.", labels=["kind"])
        published_keys = CounterMetricFamily("kvd_event_keys", "Block keys carried by KV events.", labels=["kind"])
        for kind in EventKind:
            published.add_metric([kind.name.lower()], events.published_events[kind])
            published_keys.add_metric([kind.name.lower()], events.published_keys[kind])
        yield published
        yield published_keys
        yield GaugeMetricFamily("kvd_event_ring_keys", "Keys held by the ring of recent KV events.",
                                value=events.retained_keys)

        yield GaugeMetricFamily("kvd_leases", "Open leases.", value=len(engine.leases))
        yield CounterMetricFamily("kvd_leases_expired", "Leases ended by their deadline.", value=engine.leases.expired_total)
        yield GaugeMetricFamily("kvd_block_handles", "Live block handles.", value=engine.live_handles)
        yield CounterMetricFamily(
            "kvd_leaked_handles", "Block handles collected while still holding a reference.", value=engine.leaked_handles
        )


class RpcMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(
            "kvd_rpc_duration_seconds",
            "Server-side RPC latency.",
            ["method"],
            buckets=RPC_BUCKETS_S,
            registry=registry,
        )
        self.total = Counter("kvd_rpc", "RPCs by method and status code.", ["method", "code"], registry=registry)
        self.in_flight = Gauge("kvd_rpc_in_flight", "RPCs being handled.", registry=registry)
        self.event_subscribers = Gauge("kvd_event_subscribers", "Open WatchEvents streams.", registry=registry)
        self.event_resyncs = Counter(
            "kvd_event_resyncs", "Subscribers told to resynchronise, by reason.", ["reason"], registry=registry
        )


def make_registry(engine: Engine) -> tuple[CollectorRegistry, RpcMetrics]:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(engine))
    return registry, RpcMetrics(registry)
