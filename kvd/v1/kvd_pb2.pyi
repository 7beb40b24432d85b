from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    DTYPE_FLOAT32: _ClassVar[DType]
    DTYPE_FLOAT16: _ClassVar[DType]
    DTYPE_BFLOAT16: _ClassVar[DType]
    DTYPE_FLOAT8_E4M3: _ClassVar[DType]
    DTYPE_FLOAT8_E5M2: _ClassVar[DType]
    DTYPE_INT8: _ClassVar[DType]

class InnerLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INNER_LAYOUT_UNSPECIFIED: _ClassVar[InnerLayout]
    INNER_LAYOUT_TOKEN_HEAD_DIM: _ClassVar[InnerLayout]
    INNER_LAYOUT_HEAD_TOKEN_DIM: _ClassVar[InnerLayout]

class KvOrder(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_ORDER_UNSPECIFIED: _ClassVar[KvOrder]
    KV_ORDER_K_THEN_V: _ClassVar[KvOrder]
    KV_ORDER_V_THEN_K: _ClassVar[KvOrder]
    KV_ORDER_LATENT: _ClassVar[KvOrder]

class Tier(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TIER_UNSPECIFIED: _ClassVar[Tier]
    TIER_DEVICE: _ClassVar[Tier]
    TIER_HOST: _ClassVar[Tier]
    TIER_DISK: _ClassVar[Tier]
    TIER_REMOTE: _ClassVar[Tier]

class Ack(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_UNSPECIFIED: _ClassVar[Ack]
    ACK_ACCEPTED: _ClassVar[Ack]
    ACK_HOST: _ClassVar[Ack]
    ACK_DURABLE: _ClassVar[Ack]

class ReserveStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESERVE_STATUS_UNSPECIFIED: _ClassVar[ReserveStatus]
    RESERVE_STATUS_RESERVED: _ClassVar[ReserveStatus]
    RESERVE_STATUS_EXISTS: _ClassVar[ReserveStatus]
    RESERVE_STATUS_IN_FLIGHT: _ClassVar[ReserveStatus]
    RESERVE_STATUS_NO_SPACE: _ClassVar[ReserveStatus]

class GetCut(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GET_CUT_NONE: _ClassVar[GetCut]
    GET_CUT_CORRUPT: _ClassVar[GetCut]
    GET_CUT_UNREADABLE: _ClassVar[GetCut]
    GET_CUT_NO_ROOM: _ClassVar[GetCut]
    GET_CUT_KEPT_BELOW: _ClassVar[GetCut]

class KvEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_EVENT_KIND_UNSPECIFIED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_STORED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_REMOVED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_TIER_CHANGED: _ClassVar[KvEventKind]
    KV_EVENT_KIND_WATCHING: _ClassVar[KvEventKind]
    KV_EVENT_KIND_RESYNC_REQUIRED: _ClassVar[KvEventKind]

class ResyncReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESYNC_REASON_UNSPECIFIED: _ClassVar[ResyncReason]
    RESYNC_REASON_SEQUENCE_TOO_OLD: _ClassVar[ResyncReason]
    RESYNC_REASON_SUBSCRIBER_TOO_SLOW: _ClassVar[ResyncReason]
    RESYNC_REASON_INSTANCE_CHANGED: _ClassVar[ResyncReason]

class PrefetchLimit(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PREFETCH_LIMIT_UNSPECIFIED: _ClassVar[PrefetchLimit]
    PREFETCH_LIMIT_IN_FLIGHT: _ClassVar[PrefetchLimit]
    PREFETCH_LIMIT_HOST_FULL: _ClassVar[PrefetchLimit]
    PREFETCH_LIMIT_PROMOTION: _ClassVar[PrefetchLimit]
DTYPE_UNSPECIFIED: DType
DTYPE_FLOAT32: DType
DTYPE_FLOAT16: DType
DTYPE_BFLOAT16: DType
DTYPE_FLOAT8_E4M3: DType
DTYPE_FLOAT8_E5M2: DType
DTYPE_INT8: DType
INNER_LAYOUT_UNSPECIFIED: InnerLayout
INNER_LAYOUT_TOKEN_HEAD_DIM: InnerLayout
INNER_LAYOUT_HEAD_TOKEN_DIM: InnerLayout
KV_ORDER_UNSPECIFIED: KvOrder
KV_ORDER_K_THEN_V: KvOrder
KV_ORDER_V_THEN_K: KvOrder
KV_ORDER_LATENT: KvOrder
TIER_UNSPECIFIED: Tier
TIER_DEVICE: Tier
TIER_HOST: Tier
TIER_DISK: Tier
TIER_REMOTE: Tier
ACK_UNSPECIFIED: Ack
ACK_ACCEPTED: Ack
ACK_HOST: Ack
ACK_DURABLE: Ack
RESERVE_STATUS_UNSPECIFIED: ReserveStatus
RESERVE_STATUS_RESERVED: ReserveStatus
RESERVE_STATUS_EXISTS: ReserveStatus
RESERVE_STATUS_IN_FLIGHT: ReserveStatus
RESERVE_STATUS_NO_SPACE: ReserveStatus
GET_CUT_NONE: GetCut
GET_CUT_CORRUPT: GetCut
GET_CUT_UNREADABLE: GetCut
GET_CUT_NO_ROOM: GetCut
GET_CUT_KEPT_BELOW: GetCut
KV_EVENT_KIND_UNSPECIFIED: KvEventKind
KV_EVENT_KIND_STORED: KvEventKind
KV_EVENT_KIND_REMOVED: KvEventKind
KV_EVENT_KIND_TIER_CHANGED: KvEventKind
KV_EVENT_KIND_WATCHING: KvEventKind
KV_EVENT_KIND_RESYNC_REQUIRED: KvEventKind
RESYNC_REASON_UNSPECIFIED: ResyncReason
RESYNC_REASON_SEQUENCE_TOO_OLD: ResyncReason
RESYNC_REASON_SUBSCRIBER_TOO_SLOW: ResyncReason
RESYNC_REASON_INSTANCE_CHANGED: ResyncReason
PREFETCH_LIMIT_UNSPECIFIED: PrefetchLimit
PREFETCH_LIMIT_IN_FLIGHT: PrefetchLimit
PREFETCH_LIMIT_HOST_FULL: PrefetchLimit
PREFETCH_LIMIT_PROMOTION: PrefetchLimit

class NamespaceSpec(_message.Message):
    __slots__ = ("model_id", "model_revision", "kv_dtype", "num_layers", "num_kv_heads", "head_dim", "block_tokens", "inner_layout", "kv_order", "tp_rank", "tp_size", "pp_stage", "pp_size", "lora_id", "tenant_salt", "hash_scheme")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    INNER_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    KV_ORDER_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PP_STAGE_FIELD_NUMBER: _ClassVar[int]
    PP_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_revision: str
    kv_dtype: DType
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    inner_layout: InnerLayout
    kv_order: KvOrder
    tp_rank: int
    tp_size: int
    pp_stage: int
    pp_size: int
    lora_id: str
    tenant_salt: bytes
    hash_scheme: str
    def __init__(self, model_id: _Optional[str] = ..., model_revision: _Optional[str] = ..., kv_dtype: _Optional[_Union[DType, str]] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_tokens: _Optional[int] = ..., inner_layout: _Optional[_Union[InnerLayout, str]] = ..., kv_order: _Optional[_Union[KvOrder, str]] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ..., pp_stage: _Optional[int] = ..., pp_size: _Optional[int] = ..., lora_id: _Optional[str] = ..., tenant_salt: _Optional[bytes] = ..., hash_scheme: _Optional[str] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: NamespaceSpec
    def __init__(self, spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ...) -> None: ...

class RegisterNamespaceResponse(_message.Message):
    __slots__ = ("namespace_id", "block_bytes", "layer_bytes")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_bytes: int
    layer_bytes: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., layer_bytes: _Optional[int] = ...) -> None: ...

class ArenaInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ArenaInfoResponse(_message.Message):
    __slots__ = ("arena_socket", "arena_bytes", "slot_bytes", "slot_count", "class_bytes", "instance_id", "max_message_bytes")
    ARENA_SOCKET_FIELD_NUMBER: _ClassVar[int]
    ARENA_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_COUNT_FIELD_NUMBER: _ClassVar[int]
    CLASS_BYTES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    arena_socket: str
    arena_bytes: int
    slot_bytes: int
    slot_count: int
    class_bytes: _containers.RepeatedScalarFieldContainer[int]
    instance_id: str
    max_message_bytes: int
    def __init__(self, arena_socket: _Optional[str] = ..., arena_bytes: _Optional[int] = ..., slot_bytes: _Optional[int] = ..., slot_count: _Optional[int] = ..., class_bytes: _Optional[_Iterable[int]] = ..., instance_id: _Optional[str] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "parent_key", "packed_keys", "include_remote", "load_times")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_REMOTE_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIMES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parent_key: bytes
    packed_keys: bytes
    include_remote: bool
    load_times: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., parent_key: _Optional[bytes] = ..., packed_keys: _Optional[bytes] = ..., include_remote: _Optional[bool] = ..., load_times: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("matched", "tiers", "load_s")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    matched: int
    tiers: bytes
    load_s: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, matched: _Optional[int] = ..., tiers: _Optional[bytes] = ..., load_s: _Optional[_Iterable[float]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("namespace_id", "client_id", "parent_key", "keys", "lease_ms", "arena_instance_id")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    ARENA_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    client_id: str
    parent_key: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ms: int
    arena_instance_id: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., client_id: _Optional[str] = ..., parent_key: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., lease_ms: _Optional[int] = ..., arena_instance_id: _Optional[str] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease_id", "lease_deadline_ms", "statuses", "offsets")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    lease_deadline_ms: int
    statuses: _containers.RepeatedScalarFieldContainer[ReserveStatus]
    offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[int] = ..., lease_deadline_ms: _Optional[int] = ..., statuses: _Optional[_Iterable[_Union[ReserveStatus, str]]] = ..., offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("namespace_id", "client_id", "lease_id", "keys", "abort_keys", "ack")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ABORT_KEYS_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    client_id: str
    lease_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    abort_keys: _containers.RepeatedScalarFieldContainer[bytes]
    ack: Ack
    def __init__(self, namespace_id: _Optional[bytes] = ..., client_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., abort_keys: _Optional[_Iterable[bytes]] = ..., ack: _Optional[_Union[Ack, str]] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("sealed", "aborted", "durable")
    SEALED_FIELD_NUMBER: _ClassVar[int]
    ABORTED_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    sealed: int
    aborted: int
    durable: int
    def __init__(self, sealed: _Optional[int] = ..., aborted: _Optional[int] = ..., durable: _Optional[int] = ...) -> None: ...

class PutInlineRequest(_message.Message):
    __slots__ = ("namespace_id", "client_id", "parent_key", "keys", "blocks", "ack")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    client_id: str
    parent_key: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    blocks: _containers.RepeatedScalarFieldContainer[bytes]
    ack: Ack
    def __init__(self, namespace_id: _Optional[bytes] = ..., client_id: _Optional[str] = ..., parent_key: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., blocks: _Optional[_Iterable[bytes]] = ..., ack: _Optional[_Union[Ack, str]] = ...) -> None: ...

class PutInlineResponse(_message.Message):
    __slots__ = ("statuses", "sealed", "durable")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    SEALED_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[ReserveStatus]
    sealed: int
    durable: int
    def __init__(self, statuses: _Optional[_Iterable[_Union[ReserveStatus, str]]] = ..., sealed: _Optional[int] = ..., durable: _Optional[int] = ...) -> None: ...

class MakeDurableRequest(_message.Message):
    __slots__ = ("namespace_id", "parent_key", "keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    parent_key: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., parent_key: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class MakeDurableResponse(_message.Message):
    __slots__ = ("durable",)
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    durable: int
    def __init__(self, durable: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace_id", "client_id", "keys", "lease_ms", "inline", "parent_key", "arena_instance_id")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    INLINE_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    ARENA_INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    client_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    lease_ms: int
    inline: bool
    parent_key: bytes
    arena_instance_id: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., client_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., lease_ms: _Optional[int] = ..., inline: _Optional[bool] = ..., parent_key: _Optional[bytes] = ..., arena_instance_id: _Optional[str] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("matched", "lease_id", "lease_deadline_ms", "offsets", "blocks", "tiers", "cut")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    matched: int
    lease_id: int
    lease_deadline_ms: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    blocks: _containers.RepeatedScalarFieldContainer[bytes]
    tiers: bytes
    cut: GetCut
    def __init__(self, matched: _Optional[int] = ..., lease_id: _Optional[int] = ..., lease_deadline_ms: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., blocks: _Optional[_Iterable[bytes]] = ..., tiers: _Optional[bytes] = ..., cut: _Optional[_Union[GetCut, str]] = ...) -> None: ...

class GetLayersResponse(_message.Message):
    __slots__ = ("matched", "layers_ready", "lease_id", "lease_deadline_ms", "offsets", "tiers", "cut")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    LAYERS_READY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    matched: int
    layers_ready: int
    lease_id: int
    lease_deadline_ms: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    tiers: bytes
    cut: GetCut
    def __init__(self, matched: _Optional[int] = ..., layers_ready: _Optional[int] = ..., lease_id: _Optional[int] = ..., lease_deadline_ms: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., tiers: _Optional[bytes] = ..., cut: _Optional[_Union[GetCut, str]] = ...) -> None: ...

class GetBlocksResponse(_message.Message):
    __slots__ = ("matched", "blocks_ready", "lease_id", "lease_deadline_ms", "offsets", "tiers", "cut")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_READY_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    matched: int
    blocks_ready: int
    lease_id: int
    lease_deadline_ms: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    tiers: bytes
    cut: GetCut
    def __init__(self, matched: _Optional[int] = ..., blocks_ready: _Optional[int] = ..., lease_id: _Optional[int] = ..., lease_deadline_ms: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., tiers: _Optional[bytes] = ..., cut: _Optional[_Union[GetCut, str]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("client_id", "lease_ids")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, client_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: int
    def __init__(self, released: _Optional[int] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("client_id", "lease_id", "lease_ms")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    lease_id: int
    lease_ms: int
    def __init__(self, client_id: _Optional[str] = ..., lease_id: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("lease_deadline_ms",)
    LEASE_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    lease_deadline_ms: int
    def __init__(self, lease_deadline_ms: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace_id", "keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted", "pinned")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    pinned: int
    def __init__(self, deleted: _Optional[int] = ..., pinned: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("include_metrics",)
    INCLUDE_METRICS_FIELD_NUMBER: _ClassVar[int]
    include_metrics: bool
    def __init__(self, include_metrics: _Optional[bool] = ...) -> None: ...

class MetricSample(_message.Message):
    __slots__ = ("name", "labels", "value")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: _containers.ScalarMap[str, str]
    value: float
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., value: _Optional[float] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("tier", "blocks", "bytes_used", "capacity_bytes", "pinned_blocks", "evictions", "payload_bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    blocks: int
    bytes_used: int
    capacity_bytes: int
    pinned_blocks: int
    evictions: int
    payload_bytes: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., blocks: _Optional[int] = ..., bytes_used: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., pinned_blocks: _Optional[int] = ..., evictions: _Optional[int] = ..., payload_bytes: _Optional[int] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace_id", "model_id", "blocks", "block_bytes", "hits", "misses", "tenant")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    model_id: str
    blocks: int
    block_bytes: int
    hits: int
    misses: int
    tenant: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., model_id: _Optional[str] = ..., blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("version", "instance_id", "uptime_s", "tiers", "namespaces", "leases", "leases_expired", "metrics")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    version: str
    instance_id: str
    uptime_s: float
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    leases: int
    leases_expired: int
    metrics: _containers.RepeatedCompositeFieldContainer[MetricSample]
    def __init__(self, version: _Optional[str] = ..., instance_id: _Optional[str] = ..., uptime_s: _Optional[float] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., leases: _Optional[int] = ..., leases_expired: _Optional[int] = ..., metrics: _Optional[_Iterable[_Union[MetricSample, _Mapping]]] = ...) -> None: ...

class DemoteRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DemoteResponse(_message.Message):
    __slots__ = ("blocks_demoted", "bytes_demoted", "blocks_kept")
    BLOCKS_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_KEPT_FIELD_NUMBER: _ClassVar[int]
    blocks_demoted: int
    bytes_demoted: int
    blocks_kept: int
    def __init__(self, blocks_demoted: _Optional[int] = ..., bytes_demoted: _Optional[int] = ..., blocks_kept: _Optional[int] = ...) -> None: ...

class ListNamespacesRequest(_message.Message):
    __slots__ = ("tenant",)
    TENANT_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    def __init__(self, tenant: _Optional[str] = ...) -> None: ...

class NamespaceTierUsage(_message.Message):
    __slots__ = ("tier", "blocks", "payload_bytes", "bytes_used")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    BYTES_USED_FIELD_NUMBER: _ClassVar[int]
    tier: Tier
    blocks: int
    payload_bytes: int
    bytes_used: int
    def __init__(self, tier: _Optional[_Union[Tier, str]] = ..., blocks: _Optional[int] = ..., payload_bytes: _Optional[int] = ..., bytes_used: _Optional[int] = ...) -> None: ...

class NamespaceInfo(_message.Message):
    __slots__ = ("namespace_id", "client_namespace_id", "tenant", "spec", "salted", "block_bytes", "blocks", "tiers", "hits", "misses", "disk_enabled")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    SALTED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    DISK_ENABLED_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    client_namespace_id: bytes
    tenant: str
    spec: NamespaceSpec
    salted: bool
    block_bytes: int
    blocks: int
    tiers: _containers.RepeatedCompositeFieldContainer[NamespaceTierUsage]
    hits: int
    misses: int
    disk_enabled: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., client_namespace_id: _Optional[bytes] = ..., tenant: _Optional[str] = ..., spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., salted: _Optional[bool] = ..., block_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[NamespaceTierUsage, _Mapping]]] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., disk_enabled: _Optional[bool] = ...) -> None: ...

class ListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces",)
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceInfo]
    def __init__(self, namespaces: _Optional[_Iterable[_Union[NamespaceInfo, _Mapping]]] = ...) -> None: ...

class DeleteNamespaceRequest(_message.Message):
    __slots__ = ("daemon_namespace_id",)
    DAEMON_NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    daemon_namespace_id: bytes
    def __init__(self, daemon_namespace_id: _Optional[bytes] = ...) -> None: ...

class DeleteNamespaceResponse(_message.Message):
    __slots__ = ("deleted", "pinned")
    DELETED_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    pinned: int
    def __init__(self, deleted: _Optional[int] = ..., pinned: _Optional[int] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ("namespace_id", "from_sequence", "instance_id")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    from_sequence: int
    instance_id: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., from_sequence: _Optional[int] = ..., instance_id: _Optional[str] = ...) -> None: ...

class KvEvent(_message.Message):
    __slots__ = ("kind", "sequence", "namespace_id", "keys", "parent_key", "tier", "instance_id", "resync_reason")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    RESYNC_REASON_FIELD_NUMBER: _ClassVar[int]
    kind: KvEventKind
    sequence: int
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parent_key: bytes
    tier: Tier
    instance_id: str
    resync_reason: ResyncReason
    def __init__(self, kind: _Optional[_Union[KvEventKind, str]] = ..., sequence: _Optional[int] = ..., namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., parent_key: _Optional[bytes] = ..., tier: _Optional[_Union[Tier, str]] = ..., instance_id: _Optional[str] = ..., resync_reason: _Optional[_Union[ResyncReason, str]] = ...) -> None: ...

class EventSnapshotRequest(_message.Message):
    __slots__ = ("namespace_id",)
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    def __init__(self, namespace_id: _Optional[bytes] = ...) -> None: ...

class EventSnapshotResponse(_message.Message):
    __slots__ = ("instance_id", "sequence", "block_count", "keys", "parent_keys", "tiers")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    sequence: int
    block_count: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parent_keys: _containers.RepeatedScalarFieldContainer[bytes]
    tiers: bytes
    def __init__(self, instance_id: _Optional[str] = ..., sequence: _Optional[int] = ..., block_count: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., parent_keys: _Optional[_Iterable[bytes]] = ..., tiers: _Optional[bytes] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "parent_key", "wait")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    WAIT_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parent_key: bytes
    wait: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., parent_key: _Optional[bytes] = ..., wait: _Optional[bool] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("matched", "in_host", "loading", "queued", "refused", "missing", "limit", "loaded")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    IN_HOST_FIELD_NUMBER: _ClassVar[int]
    LOADING_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    LOADED_FIELD_NUMBER: _ClassVar[int]
    matched: int
    in_host: int
    loading: int
    queued: int
    refused: int
    missing: int
    limit: PrefetchLimit
    loaded: int
    def __init__(self, matched: _Optional[int] = ..., in_host: _Optional[int] = ..., loading: _Optional[int] = ..., queued: _Optional[int] = ..., refused: _Optional[int] = ..., missing: _Optional[int] = ..., limit: _Optional[_Union[PrefetchLimit, str]] = ..., loaded: _Optional[int] = ...) -> None: ...

class RegisterPoolRequest(_message.Message):
    __slots__ = ("namespace_id", "client_id", "layers", "num_blocks", "flags", "lease_ms", "page_stride_bytes", "v_offset_bytes", "io_ring")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    PAGE_STRIDE_BYTES_FIELD_NUMBER: _ClassVar[int]
    V_OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    IO_RING_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    client_id: str
    layers: _containers.RepeatedScalarFieldContainer[bytes]
    num_blocks: int
    flags: bytes
    lease_ms: int
    page_stride_bytes: int
    v_offset_bytes: int
    io_ring: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., client_id: _Optional[str] = ..., layers: _Optional[_Iterable[bytes]] = ..., num_blocks: _Optional[int] = ..., flags: _Optional[bytes] = ..., lease_ms: _Optional[int] = ..., page_stride_bytes: _Optional[int] = ..., v_offset_bytes: _Optional[int] = ..., io_ring: _Optional[bool] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("pool_id", "lease_deadline_ms", "flag_words", "ring_token")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_MS_FIELD_NUMBER: _ClassVar[int]
    FLAG_WORDS_FIELD_NUMBER: _ClassVar[int]
    RING_TOKEN_FIELD_NUMBER: _ClassVar[int]
    pool_id: int
    lease_deadline_ms: int
    flag_words: int
    ring_token: str
    def __init__(self, pool_id: _Optional[int] = ..., lease_deadline_ms: _Optional[int] = ..., flag_words: _Optional[int] = ..., ring_token: _Optional[str] = ...) -> None: ...

class UnregisterPoolRequest(_message.Message):
    __slots__ = ("client_id", "pool_id")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    pool_id: int
    def __init__(self, client_id: _Optional[str] = ..., pool_id: _Optional[int] = ...) -> None: ...

class UnregisterPoolResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SaveLayersRequest(_message.Message):
    __slots__ = ("namespace_id", "client_id", "pool_id", "parent_key", "keys", "pages", "engine_flag", "kvd_flag", "base", "offload_distance")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FLAG_FIELD_NUMBER: _ClassVar[int]
    KVD_FLAG_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    OFFLOAD_DISTANCE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    client_id: str
    pool_id: int
    parent_key: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pages: _containers.RepeatedScalarFieldContainer[int]
    engine_flag: int
    kvd_flag: int
    base: int
    offload_distance: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., client_id: _Optional[str] = ..., pool_id: _Optional[int] = ..., parent_key: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., pages: _Optional[_Iterable[int]] = ..., engine_flag: _Optional[int] = ..., kvd_flag: _Optional[int] = ..., base: _Optional[int] = ..., offload_distance: _Optional[int] = ...) -> None: ...

class SaveLayersResponse(_message.Message):
    __slots__ = ("statuses", "stored", "done_value")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    DONE_VALUE_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[ReserveStatus]
    stored: int
    done_value: int
    def __init__(self, statuses: _Optional[_Iterable[_Union[ReserveStatus, str]]] = ..., stored: _Optional[int] = ..., done_value: _Optional[int] = ...) -> None: ...

class LoadLayersRequest(_message.Message):
    __slots__ = ("namespace_id", "client_id", "pool_id", "parent_key", "keys", "pages", "kvd_flag", "base", "cancel_flag")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_KEY_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    KVD_FLAG_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FLAG_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    client_id: str
    pool_id: int
    parent_key: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    pages: _containers.RepeatedScalarFieldContainer[int]
    kvd_flag: int
    base: int
    cancel_flag: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., client_id: _Optional[str] = ..., pool_id: _Optional[int] = ..., parent_key: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., pages: _Optional[_Iterable[int]] = ..., kvd_flag: _Optional[int] = ..., base: _Optional[int] = ..., cancel_flag: _Optional[int] = ...) -> None: ...

class LoadLayersResponse(_message.Message):
    __slots__ = ("matched", "done_value", "tiers", "cut", "ring_reads", "ring_blocks", "by_ring")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    DONE_VALUE_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    RING_READS_FIELD_NUMBER: _ClassVar[int]
    RING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BY_RING_FIELD_NUMBER: _ClassVar[int]
    matched: int
    done_value: int
    tiers: bytes
    cut: GetCut
    ring_reads: bytes
    ring_blocks: int
    by_ring: _containers.RepeatedScalarFieldContainer[bool]
    def __init__(self, matched: _Optional[int] = ..., done_value: _Optional[int] = ..., tiers: _Optional[bytes] = ..., cut: _Optional[_Union[GetCut, str]] = ..., ring_reads: _Optional[bytes] = ..., ring_blocks: _Optional[int] = ..., by_ring: _Optional[_Iterable[bool]] = ...) -> None: ...

class PlanRequestEntry(_message.Message):
    __slots__ = ("kv_bytes", "slo_s", "deposit_tokens", "token_bytes", "context_tokens")
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLO_S_FIELD_NUMBER: _ClassVar[int]
    DEPOSIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    kv_bytes: int
    slo_s: float
    deposit_tokens: int
    token_bytes: int
    context_tokens: int
    def __init__(self, kv_bytes: _Optional[int] = ..., slo_s: _Optional[float] = ..., deposit_tokens: _Optional[int] = ..., token_bytes: _Optional[int] = ..., context_tokens: _Optional[int] = ...) -> None: ...

class PlanProfile(_message.Message):
    __slots__ = ("layers", "base_s", "per_token_s", "bandwidth_bps", "alpha", "mismatch")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    BASE_S_FIELD_NUMBER: _ClassVar[int]
    PER_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    MISMATCH_FIELD_NUMBER: _ClassVar[int]
    layers: int
    base_s: float
    per_token_s: float
    bandwidth_bps: float
    alpha: float
    mismatch: float
    def __init__(self, layers: _Optional[int] = ..., base_s: _Optional[float] = ..., per_token_s: _Optional[float] = ..., bandwidth_bps: _Optional[float] = ..., alpha: _Optional[float] = ..., mismatch: _Optional[float] = ...) -> None: ...

class PlanPlacementRequest(_message.Message):
    __slots__ = ("requests", "layer_compute_s", "bandwidth_bps", "budget_bytes", "profile", "define", "max_window", "max_nodes")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    LAYER_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    DEFINE_FIELD_NUMBER: _ClassVar[int]
    MAX_WINDOW_FIELD_NUMBER: _ClassVar[int]
    MAX_NODES_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[PlanRequestEntry]
    layer_compute_s: _containers.RepeatedScalarFieldContainer[float]
    bandwidth_bps: float
    budget_bytes: int
    profile: str
    define: PlanProfile
    max_window: int
    max_nodes: int
    def __init__(self, requests: _Optional[_Iterable[_Union[PlanRequestEntry, _Mapping]]] = ..., layer_compute_s: _Optional[_Iterable[float]] = ..., bandwidth_bps: _Optional[float] = ..., budget_bytes: _Optional[int] = ..., profile: _Optional[str] = ..., define: _Optional[_Union[PlanProfile, _Mapping]] = ..., max_window: _Optional[int] = ..., max_nodes: _Optional[int] = ...) -> None: ...

class PlanPlacementResponse(_message.Message):
    __slots__ = ("distances", "paused", "latency_s", "window_steps", "gpu_bytes", "fits", "meets_slo", "exact", "bound_s", "explored", "layer_compute_s", "bandwidth_bps")
    DISTANCES_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    WINDOW_STEPS_FIELD_NUMBER: _ClassVar[int]
    GPU_BYTES_FIELD_NUMBER: _ClassVar[int]
    FITS_FIELD_NUMBER: _ClassVar[int]
    MEETS_SLO_FIELD_NUMBER: _ClassVar[int]
    EXACT_FIELD_NUMBER: _ClassVar[int]
    BOUND_S_FIELD_NUMBER: _ClassVar[int]
    EXPLORED_FIELD_NUMBER: _ClassVar[int]
    LAYER_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    distances: _containers.RepeatedScalarFieldContainer[int]
    paused: _containers.RepeatedScalarFieldContainer[int]
    latency_s: float
    window_steps: int
    gpu_bytes: int
    fits: bool
    meets_slo: bool
    exact: bool
    bound_s: float
    explored: int
    layer_compute_s: _containers.RepeatedScalarFieldContainer[float]
    bandwidth_bps: float
    def __init__(self, distances: _Optional[_Iterable[int]] = ..., paused: _Optional[_Iterable[int]] = ..., latency_s: _Optional[float] = ..., window_steps: _Optional[int] = ..., gpu_bytes: _Optional[int] = ..., fits: _Optional[bool] = ..., meets_slo: _Optional[bool] = ..., exact: _Optional[bool] = ..., bound_s: _Optional[float] = ..., explored: _Optional[int] = ..., layer_compute_s: _Optional[_Iterable[float]] = ..., bandwidth_bps: _Optional[float] = ...) -> None: ...

class ReportStepRequest(_message.Message):
    __slots__ = ("profile", "predicted_s", "observed_s", "moved_bytes", "transfer_s")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PREDICTED_S_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_S_FIELD_NUMBER: _ClassVar[int]
    MOVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    profile: str
    predicted_s: float
    observed_s: float
    moved_bytes: int
    transfer_s: float
    def __init__(self, profile: _Optional[str] = ..., predicted_s: _Optional[float] = ..., observed_s: _Optional[float] = ..., moved_bytes: _Optional[int] = ..., transfer_s: _Optional[float] = ...) -> None: ...

class ReportStepResponse(_message.Message):
    __slots__ = ("replan", "compute_scale", "bandwidth_bps")
    REPLAN_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SCALE_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_BPS_FIELD_NUMBER: _ClassVar[int]
    replan: bool
    compute_scale: float
    bandwidth_bps: float
    def __init__(self, replan: _Optional[bool] = ..., compute_scale: _Optional[float] = ..., bandwidth_bps: _Optional[float] = ...) -> None: ...

class ClusterLookupRequest(_message.Message):
    __slots__ = ("namespace_id", "packed_keys", "load_times")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    LOAD_TIMES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    packed_keys: bytes
    load_times: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., packed_keys: _Optional[bytes] = ..., load_times: _Optional[bool] = ...) -> None: ...

class NodeMatch(_message.Message):
    __slots__ = ("node", "address", "matched", "local", "load_s")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    node: str
    address: str
    matched: int
    local: bool
    load_s: float
    def __init__(self, node: _Optional[str] = ..., address: _Optional[str] = ..., matched: _Optional[int] = ..., local: _Optional[bool] = ..., load_s: _Optional[float] = ...) -> None: ...

class ClusterLookupResponse(_message.Message):
    __slots__ = ("nodes", "segments", "segments_unanswered")
    NODES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_UNANSWERED_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeMatch]
    segments: int
    segments_unanswered: int
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeMatch, _Mapping]]] = ..., segments: _Optional[int] = ..., segments_unanswered: _Optional[int] = ...) -> None: ...

class DirectoryUpdateRequest(_message.Message):
    __slots__ = ("node", "incarnation", "stored_keys", "removed_keys", "reset")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STORED_KEYS_FIELD_NUMBER: _ClassVar[int]
    REMOVED_KEYS_FIELD_NUMBER: _ClassVar[int]
    RESET_FIELD_NUMBER: _ClassVar[int]
    node: str
    incarnation: int
    stored_keys: bytes
    removed_keys: bytes
    reset: bool
    def __init__(self, node: _Optional[str] = ..., incarnation: _Optional[int] = ..., stored_keys: _Optional[bytes] = ..., removed_keys: _Optional[bytes] = ..., reset: _Optional[bool] = ...) -> None: ...

class DirectoryUpdateResponse(_message.Message):
    __slots__ = ("applied",)
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    applied: int
    def __init__(self, applied: _Optional[int] = ...) -> None: ...

class DirectoryQueryRequest(_message.Message):
    __slots__ = ("segments",)
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    segments: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, segments: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SegmentHolders(_message.Message):
    __slots__ = ("holder_counts", "holders")
    HOLDER_COUNTS_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    holder_counts: bytes
    holders: bytes
    def __init__(self, holder_counts: _Optional[bytes] = ..., holders: _Optional[bytes] = ...) -> None: ...

class DirectoryQueryResponse(_message.Message):
    __slots__ = ("nodes", "segments")
    NODES_FIELD_NUMBER: _ClassVar[int]
    SEGMENTS_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    segments: _containers.RepeatedCompositeFieldContainer[SegmentHolders]
    def __init__(self, nodes: _Optional[_Iterable[str]] = ..., segments: _Optional[_Iterable[_Union[SegmentHolders, _Mapping]]] = ...) -> None: ...

class ReadBlocksRequest(_message.Message):
    __slots__ = ("node", "incarnation", "namespace_id", "packed_keys", "first", "lease_ms")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    node: str
    incarnation: int
    namespace_id: bytes
    packed_keys: bytes
    first: int
    lease_ms: int
    def __init__(self, node: _Optional[str] = ..., incarnation: _Optional[int] = ..., namespace_id: _Optional[bytes] = ..., packed_keys: _Optional[bytes] = ..., first: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class ReadBlocksResponse(_message.Message):
    __slots__ = ("first", "blocks", "crc32c")
    FIRST_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    first: int
    blocks: _containers.RepeatedScalarFieldContainer[bytes]
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, first: _Optional[int] = ..., blocks: _Optional[_Iterable[bytes]] = ..., crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class PinBlocksRequest(_message.Message):
    __slots__ = ("node", "incarnation", "namespace_id", "packed_keys", "first", "lease_ms")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    node: str
    incarnation: int
    namespace_id: bytes
    packed_keys: bytes
    first: int
    lease_ms: int
    def __init__(self, node: _Optional[str] = ..., incarnation: _Optional[int] = ..., namespace_id: _Optional[bytes] = ..., packed_keys: _Optional[bytes] = ..., first: _Optional[int] = ..., lease_ms: _Optional[int] = ...) -> None: ...

class PinBlocksResponse(_message.Message):
    __slots__ = ("lease_id", "offsets", "block_bytes", "arena_address", "grant")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSETS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    lease_id: int
    offsets: _containers.RepeatedScalarFieldContainer[int]
    block_bytes: int
    arena_address: int
    grant: bytes
    def __init__(self, lease_id: _Optional[int] = ..., offsets: _Optional[_Iterable[int]] = ..., block_bytes: _Optional[int] = ..., arena_address: _Optional[int] = ..., grant: _Optional[bytes] = ...) -> None: ...

class ReleasePinsRequest(_message.Message):
    __slots__ = ("node", "incarnation", "lease_id")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    node: str
    incarnation: int
    lease_id: int
    def __init__(self, node: _Optional[str] = ..., incarnation: _Optional[int] = ..., lease_id: _Optional[int] = ...) -> None: ...

class ReleasePinsResponse(_message.Message):
    __slots__ = ("crc32c",)
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    crc32c: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, crc32c: _Optional[_Iterable[int]] = ...) -> None: ...

class PriceBlocksRequest(_message.Message):
    __slots__ = ("namespace_id", "packed_keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PACKED_KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    packed_keys: bytes
    def __init__(self, namespace_id: _Optional[bytes] = ..., packed_keys: _Optional[bytes] = ...) -> None: ...

class PriceBlocksResponse(_message.Message):
    __slots__ = ("matched", "load_s")
    MATCHED_FIELD_NUMBER: _ClassVar[int]
    LOAD_S_FIELD_NUMBER: _ClassVar[int]
    matched: int
    load_s: float
    def __init__(self, matched: _Optional[int] = ..., load_s: _Optional[float] = ...) -> None: ...
