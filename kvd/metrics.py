"""Every Prometheus metric kvd exports, defined here and only here.

Gauges and totals that the engine already counts are read at scrape time by
`EngineCollector` (the engine stays free of prometheus_client); per-RPC
latency and outcome, and the KV event streams' subscribers and forced
resyncs, are observed by the server through `RpcMetrics`. With a disk
tier, `DiskIoMetrics` reads the I/O thread's queues and byte totals at
scrape time and is handed each disk job's wait and run time as it ends.
The Stats RPC returns every sample too (StatsRequest.include_metrics), so
`kvd status` shows the numbers Prometheus scrapes.

Hits and misses by tier: a Get key is looked for in host memory, then on
disk. A host miss is a page fault: the key was then a disk hit (read back
into host memory) or a disk miss (stored nowhere). So, with a disk tier,
host misses = disk hits + disk misses, and host hits + disk hits = the
Get hits of kvd_get_blocks_total.

| metric | type | labels | meaning |
|---|---|---|---|
| kvd_tier_blocks | gauge | tier | blocks resident in the tier |
| kvd_tier_used_bytes | gauge | tier | capacity taken by resident blocks (whole slots) |
| kvd_tier_payload_bytes | gauge | tier | bytes of the resident blocks themselves |
| kvd_tier_capacity_bytes | gauge | tier | configured capacity |
| kvd_tier_pinned_blocks | gauge | tier | blocks pinned by a handle or lease |
| kvd_tier_evictions_total | counter | tier | blocks evicted on demand, to free a slot for another block |
| kvd_tier_evicted_blocks_total | counter | tier, reason | blocks that left a tier to make room, by reason: host demoted (on demand; its disk copy stays), demoted_background (above the high watermark), demoted_requested (by a Demote call), dropped (no disk copy: gone from every tier), not_admitted (dropped: the disk admission filter never admitted it); disk dropped (no host copy: gone from every tier), host_copy_kept (only the disk copy went) |
| kvd_tier_hits_total | counter | tier | Get keys served from the tier: host (resident), disk (read back into host memory) |
| kvd_tier_misses_total | counter | tier | Get keys the tier did not hold: for host, page faults (served from disk, or stored nowhere); for disk, keys stored nowhere |
| kvd_tier_moves_total | counter | source_tier, target_tier | blocks written to disk / loaded back |
| kvd_host_demotions_total | counter | | host copies dropped because a disk copy exists |
| kvd_disk_failures_total | counter | operation | disk blocks that failed to write, load (corrupt or unreadable) or recover |
| kvd_disk_write_queue | gauge | | write backlog: sealed blocks queued to be written to disk (whatever disk.write_mode) |
| kvd_disk_admission_rejected_total | counter | | blocks dropped from host memory unwritten because the disk admission filter (disk.admission_min_hits) never admitted them |
| kvd_disk_queue_jobs | gauge | class | disk jobs queued, not yet running, by I/O class (restore, prefetch, write, control) |
| kvd_disk_io_bytes_total | counter | operation | bytes read from (read) and written to (write) the drives |
| kvd_disk_drive_state | gauge | drive, state | 1 for each drive's state, 0 for the others: ok; failed (a manifest append or sync failed: no more writes until a restart); quarantined (its metadata could not be read at start: out of service, its blocks lost until `kvd fsck --repair`) |
| kvd_disk_recovery_lost_blocks | gauge | | blocks the drives' metadata described that the last start could not recover: records dropped (missing segment, unknown namespace, ...), records destroyed by damage inside a manifest (at least), and the blocks of quarantined drives (where known) |
| kvd_disk_job_wait_seconds | histogram | class | time a disk job waited in its queue before it ran |
| kvd_disk_slack_writes_total | counter | | write-back jobs run inside a restore, between its layer groups, in the slack disk.slack_profile says the layers leave |
| kvd_disk_write_chunks_total | counter | | write-back chunks sent to the drives (one data batch each; a write job runs one while reads are under way, else several, pipelined): written bytes over chunks is the chunk size |
| kvd_disk_commits_total | counter | | commits under disk.fsync group or none: each drive's written segments fdatasynced, then its manifest; a durable ack waits for one (every group_commit_ms, or at once when a client waits) |
| kvd_disk_fdatasyncs_total | counter | | segment files fdatasynced (per write chunk under strict, per commit otherwise) |
| kvd_disk_corrupt_blocks_total | counter | namespace | blocks read from the drives that failed their checksum: lost (never served), recomputed by the engine; each is logged (drive, slot, namespace, key; at most 20 lines a minute) |
| kvd_disk_oldest_unwritten_seconds | gauge | | how long the oldest block queued for the disk has waited, at most (to within the writer's 50 ms turns; 0: none waits): under write_mode behind, what a crash at this moment would lose, in time. Alert when it stays above a few seconds |
| kvd_disk_job_run_seconds | histogram | class | time a disk job ran: restore and prefetch jobs are one read_blocks batch, write jobs one or more write chunks; control is the rest (journal removals, syncs, compaction) |
| kvd_blocks_sealed_total | counter | tier | blocks committed |
| kvd_blocks_aborted_total | counter | tier | reservations aborted or expired unwritten |
| kvd_blocks_deleted_total | counter | tier | blocks removed by Delete and DeleteNamespace |
| kvd_prefetch_blocks_total | counter | result | Prefetch keys: queued (read from disk), already_in_host, already_loading (a read was in flight), refused (a limit was reached), missing (not stored) |
| kvd_prefetch_used_total | counter | | prefetched blocks a Get then matched |
| kvd_prefetch_wasted_total | counter | | prefetched blocks that left host memory before any Get used them (evicted, deleted, failed their read); useful ratio = used / (used + wasted) |
| kvd_prefetch_in_flight_blocks | gauge | | prefetch reads queued or running (at most disk.prefetch_max_blocks) |
| kvd_namespace_blocks | gauge | namespace, model | blocks indexed per namespace |
| kvd_lookup_blocks_total | counter | namespace, result | Lookup keys found (hit) or not (miss) |
| kvd_get_blocks_total | counter | namespace, result | Get keys served (hit) or not (miss) |
| kvd_leases | gauge | | open leases |
| kvd_leases_expired_total | counter | | leases ended by their deadline (how the leases of a client that died are reclaimed) |
| kvd_lease_pinned_blocks | gauge | | block pins held through leases (a block two leases pin counts twice) |
| kvd_lease_clients | gauge | | clients (client ids) holding pins through leases |
| kvd_lease_client_pinned_blocks_max | gauge | | the most blocks one client pins through its leases |
| kvd_lease_client_pin_cap_blocks | gauge | | the cap on that, leases.max_pins_per_client |
| kvd_lease_pin_cap_rejections_total | counter | | Gets and Reserves refused (RESOURCE_EXHAUSTED) because they would take a client past the cap |
| kvd_block_handles | gauge | | live block handles |
| kvd_leaked_handles_total | counter | | handles collected unreleased (a bug) |
| kvd_events_total | counter | kind | KV events published (stored, removed, tier_changed); one event carries a batch of keys |
| kvd_event_keys_total | counter | kind | block keys those events carried |
| kvd_event_ring_keys | gauge | | keys held by the ring of recent events |
| kvd_event_subscribers | gauge | | open WatchEvents streams |
| kvd_event_resyncs_total | counter | reason | subscribers told to resynchronise (sequence_too_old, subscriber_too_slow, instance_changed) |
| kvd_arena_huge_page_bytes | gauge | | bytes of the arena the daemon maps with huge pages (0 where shmem gets none: see host.huge_pages in docs/operations.md) |
| kvd_arena_handouts_total | counter | | arena file descriptors handed to clients over the arena socket (refusals count in kvd_auth_failures_total) |
| kvd_arena_slot_tenant_changes_total | counter | | host slots moved to another tenant's arena file (auth.mode = "token"): each is a remap in the daemon and the slot's pages punched out of the previous tenant's file |
| kvd_device_pools | gauge | | engines' KV pools registered with the device plane ([device] kind) |
| kvd_device_blocks_total | counter | op | blocks kvd copied out of engines' pools (save) and into them (load) |
| kvd_device_disk_loads_total | counter | result | LoadLayers whose blocks were read from disk and went to the engine's pages layer by layer as each landed: landed, or failed (a read failed or the Get ended early; the flag word got FAILED) |
| kvd_device_ring_loads_total | counter | result | LoadLayers of a pool with io_ring whose disk blocks the engine read through the pool's I/O ring: verified (every granted read checked out and landed), or failed (a read failed its checksum or the drive, or a grant was unused at [device] flag_timeout_ms and revoked) |
| kvd_device_tier_blocks | gauge | | blocks held in the device tier ([device] tier_bytes) |
| kvd_device_tier_slots | gauge | | slots of the device tier (0: none) |
| kvd_device_tier_used_slots | gauge | | slots of the device tier holding copies (or being written) |
| kvd_device_tier_host_layers_total | counter | | layers of device tier copies that their save's placement plan (SaveLayers offload_distance) left in host memory |
| kvd_device_tier_lookups_total | counter | result | loaded blocks found in the device tier (hit: copied device to device) or not (miss: from host memory) |
| kvd_device_tier_evictions_total | counter | | device tier copies dropped to make room |
| kvd_cluster_members | gauge | | live cluster members in this daemon's view, itself included ([cluster]) |
| kvd_cluster_joined | gauge | | 1 while this daemon holds its member lease and watches the members; 0 while etcd is out of reach (the view is then as last seen) |
| kvd_cluster_etcd_sessions_total | counter | | etcd sessions this daemon has joined through (1 + rejoins) |
| kvd_cluster_fetched_blocks_total | counter | peer, transport | blocks fetched from a peer, verified and sealed here, by peer and transport (nixl, grpc) |
| kvd_cluster_failed_fetches_total | counter | peer | fetches from a peer cut short (dead or slow peer, bad bytes); the rest of the chain was a miss |
| kvd_cluster_peer | gauge | peer, transport | 1 for each peer in the view, labelled with how blocks from it move: nixl-rdma, nixl-tcp (TCP or shared memory) or grpc |
| kvd_cluster_fetch_seconds_total | counter | transport, stage | seconds fetches spent per stage: lookup (the directory); for nixl pin (PinBlocks), read (the READs, each piece checksummed while the next lands), release (ReleasePins, which hands over the holder's checksums), verify (the comparison), seal; for grpc stream (received, checked and written); and whole (each fetch from its lookup to its seal) |
| kvd_cluster_fetch_bytes_total | counter | transport | bytes fetches moved from peers (a NIXL READ, a gRPC stream); over a stage's seconds, its rate: the READ's own beside the whole fetch's, one transport's fetch beside the other's |
| kvd_tenant_used_bytes | gauge | tenant, tier | capacity a tenant's blocks take (whole slots; auth.mode = "token"): host counts blocks being written or read back, disk blocks being written |
| kvd_tenant_quota_bytes | gauge | tenant, tier | a tenant's quota, where one is set |
| kvd_tenant_quota_refusals_total | counter | tenant, tier | host: Puts refused (RESOURCE_EXHAUSTED) for the tenant's host quota; disk: blocks left unwritten for its disk quota |
| kvd_tenant_quota_evictions_total | counter | tenant, tier | the tenant's own blocks evicted to keep it within its quota (host: evicted or demoted for its Puts; disk: their disk copies replaced by its newer blocks) |
| kvd_auth_failures_total | counter | reason | calls refused by authentication: missing_token, unknown_token (UNAUTHENTICATED), not_admin (PERMISSION_DENIED) |
| kvd_rpc_duration_seconds | histogram | method | server-side RPC latency |
| kvd_rpc_total | counter | method, code | RPCs by outcome |
| kvd_rpc_in_flight | gauge | | RPCs being handled |
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvd.core.events import EventKind

if TYPE_CHECKING:
    from kvd.core.engine import Engine
    from kvd.core.tier import Tier

# RPCs here take from tens of microseconds (Lookup) to tens of milliseconds
# (inline transfers of large batches).
RPC_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
# Disk jobs take from tens of microseconds (a journal append, a small write
# chunk) to seconds (a large restore behind a busy drive).
DRIVE_STATES = ("ok", "failed", "quarantined")
DISK_JOB_BUCKETS_S = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                      1.0, 2.5, 10.0)


class EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        yield from _tier_metrics(engine)
        yield from _disk_metrics(engine)

        prefetch = engine.prefetch_counters
        prefetch_blocks = CounterMetricFamily("kvd_prefetch_blocks", "Prefetch keys by result.", labels=["result"])
        for result, value in (("queued", prefetch.queued), ("already_in_host", prefetch.in_host),
                              ("already_loading", prefetch.loading), ("refused", prefetch.refused),
                              ("missing", prefetch.missing)):
            prefetch_blocks.add_metric([result], value)
        yield prefetch_blocks
        yield CounterMetricFamily("kvd_prefetch_used", "Prefetched blocks a Get then matched.", value=prefetch.used)
        yield CounterMetricFamily("kvd_prefetch_wasted",
                                  "Prefetched blocks that left host memory before any Get used them.",
                                  value=prefetch.wasted)
        yield GaugeMetricFamily("kvd_prefetch_in_flight_blocks", "Prefetch reads queued or running.",
                                value=engine.prefetch_in_flight)

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
        leases = engine.leases
        yield GaugeMetricFamily("kvd_lease_pinned_blocks", "Block pins held through leases.", value=leases.pinned_total)
        yield GaugeMetricFamily("kvd_lease_clients", "Clients holding pins through leases.",
                                value=leases.pinning_clients())
        yield GaugeMetricFamily("kvd_lease_client_pinned_blocks_max", "The most blocks one client pins through leases.",
                                value=leases.max_client_pins())
        yield GaugeMetricFamily("kvd_lease_client_pin_cap_blocks", "Cap on the blocks one client may pin.",
                                value=leases.max_pins_per_client)
        yield CounterMetricFamily("kvd_lease_pin_cap_rejections", "Requests refused by the per-client pin cap.",
                                  value=leases.pin_cap_rejections)
        yield from _tenant_metrics(engine)
        yield GaugeMetricFamily("kvd_block_handles", "Live block handles.", value=engine.live_handles)
        yield CounterMetricFamily(
            "kvd_leaked_handles", "Block handles collected while still holding a reference.", value=engine.leaked_handles
        )


def _per_tier(family: type, name: str, doc: str, tiers: Sequence[Tier], value: Callable[[Tier], float]) -> Metric:
    metric = family(name, doc, labels=["tier"])
    for tier in tiers:
        metric.add_metric([tier.name], value(tier))
    return metric


def _tier_metrics(engine: Engine) -> Iterator[Metric]:
    """The tier-labelled families: one sample per tier of the stack, whatever the stack holds."""
    tiers = list(engine.tiers)
    # Puts land, and pins hold blocks, where clients map them.
    mappable = [tier for tier in tiers if tier.caps.client_mappable]
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    yield _per_tier(gauge, "kvd_tier_blocks", "Blocks resident in the tier.", tiers,
                    lambda tier: tier.pool.resident_blocks)
    yield _per_tier(gauge, "kvd_tier_used_bytes", "Capacity taken by resident blocks (whole slots).", tiers,
                    lambda tier: tier.pool.occupied_bytes)
    yield _per_tier(gauge, "kvd_tier_payload_bytes", "Bytes of the resident blocks themselves.", tiers,
                    lambda tier: tier.pool.used_bytes)
    yield _per_tier(gauge, "kvd_tier_capacity_bytes", "Configured capacity of the tier.", tiers,
                    lambda tier: tier.pool.capacity_bytes)
    yield _per_tier(gauge, "kvd_tier_pinned_blocks", "Blocks pinned by a handle or lease.", mappable,
                    lambda tier: engine.pinned_blocks)
    yield _per_tier(counter, "kvd_tier_evictions", "Blocks evicted on demand, to free a slot.", tiers,
                    lambda tier: tier.counters.evictions)
    yield _per_tier(counter, "kvd_tier_hits", "Get keys served from the tier.", tiers, lambda tier: tier.counters.hits)
    yield _per_tier(counter, "kvd_tier_misses", "Get keys the tier did not hold (host: page faults).", tiers,
                    lambda tier: tier.counters.misses)
    evicted = CounterMetricFamily("kvd_tier_evicted_blocks", "Blocks that left a tier to make room, by reason.",
                                  labels=["tier", "reason"])
    for tier in tiers:
        for reason, value in _eviction_reasons(engine, tier):
            evicted.add_metric([tier.name, reason], value)
    yield evicted
    storage = [tier for tier in tiers if tier.caps.persistent]
    if storage:
        moves = CounterMetricFamily("kvd_tier_moves", "Blocks moved between tiers.", labels=["source_tier", "target_tier"])
        for upper in mappable:
            for lower in storage:
                moves.add_metric([upper.name, lower.name], lower.counters.written)
                moves.add_metric([lower.name, upper.name], lower.counters.loaded)
        yield moves
    yield _per_tier(counter, "kvd_blocks_sealed", "Blocks committed.", mappable, lambda tier: tier.counters.sealed)
    yield _per_tier(counter, "kvd_blocks_aborted", "Reservations aborted or expired unwritten.", mappable,
                    lambda tier: tier.counters.aborted)
    yield _per_tier(counter, "kvd_blocks_deleted", "Blocks removed by Delete and DeleteNamespace.", mappable,
                    lambda tier: tier.counters.deleted)


def _eviction_reasons(engine: Engine, tier: Tier) -> list[tuple[str, int]]:
    """(reason, blocks) for kvd_tier_evicted_blocks: why blocks left `tier` to make room."""
    counters = tier.counters
    if tier.caps.persistent:
        # The rest of its evictions kept the copy above it.
        return [("dropped", counters.dropped), ("host_copy_kept", counters.evictions - counters.dropped)]
    on_demand = counters.demotions - counters.background_demotions - counters.requested_demotions
    reasons = [("demoted", on_demand), ("demoted_background", counters.background_demotions),
               ("demoted_requested", counters.requested_demotions), ("dropped", counters.dropped)]
    storage = [lower for lower in engine.tiers if lower.caps.persistent]
    if storage:
        reasons.append(("not_admitted", sum(lower.counters.admission_rejected for lower in storage)))
    return reasons


def _disk_metrics(engine: Engine) -> Iterator[Metric]:
    """What only the disk tier has: failures, the write-back queue, the admission filter."""
    disk = engine.disk
    if disk is None:
        return
    counters = disk.counters
    yield CounterMetricFamily("kvd_host_demotions", "Host copies dropped because a disk copy exists.",
                              value=engine.host.counters.demotions)
    failures = CounterMetricFamily("kvd_disk_failures", "Disk blocks that failed.", labels=["operation"])
    failures.add_metric(["write"], counters.write_failures)
    failures.add_metric(["load"], counters.load_failures)
    failures.add_metric(["recovery_drop"], counters.recovery_dropped)
    yield failures
    yield GaugeMetricFamily("kvd_disk_write_queue", "Sealed blocks queued to be written to disk.",
                            value=len(engine.write_queue))
    yield CounterMetricFamily(
        "kvd_disk_admission_rejected",
        "Blocks dropped from host memory unwritten: the disk admission filter never admitted them.",
        value=counters.admission_rejected,
    )


def _tenant_metrics(engine: Engine) -> Iterator[Metric]:
    """Usage, quotas and quota outcomes per tenant: one label value per tenant
    configured (or recovered from disk), so the cardinality stays bounded."""
    if not engine.tenants:
        return
    tiers = ("host", "disk") if engine.disk is not None else ("host",)
    used = GaugeMetricFamily("kvd_tenant_used_bytes", "Capacity a tenant's blocks take.", labels=["tenant", "tier"])
    quota_bytes = GaugeMetricFamily("kvd_tenant_quota_bytes", "A tenant's quota.", labels=["tenant", "tier"])
    refusals = CounterMetricFamily("kvd_tenant_quota_refusals", "Puts refused (host) and blocks left unwritten "
                                   "(disk) for a tenant's quota.", labels=["tenant", "tier"])
    evictions = CounterMetricFamily("kvd_tenant_quota_evictions", "A tenant's blocks evicted to keep it within "
                                    "its quota.", labels=["tenant", "tier"])
    for name, quota in sorted(engine.tenants.items()):
        counters = quota.counters
        values = {
            "host": (quota.host_used_bytes, quota.host_limit_bytes, counters.host_refused, counters.host_evicted),
            "disk": (quota.disk_used_bytes, quota.disk_limit_bytes, counters.disk_refused, counters.disk_evicted),
        }
        for tier in tiers:
            used_value, limit, refused, evicted = values[tier]
            used.add_metric([name, tier], used_value)
            if limit:
                quota_bytes.add_metric([name, tier], limit)
            refusals.add_metric([name, tier], refused)
            evictions.add_metric([name, tier], evicted)
    yield used
    yield quota_bytes
    yield refusals
    yield evictions


class RpcMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        # The registry these belong to: the Stats RPC returns its samples.
        self.registry = registry
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
        self.auth_failures = Counter(
            "kvd_auth_failures", "Calls refused by authentication, by reason.", ["reason"], registry=registry
        )


class DiskIoCollector(Collector):
    """Disk queue depths, byte totals and drive states, read when scraped."""

    def __init__(self, queued_jobs: Callable[[], Mapping[str, int]], io_bytes: Callable[[], tuple[int, int]],
                 drive_states: Callable[[], Sequence[str]] = tuple,
                 recovery_lost: Callable[[], int] = int, slack_writes: Callable[[], int] = int,
                 write_chunks: Callable[[], int] = int, totals: Callable[[], tuple[int, int, Mapping[bytes, int]]] = lambda: (0, 0, {}),
                 oldest_unwritten: Callable[[], float] = float) -> None:
        self._queued_jobs = queued_jobs
        self._oldest_unwritten = oldest_unwritten
        self._totals = totals
        self._io_bytes = io_bytes
        self._drive_states = drive_states
        self._recovery_lost = recovery_lost
        self._slack_writes = slack_writes
        self._write_chunks = write_chunks

    def collect(self) -> Iterator[Metric]:
        queued = GaugeMetricFamily("kvd_disk_queue_jobs", "Disk jobs queued, not yet running, by I/O class.",
                                   labels=["class"])
        for io_class, count in self._queued_jobs().items():
            queued.add_metric([io_class], count)
        yield queued
        read_bytes, written_bytes = self._io_bytes()
        io_bytes = CounterMetricFamily("kvd_disk_io_bytes", "Bytes read from and written to the drives.",
                                       labels=["operation"])
        io_bytes.add_metric(["read"], read_bytes)
        io_bytes.add_metric(["write"], written_bytes)
        yield io_bytes
        states = GaugeMetricFamily("kvd_disk_drive_state", "1 for each drive's state: ok, failed (no more writes "
                                   "until a restart) or quarantined (metadata unreadable at start).",
                                   labels=["drive", "state"])
        for drive, current in enumerate(self._drive_states()):
            for state in DRIVE_STATES:
                states.add_metric([str(drive), state], 1 if state == current else 0)
        yield states
        yield GaugeMetricFamily("kvd_disk_recovery_lost_blocks", "Blocks the drives' metadata described that the "
                                "last start could not recover (dropped, destroyed by damage, on quarantined drives).",
                                value=self._recovery_lost())
        yield CounterMetricFamily("kvd_disk_slack_writes", "Write jobs run inside a restore, in its layers' slack.",
                                  value=self._slack_writes())
        yield CounterMetricFamily("kvd_disk_write_chunks", "Write-back chunks sent to the drives (data batches).",
                                  value=self._write_chunks())
        commits, fdatasyncs, corrupt = self._totals()
        yield CounterMetricFamily("kvd_disk_commits", "Commits (every drive's written data, then its manifest, "
                                  "synced) under fsync group or none.", value=commits)
        yield CounterMetricFamily("kvd_disk_fdatasyncs", "Segment files fdatasynced.", value=fdatasyncs)
        damaged = CounterMetricFamily("kvd_disk_corrupt_blocks", "Blocks read from the drives that failed their "
                                      "checksum (lost, recomputed), per namespace.", labels=["namespace"])
        for namespace_id, count in sorted(corrupt.items()):
            damaged.add_metric([namespace_id.hex()[:16]], count)
        yield damaged
        yield GaugeMetricFamily("kvd_disk_oldest_unwritten_seconds", "How long the oldest block queued for the "
                                "disk has waited (at most): what a crash now would lose, in time.",
                                value=self._oldest_unwritten())


class ArenaCollector(Collector):
    """The host arena's counters, read when scraped."""

    def __init__(self, handouts: Callable[[], int], tenant_changes: Callable[[], int],
                 huge_page_bytes: Callable[[], int] = lambda: 0) -> None:
        self._handouts = handouts
        self._tenant_changes = tenant_changes
        self._huge_page_bytes = huge_page_bytes

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily("kvd_arena_handouts", "Arena file descriptors handed to clients.",
                                  value=self._handouts())
        yield CounterMetricFamily("kvd_arena_slot_tenant_changes",
                                  "Host slots moved to another tenant's arena file.", value=self._tenant_changes())
        yield GaugeMetricFamily("kvd_arena_huge_page_bytes", "Shared memory the daemon maps with huge pages.",
                                value=self._huge_page_bytes())


class DeviceCollector(Collector):
    """The device plane's counters (kvd.planes.device), read when scraped."""

    def __init__(self, counters: Callable[[], Mapping[str, int]]) -> None:
        self._counters = counters

    def collect(self) -> Iterator[Metric]:
        c = self._counters()
        yield GaugeMetricFamily("kvd_device_pools", "Engines' KV pools registered.", value=c["pools"])
        moved = CounterMetricFamily("kvd_device_blocks", "Blocks kvd copied between engines' pools and its tiers.",
                                    labels=["op"])
        moved.add_metric(["save"], c["saved_blocks"])
        moved.add_metric(["load"], c["loaded_blocks"])
        yield moved
        from_disk = CounterMetricFamily("kvd_device_disk_loads", "LoadLayers sent to the engine layer by layer as "
                                        "their blocks landed from disk.", labels=["result"])
        from_disk.add_metric(["landed"], c["disk_loads_landed"])
        from_disk.add_metric(["failed"], c["disk_loads_failed"])
        yield from_disk
        by_ring = CounterMetricFamily("kvd_device_ring_loads", "LoadLayers whose disk blocks went through the "
                                      "pool's I/O ring.", labels=["result"])
        by_ring.add_metric(["verified"], c["ring_loads_verified"])
        by_ring.add_metric(["failed"], c["ring_loads_failed"])
        yield by_ring
        yield GaugeMetricFamily("kvd_device_tier_blocks", "Blocks held in the device tier.", value=c["tier_blocks"])
        yield GaugeMetricFamily("kvd_device_tier_slots", "Slots of the device tier (0: no device tier).",
                                value=c["tier_slots"])
        yield GaugeMetricFamily("kvd_device_tier_used_slots", "Slots of the device tier holding copies.",
                                value=c["tier_used_slots"])
        yield CounterMetricFamily("kvd_device_tier_host_layers", "Layers of device tier copies their plan left "
                                  "in host memory.", value=c["tier_host_layers"])
        lookups = CounterMetricFamily("kvd_device_tier_lookups", "Loaded blocks looked up in the device tier.",
                                      labels=["result"])
        lookups.add_metric(["hit"], c["tier_hits"])
        lookups.add_metric(["miss"], c["tier_misses"])
        yield lookups
        yield CounterMetricFamily("kvd_device_tier_evictions", "Device tier copies dropped to make room.",
                                  value=c["tier_evictions"])


class DiskIoMetrics:
    """The disk I/O thread's metrics.

    queued_jobs() gives the jobs queued per I/O class and io_bytes() the
    bytes (read, written) so far; both are called at scrape time, from the
    scraping thread. observe_job is called by the I/O thread as each job
    ends (prometheus_client's histograms take their own lock).
    """

    def __init__(self, registry: CollectorRegistry, queued_jobs: Callable[[], Mapping[str, int]],
                 io_bytes: Callable[[], tuple[int, int]], drive_states: Callable[[], Sequence[str]] = tuple,
                 recovery_lost: Callable[[], int] = int, slack_writes: Callable[[], int] = int,
                 write_chunks: Callable[[], int] = int, totals: Callable[[], tuple[int, int, Mapping[bytes, int]]] = lambda: (0, 0, {}),
                 oldest_unwritten: Callable[[], float] = float) -> None:
        registry.register(DiskIoCollector(queued_jobs, io_bytes, drive_states, recovery_lost, slack_writes,
                                          write_chunks, totals, oldest_unwritten))
        self.job_wait = Histogram("kvd_disk_job_wait_seconds", "Time a disk job waited in its queue.", ["class"],
                                  buckets=DISK_JOB_BUCKETS_S, registry=registry)
        self.job_run = Histogram("kvd_disk_job_run_seconds", "Time a disk job ran.", ["class"],
                                 buckets=DISK_JOB_BUCKETS_S, registry=registry)
        for io_class in queued_jobs():
            # Every class is exported, at zero, before its first job.
            self.job_wait.labels(io_class)
            self.job_run.labels(io_class)

    def observe_job(self, io_class: str, wait_s: float, run_s: float) -> None:
        self.job_wait.labels(io_class).observe(wait_s)
        self.job_run.labels(io_class).observe(run_s)


def make_registry(engine: Engine) -> tuple[CollectorRegistry, RpcMetrics]:
    registry = CollectorRegistry(auto_describe=True)
    registry.register(EngineCollector(engine))
    return registry, RpcMetrics(registry)


class ClusterCollector(Collector):
    """Cluster membership as this daemon sees it, read when scraped."""

    def __init__(self, members: Callable[[], int], joined: Callable[[], bool], sessions: Callable[[], int],
                 fetched: Callable[[], Mapping[tuple[str, str], int]] = dict,
                 failed_fetches: Callable[[], Mapping[str, int]] = dict,
                 peers: Callable[[], Mapping[str, str]] = dict,
                 stage_seconds: Callable[[], Mapping[tuple[str, str], float]] = dict,
                 moved_bytes: Callable[[], Mapping[str, int]] = dict) -> None:
        self._stage_seconds = stage_seconds
        self._moved_bytes = moved_bytes
        self._members = members
        self._joined = joined
        self._sessions = sessions
        self._fetched = fetched
        self._failed_fetches = failed_fetches
        self._peers = peers

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("kvd_cluster_members", "Live cluster members in this daemon's view, itself included.",
                                value=self._members())
        yield GaugeMetricFamily("kvd_cluster_joined",
                                "1 while this daemon holds its member lease and watches the members; 0 while "
                                "etcd is out of reach (the view is then as last seen).", value=int(self._joined()))
        yield CounterMetricFamily("kvd_cluster_etcd_sessions",
                                  "etcd sessions this daemon has joined through (1 + rejoins).", value=self._sessions())
        fetched = CounterMetricFamily("kvd_cluster_fetched_blocks",
                                      "Blocks fetched from peers, verified and sealed here, by peer and transport.",
                                      labels=["peer", "transport"])
        for (peer, transport), count in sorted(self._fetched().items()):
            fetched.add_metric([peer, transport], count)
        yield fetched
        failed = CounterMetricFamily("kvd_cluster_failed_fetches",
                                     "Fetches from peers cut short (dead or slow peer, bad bytes), by peer; the rest "
                                     "were misses.", labels=["peer"])
        for peer, count in sorted(self._failed_fetches().items()):
            failed.add_metric([peer], count)
        yield failed
        peers = GaugeMetricFamily("kvd_cluster_peer",
                                  "1 for each peer in this daemon's view, labelled with the transport blocks from it "
                                  "take: nixl-rdma, nixl-tcp (TCP or shared memory) or grpc.",
                                  labels=["peer", "transport"])
        for peer, transport in sorted(self._peers().items()):
            peers.add_metric([peer, transport], 1)
        yield peers
        stages = CounterMetricFamily("kvd_cluster_fetch_seconds", "Seconds fetches spent in each stage, by "
                                     "transport: lookup, pin, read, release, verify, seal (nixl), stream (grpc), and "
                                     "whole fetches.", labels=["transport", "stage"])
        for (transport, stage), seconds in sorted(self._stage_seconds().items()):
            stages.add_metric([transport, stage], seconds)
        yield stages
        moved = CounterMetricFamily("kvd_cluster_fetch_bytes", "Bytes fetches moved from peers, by transport.",
                                    labels=["transport"])
        for transport, count in sorted(self._moved_bytes().items()):
            moved.add_metric([transport], count)
        yield moved
