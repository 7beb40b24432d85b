"""The only place where protobuf messages and kvd's own types meet.

Messages are validated on the way in: a value the schema allows but kvd
does not (an unset enum, a zero where a count is needed) is an
InvalidArgument naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from kvd.core.block import Block
from kvd.core.engine import Engine, PrefetchPlan, TierId
from kvd.core.events import Event
from kvd.core.keys import KEY_BYTES, DType, InnerLayout, KvOrder, NamespaceSpec, PackedKeys
from kvd.core.namespace_usage import TierUsage
from kvd.core.namespaces import NamespaceState
from kvd.errors import InvalidArgument, KvdError
from kvd.v1 import kvd_pb2

STATUS_BY_CODE = {code.name: code for code in grpc.StatusCode}


def status_of(error: KvdError) -> grpc.StatusCode:
    return STATUS_BY_CODE.get(error.code, grpc.StatusCode.INTERNAL)


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


_HOST_TIER_BYTE = bytes((int(TierId.HOST),))


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


def tiers(engine: Engine, blocks: Sequence[Block]) -> bytes:
    """One Tier byte per block."""
    if len(engine.tiers) == 1:
        return _HOST_TIER_BYTE * len(blocks)
    return engine.tier_bytes(blocks)


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


def ack_supported(ack: int, has_disk: bool) -> None:
    if ack == kvd_pb2.ACK_DURABLE and not has_disk:
        raise InvalidArgument("ack DURABLE needs a disk tier, and this daemon has none configured")
    if ack not in (kvd_pb2.ACK_UNSPECIFIED, kvd_pb2.ACK_ACCEPTED, kvd_pb2.ACK_HOST, kvd_pb2.ACK_DURABLE):
        raise InvalidArgument(f"ack has unknown value {ack}")


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


def metric_samples(registry) -> list[kvd_pb2.MetricSample]:
    """Every sample of a prometheus_client registry, as /metrics has them
    (less the _created timestamps of counters and histograms)."""
    return [
        kvd_pb2.MetricSample(name=sample.name, labels=sample.labels, value=sample.value)
        for family in registry.collect()
        for sample in family.samples
        if not sample.name.endswith("_created")
    ]
