"""The only place in kvd.server where protobuf messages and kvd's own types meet.

Every kvd.v1.Kvd message the daemon sends is built here, from engine results, enums,
dataclasses and statistics; the handlers (kvd.server.handlers) read their requests'
fields and call the `*_response` function of their answer. The peers' Cluster service
has its own conversion module, kvd.cluster.wire; kvd/README.md's layer table names
every module that may import kvd.v1.

Messages are validated on the way in: a value the schema allows but kvd
does not (an unset enum, a zero where a count is needed) is an
InvalidArgument naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import grpc

from kvd import __version__
from kvd.core.block import Block
from kvd.core.engine import Engine, PrefetchPlan, TierId
from kvd.core.events import Event
from kvd.core.keys import KEY_BYTES, DType, InnerLayout, KvOrder, NamespaceSpec, PackedKeys
from kvd.core.lease import Lease
from kvd.core.namespace_usage import TierUsage
from kvd.core.namespaces import NamespaceState
from kvd.core.puts import Committed, ReserveResult, ReserveStatus
from kvd.errors import InvalidArgument, KvdError
from kvd.planner.plan import Plan
from kvd.v1 import kvd_pb2

STATUS_BY_CODE = {code.name: code for code in grpc.StatusCode}


def status_of(error: KvdError) -> grpc.StatusCode:
    return STATUS_BY_CODE.get(error.code, grpc.StatusCode.INTERNAL)


# -- requests in ---------------------------------------------------------------------------------

def _enum(kind, field_name: str, value: int):
    if value == 0:
        raise InvalidArgument(f"namespace.{field_name} must be set")
    try:
        return kind(value)
    except ValueError:
        raise InvalidArgument(f"namespace.{field_name} has unknown value {value}") from None


def spec_from_proto(message: kvd_pb2.NamespaceSpec) -> NamespaceSpec:
    if not message.hash_scheme:
        raise InvalidArgument("namespace.hash_scheme must be set")
    return NamespaceSpec(
        model_id=message.model_id,
        model_revision=message.model_revision,
        kv_dtype=_enum(DType, "kv_dtype", message.kv_dtype),
        num_layers=message.num_layers,
        num_kv_heads=message.num_kv_heads,
        head_dim=message.head_dim,
        block_tokens=message.block_tokens,
        inner_layout=_enum(InnerLayout, "inner_layout", message.inner_layout),
        kv_order=_enum(KvOrder, "kv_order", message.kv_order),
        tp_rank=message.tp_rank,
        # proto3 cannot tell 0 from unset; a group size of 0 means 1.
        tp_size=message.tp_size or 1,
        pp_stage=message.pp_stage,
        pp_size=message.pp_size or 1,
        lora_id=message.lora_id,
        tenant_salt=message.tenant_salt,
        hash_scheme=message.hash_scheme,
    )


def lookup_keys(request: kvd_pb2.LookupRequest) -> Sequence[bytes]:
    """A Lookup's keys: packed_keys as they came (no object per key), else the repeated field."""
    if not request.packed_keys:
        return list(request.keys)
    if request.keys:
        raise InvalidArgument("set keys or packed_keys, not both")
    return PackedKeys(request.packed_keys)


def cluster_lookup_keys(request: kvd_pb2.ClusterLookupRequest, max_keys: int) -> PackedKeys:
    """ClusterLookup's keys: whole 32-byte keys, at least one, at most max_keys."""
    packed = request.packed_keys
    if not packed or len(packed) % KEY_BYTES:
        raise InvalidArgument(f"packed_keys: {len(packed)} bytes is not a non-empty whole number of "
                              f"{KEY_BYTES}-byte keys")
    if len(packed) // KEY_BYTES > max_keys:
        raise InvalidArgument(f"packed_keys: {len(packed) // KEY_BYTES} keys, at most {max_keys} (max_batch_keys)")
    return PackedKeys(packed)


def durable_ack(ack: int, has_disk: bool) -> bool:
    """Whether a Put's `ack` asks for its blocks on disk (ACK_DURABLE); InvalidArgument for an
    unknown one, or DURABLE without a disk tier."""
    if ack == kvd_pb2.ACK_DURABLE and not has_disk:
        raise InvalidArgument("ack DURABLE needs a disk tier, and this daemon has none configured")
    if ack not in (kvd_pb2.ACK_UNSPECIFIED, kvd_pb2.ACK_ACCEPTED, kvd_pb2.ACK_HOST, kvd_pb2.ACK_DURABLE):
        raise InvalidArgument(f"ack has unknown value {ack}")
    return ack == kvd_pb2.ACK_DURABLE


# -- namespaces, Lookup, Puts, leases, Delete, Prefetch (handlers/blocks.py) ---------------------

_HOST_TIER_BYTE = bytes((int(TierId.HOST),))


def tiers(engine: Engine, blocks: Sequence[Block]) -> bytes:
    """One Tier byte per block."""
    if len(engine.tiers) == 1:
        return _HOST_TIER_BYTE * len(blocks)
    return engine.tier_bytes(blocks)


def register_namespace_response(state: NamespaceState) -> kvd_pb2.RegisterNamespaceResponse:
    return kvd_pb2.RegisterNamespaceResponse(namespace_id=state.public_id, block_bytes=state.block_bytes,
                                             layer_bytes=state.spec.layer_bytes)


def arena_info_response(arena_socket: str, layout, class_bytes: Sequence[int], instance_id: str,
                        max_message_bytes: int) -> kvd_pb2.ArenaInfoResponse:
    """ArenaInfo: where to get the arena, its `layout` (kvd.tiers.host), the host slot classes' sizes."""
    return kvd_pb2.ArenaInfoResponse(
        arena_socket=arena_socket,
        arena_bytes=layout.arena_bytes,
        slot_bytes=layout.slot_bytes,
        slot_count=layout.slot_count,
        class_bytes=class_bytes,
        instance_id=instance_id,
        max_message_bytes=max_message_bytes,
    )


def lookup_response(tiers: bytes, load_s: Sequence[float] = ()) -> kvd_pb2.LookupResponse:
    """Lookup: a Tier byte per matched block, and their load times when asked."""
    return kvd_pb2.LookupResponse(matched=len(tiers), tiers=tiers, load_s=load_s)


def reserve_response(result: ReserveResult, offsets: Sequence[int]) -> kvd_pb2.ReserveResponse:
    """Reserve: the write lease (0 when nothing was reserved), a status and an arena offset per key."""
    return kvd_pb2.ReserveResponse(
        lease_id=result.lease.lease_id if result.lease else 0,
        lease_deadline_ms=result.lease.deadline_ms if result.lease else 0,
        statuses=[int(status) for status in result.statuses],
        offsets=offsets,
    )


def commit_response(committed: Committed, durable: int) -> kvd_pb2.CommitResponse:
    return kvd_pb2.CommitResponse(sealed=committed.sealed, aborted=committed.aborted, durable=durable)


def put_inline_response(statuses: Sequence[ReserveStatus], sealed: int, durable: int) -> kvd_pb2.PutInlineResponse:
    return kvd_pb2.PutInlineResponse(statuses=[int(status) for status in statuses], sealed=sealed, durable=durable)


def make_durable_response(durable: int) -> kvd_pb2.MakeDurableResponse:
    return kvd_pb2.MakeDurableResponse(durable=durable)


def release_response(released: int) -> kvd_pb2.ReleaseResponse:
    return kvd_pb2.ReleaseResponse(released=released)


def renew_response(deadline_ms: int) -> kvd_pb2.RenewResponse:
    return kvd_pb2.RenewResponse(lease_deadline_ms=deadline_ms)


def delete_response(deleted: int, pinned: int) -> kvd_pb2.DeleteResponse:
    return kvd_pb2.DeleteResponse(deleted=deleted, pinned=pinned)


def prefetch_response(plan: PrefetchPlan, loaded: int) -> kvd_pb2.PrefetchResponse:
    return kvd_pb2.PrefetchResponse(
        matched=plan.matched,
        in_host=plan.in_host,
        loading=plan.loading,
        queued=len(plan.loads),
        refused=plan.refused,
        missing=plan.missing,
        limit=int(plan.limit),
        loaded=loaded,
    )


# -- Gets (handlers/reads.py, get_stream.py) -----------------------------------------------------

def get_response(matched: int, lease: Lease | None, offsets: Sequence[int], tiers: bytes,
                 cut: int) -> kvd_pb2.GetResponse:
    """A Get served from the arena: its lease (0 when nothing is pinned) and the blocks' offsets."""
    return kvd_pb2.GetResponse(
        matched=matched,
        lease_id=lease.lease_id if lease else 0,
        lease_deadline_ms=lease.deadline_ms if lease else 0,
        offsets=offsets,
        tiers=tiers,
        cut=cut,
    )


def inline_get_response(matched: int, blocks: Sequence[bytes], tiers: bytes, cut: int) -> kvd_pb2.GetResponse:
    """A Get with the blocks' bytes in the message."""
    return kvd_pb2.GetResponse(matched=matched, blocks=blocks, tiers=tiers, cut=cut)


def get_layers_response(matched: int, layers_ready: int, lease_id: int = 0, lease_deadline_ms: int = 0,
                        offsets: Sequence[int] = (), tiers: bytes = b"", cut: int = 0) -> kvd_pb2.GetLayersResponse:
    """One GetLayers message; only the first carries the lease, offsets and tiers, only the last the cut."""
    return kvd_pb2.GetLayersResponse(matched=matched, layers_ready=layers_ready, lease_id=lease_id,
                                     lease_deadline_ms=lease_deadline_ms, offsets=offsets, tiers=tiers, cut=cut)


def get_blocks_response(matched: int, blocks_ready: int, lease_id: int = 0, lease_deadline_ms: int = 0,
                        offsets: Sequence[int] = (), tiers: bytes = b"", cut: int = 0) -> kvd_pb2.GetBlocksResponse:
    """One GetBlocks message; only the first carries the lease, offsets and tiers, only the last the cut."""
    return kvd_pb2.GetBlocksResponse(matched=matched, blocks_ready=blocks_ready, lease_id=lease_id,
                                     lease_deadline_ms=lease_deadline_ms, offsets=offsets, tiers=tiers, cut=cut)


# -- KV events (handlers/events.py) --------------------------------------------------------------

# Why a subscriber must start over from a snapshot, by the name kvd_event_resyncs_total counts it under.
_RESYNC_REASONS = {
    "sequence_too_old": kvd_pb2.RESYNC_REASON_SEQUENCE_TOO_OLD,
    "subscriber_too_slow": kvd_pb2.RESYNC_REASON_SUBSCRIBER_TOO_SLOW,
    "instance_changed": kvd_pb2.RESYNC_REASON_INSTANCE_CHANGED,
}


def event_message(event: Event, namespace_id: bytes | None = None) -> kvd_pb2.KvEvent:
    """The event as sent; `namespace_id`: the id its subscriber knows the namespace by."""
    return kvd_pb2.KvEvent(
        kind=int(event.kind),
        sequence=event.sequence,
        namespace_id=event.namespace_id if namespace_id is None else namespace_id,
        keys=event.keys,
        parent_key=event.parent_key,
        tier=event.tier,
    )


def watching_event(sequence: int, namespace_id: bytes, instance_id: str) -> kvd_pb2.KvEvent:
    """A watch's first message: events follow from `sequence` + 1."""
    return kvd_pb2.KvEvent(kind=kvd_pb2.KV_EVENT_KIND_WATCHING, sequence=sequence, namespace_id=namespace_id,
                           instance_id=instance_id)


def resync_event(namespace_id: bytes, sequence: int, reason: str, instance_id: str) -> kvd_pb2.KvEvent:
    """A watch's last message: start over from a snapshot, for `reason` (a key of _RESYNC_REASONS)."""
    return kvd_pb2.KvEvent(kind=kvd_pb2.KV_EVENT_KIND_RESYNC_REQUIRED, sequence=sequence, namespace_id=namespace_id,
                           instance_id=instance_id, resync_reason=_RESYNC_REASONS[reason])


def event_snapshot_response(instance_id: str, sequence: int, block_count: int, part) -> kvd_pb2.EventSnapshotResponse:
    """One message of an EventSnapshot: a `part` of its build (kvd.core.event_snapshot)."""
    return kvd_pb2.EventSnapshotResponse(instance_id=instance_id, sequence=sequence, block_count=block_count,
                                         keys=part.keys, parent_keys=part.parent_keys, tiers=part.tiers)


# -- operators' calls (handlers/admin.py) --------------------------------------------------------

def demote_response(demoted: int, payload_bytes: int, kept: int) -> kvd_pb2.DemoteResponse:
    return kvd_pb2.DemoteResponse(blocks_demoted=demoted, bytes_demoted=payload_bytes, blocks_kept=kept)


def stats_response(engine: Engine, instance_id: str, uptime_s: float, registry=None) -> kvd_pb2.StatsResponse:
    """Stats: the engine's tiers, namespaces and leases, and every metric of `registry` when given."""
    return kvd_pb2.StatsResponse(
        version=__version__,
        instance_id=instance_id,
        uptime_s=uptime_s,
        tiers=[
            kvd_pb2.TierStats(
                tier=int(tier.tier_id),
                blocks=tier.pool.resident_blocks,
                bytes_used=tier.pool.occupied_bytes,
                payload_bytes=tier.pool.used_bytes,
                capacity_bytes=tier.pool.capacity_bytes,
                # Pins hold blocks where clients map them.
                pinned_blocks=engine.pinned_blocks if tier.caps.client_mappable else 0,
                evictions=tier.counters.evictions,
            )
            for tier in engine.tiers
        ],
        namespaces=[
            kvd_pb2.NamespaceStats(namespace_id=state.namespace_id, model_id=state.spec.model_id,
                                   tenant=state.spec.tenant, blocks=len(state.index), block_bytes=state.block_bytes,
                                   hits=state.hits, misses=state.misses)
            for state in engine.namespaces()
        ],
        leases=len(engine.leases),
        leases_expired=engine.leases.expired_total,
        metrics=metric_samples(registry) if registry is not None else [],
    )


def metric_samples(registry) -> list[kvd_pb2.MetricSample]:
    """Every sample of a prometheus_client registry, as /metrics has them
    (less the _created timestamps of counters and histograms)."""
    return [
        kvd_pb2.MetricSample(name=sample.name, labels=sample.labels, value=sample.value)
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    ]


# The spec's fields a NamespaceSpec message carries back to an operator: all but the salt.
_LISTED_SPEC_FIELDS = tuple(name for name in kvd_pb2.NamespaceSpec.DESCRIPTOR.fields_by_name if name != "tenant_salt")


def namespace_info(state: NamespaceState, usage: Sequence[TierUsage]) -> kvd_pb2.NamespaceInfo:
    """One namespace as ListNamespaces reports it, with its per-tier `usage` (kvd.core.namespace_usage)."""
    spec = state.spec
    return kvd_pb2.NamespaceInfo(
        namespace_id=state.namespace_id,
        client_namespace_id=state.public_id,
        tenant=spec.tenant,
        spec=kvd_pb2.NamespaceSpec(**{name: getattr(spec, name) for name in _LISTED_SPEC_FIELDS}),
        salted=bool(spec.tenant_salt),
        block_bytes=state.block_bytes,
        blocks=len(state.index),
        tiers=[kvd_pb2.NamespaceTierUsage(tier=int(tier.tier_id), blocks=tier.blocks,
                                          payload_bytes=tier.payload_bytes, bytes_used=tier.slot_bytes)
               for tier in usage],
        hits=state.hits,
        misses=state.misses,
        disk_enabled=state.index.disk_enabled,
    )


def list_namespaces_response(listed: Sequence[kvd_pb2.NamespaceInfo]) -> kvd_pb2.ListNamespacesResponse:
    """ListNamespaces: the namespaces as `namespace_info` made each, in the order given."""
    return kvd_pb2.ListNamespacesResponse(namespaces=listed)


def delete_namespace_response(deleted: int, pinned: int) -> kvd_pb2.DeleteNamespaceResponse:
    return kvd_pb2.DeleteNamespaceResponse(deleted=deleted, pinned=pinned)


# -- the device plane and placement planning (handlers/device.py, planning.py) --------------------

def register_pool_response(pool) -> kvd_pb2.RegisterPoolResponse:
    """RegisterPool: the registered `pool` (kvd.planes.device.Pool), its I/O ring's token if it has one."""
    return kvd_pb2.RegisterPoolResponse(pool_id=pool.pool_id, lease_deadline_ms=pool.deadline_ms,
                                        flag_words=pool.flag_words,
                                        ring_token=pool.ring.token if pool.ring is not None else "")


def unregister_pool_response() -> kvd_pb2.UnregisterPoolResponse:
    return kvd_pb2.UnregisterPoolResponse()


def save_layers_response(statuses: Sequence[ReserveStatus], stored: int, done: int) -> kvd_pb2.SaveLayersResponse:
    return kvd_pb2.SaveLayersResponse(statuses=[int(status) for status in statuses], stored=stored, done_value=done)


def load_layers_response(matched: int, done: int, from_tier: Sequence[bool], tiers: bytes, cut: int,
                         by_ring: Sequence[bool] = (), ring=None) -> kvd_pb2.LoadLayersResponse:
    """A LoadLayers' answer: each block's tier before the load, the device tier's where it came from
    there; for a pool with an I/O ring, which blocks its `ring` (the reads granted to it) reads."""
    tiers = bytes(TierId.DEVICE if hit else tier for hit, tier in zip(from_tier, tiers))
    response = kvd_pb2.LoadLayersResponse(matched=matched, done_value=done, tiers=tiers, cut=cut, by_ring=by_ring)
    if ring is not None:
        response.ring_reads, response.ring_blocks = ring.rows.astype("<u8").tobytes(), ring.blocks
    return response


def plan_placement_response(result: Plan, compute: tuple[float, ...],
                            bandwidth: float) -> kvd_pb2.PlanPlacementResponse:
    """PlanPlacement: the planner's `result`, with the per-layer compute times and bandwidth it used."""
    return kvd_pb2.PlanPlacementResponse(
        distances=result.distances, paused=result.paused,
        latency_s=result.latency_s if math.isfinite(result.latency_s) else 0.0, window_steps=result.window_steps,
        gpu_bytes=result.gpu_bytes, fits=result.fits, meets_slo=result.meets_slo, exact=result.exact,
        bound_s=result.bound_s, explored=result.explored, layer_compute_s=compute, bandwidth_bps=bandwidth)


def report_step_response(replan: bool, profile) -> kvd_pb2.ReportStepResponse:
    """ReportStep: whether to plan again, and the `profile` (kvd.planner.profile.StepProfile) as it now is."""
    return kvd_pb2.ReportStepResponse(replan=replan, compute_scale=profile.compute_scale,
                                      bandwidth_bps=profile.bandwidth_bps)


# -- the cluster (handlers/cluster.py; the peers' own messages: kvd.cluster.wire) ------------------

def cluster_lookup_response(answer, load_times: bool) -> kvd_pb2.ClusterLookupResponse:
    """ClusterLookup: the router's `answer` (kvd.cluster.router.LookupAnswer), node by node, with each
    node's load_s if asked for."""
    return kvd_pb2.ClusterLookupResponse(
        nodes=[kvd_pb2.NodeMatch(node=match.node, address=match.address, matched=match.matched, local=match.local,
                                 load_s=match.load_s if load_times else 0.0) for match in answer.nodes],
        segments=answer.segments, segments_unanswered=answer.segments_unanswered)
