"""Cache identity (namespaces) and chained block keys.

Both the client library and the daemon import this module; the daemon only
uses it to digest namespace specs, never to compute block keys (to the
daemon a block key is 32 opaque bytes).

Encoding. Every field that enters a digest is *tagged and length-prefixed*:

    field := tag_len:u8  tag  value_len:u32le  value

so no two different sequences of fields can produce the same byte string
(a LoRA id "a" followed by salt "b" cannot be confused with a LoRA id "ab"
and an empty salt, and no field can be mistaken for another).  Digests are
SHA-256 with a domain-separation prefix per purpose and the key schema
version; Python's hash() is never used (it is salted per process and not
collision resistant).

    namespace_id = SHA256("kvd/namespace" v1  fields(spec))
    root_key     = SHA256("kvd/root"      v1  namespace_id  field(salt))
    key[i]       = SHA256("kvd/block"     v1  parent  field(tokens)  extras)

where the domain strings are raw ASCII (no length prefix), v1 is
KEY_SCHEMA_VERSION as u32le, and fields(spec) is one field per spec attribute,
tagged with the attribute's name, in this order: model_id, model_revision,
kv_dtype, num_layers, num_kv_heads, head_dim, block_tokens, inner_layout,
kv_order, tp_rank, tp_size, pp_stage, pp_size, lora_id, tenant_salt,
hash_scheme, then tenant only when it is not empty (strings UTF-8, integers
and enums u32le, the salt raw). `tenant` is set by the daemon, never by a
client (the API has no field for it): with auth.mode = "token" each tenant's
namespaces are the daemon's own copies of the client's spec with the
tenant's name in it, so two tenants registering identical specs get two
namespaces, and blocks under identical keys never alias. Left out when
empty, it changes no namespace id of a spec without a tenant. salt is
the tenant salt, parent is key[i-1] (root_key for i == 0), tokens are the
block's token ids as u32le (each must be in [0, 2**32); nothing is wrapped),
and

    extras := count:u32le  field(tag, value) ...

are the block's tagged extra inputs in the order given (multimodal content
hashes, request-level cache salts, ...).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvd.errors import InvalidArgument

KEY_BYTES = 32
KEY_SCHEMA_VERSION = 1
HASH_SCHEME = "sha256-v1"
SUPPORTED_HASH_SCHEMES = (HASH_SCHEME,)

_NAMESPACE_DOMAIN = b"kvd/namespace"
_ROOT_DOMAIN = b"kvd/root"
_BLOCK_DOMAIN = b"kvd/block"
_VERSION = struct.pack("<I", KEY_SCHEMA_VERSION)

# The disk tier stores a block's layers in whole blocks of this size (O_DIRECT): a namespace whose
# layer_bytes is not a multiple of it stays in host memory.
LAYER_ALIGN_BYTES = 4096

# Hard limits on what a client may describe; everything has a limit.
MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_BLOCK_TOKENS = 65536
MAX_STRING_BYTES = 512
MAX_SALT_BYTES = 256
MAX_PARALLEL = 65536


class DType(enum.IntEnum):
    """Element type of KV tensors; values match kvd.v1.DType."""

    FLOAT32 = 1
    FLOAT16 = 2
    BFLOAT16 = 3
    FLOAT8_E4M3 = 4
    FLOAT8_E5M2 = 5
    INT8 = 6

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]


_ITEMSIZE = {
    DType.FLOAT32: 4,
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.FLOAT8_E4M3: 1,
    DType.FLOAT8_E5M2: 1,
    DType.INT8: 1,
}


class InnerLayout(enum.IntEnum):
    """Axis order of one layer's K (or V) inside a block; matches the proto."""

    TOKEN_HEAD_DIM = 1  # [block_tokens, kv_heads, head_dim] (vLLM paged)
    HEAD_TOKEN_DIM = 2  # [kv_heads, block_tokens, head_dim] (Hugging Face)


class KvOrder(enum.IntEnum):
    """K then V, V then K, or one latent plane (MLA); matches the proto."""

    K_THEN_V = 1
    V_THEN_K = 2
    LATENT = 3  # MLA: one plane per layer, num_kv_heads 1, head_dim the latent's width

    @property
    def planes(self) -> int:
        return 1 if self is KvOrder.LATENT else 2


def _field(tag: bytes, value: bytes) -> bytes:
    return bytes((len(tag),)) + tag + struct.pack("<I", len(value)) + value


def _u32(value: int) -> bytes:
    return struct.pack("<I", value)


@dataclass(frozen=True, slots=True)
class NamespaceSpec:
    """One cache identity: model, layout, parallel geometry, adapter, tenant.

    Block shape is [num_layers, planes, *inner] where inner is given by
    `inner_layout` and planes is 2 (K and V, in `kv_order`) or 1 (an MLA
    latent, kv_order LATENT); one layer of one block is contiguous
    (layer-major).
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    kv_dtype: DType = DType.BFLOAT16
    model_revision: str = ""
    inner_layout: InnerLayout = InnerLayout.TOKEN_HEAD_DIM
    kv_order: KvOrder = KvOrder.K_THEN_V
    tp_rank: int = 0
    tp_size: int = 1
    pp_stage: int = 0
    pp_size: int = 1
    lora_id: str = ""
    tenant_salt: bytes = b""
    hash_scheme: str = HASH_SCHEME
    # The tenant this namespace belongs to, set by the daemon only (see the
    # module docstring); "" for none. Clients leave it empty.
    tenant: str = ""

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise InvalidArgument naming the first field that is wrong."""
        self._validate_strings()
        self._validate_shape()
        for name, kind in (("kv_dtype", DType), ("inner_layout", InnerLayout), ("kv_order", KvOrder)):
            value = getattr(self, name)
            if value not in kind.__members__.values():
                raise InvalidArgument(f"namespace.{name} has unknown value {value!r}")
        if self.kv_order == KvOrder.LATENT and self.num_kv_heads != 1:
            raise InvalidArgument(
                f"namespace.num_kv_heads must be 1 with kv_order LATENT (one latent per token), got {self.num_kv_heads}"
            )
        if self.hash_scheme not in SUPPORTED_HASH_SCHEMES:
            raise InvalidArgument(
                f"namespace.hash_scheme {self.hash_scheme!r} is not supported (supported: {', '.join(SUPPORTED_HASH_SCHEMES)})"
            )

    def _validate_strings(self) -> None:
        if not self.model_id:
            raise InvalidArgument("namespace.model_id must not be empty")
        for name in ("model_id", "model_revision", "lora_id", "hash_scheme", "tenant"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise InvalidArgument(f"namespace.{name} must be a string")
            if len(value.encode()) > MAX_STRING_BYTES:
                raise InvalidArgument(f"namespace.{name} is longer than {MAX_STRING_BYTES} bytes")
        if not isinstance(self.tenant_salt, bytes) or len(self.tenant_salt) > MAX_SALT_BYTES:
            raise InvalidArgument(f"namespace.tenant_salt must be at most {MAX_SALT_BYTES} bytes")

    def _validate_shape(self) -> None:
        for name, upper in (
            ("num_layers", MAX_LAYERS),
            ("num_kv_heads", MAX_KV_HEADS),
            ("head_dim", MAX_HEAD_DIM),
            ("block_tokens", MAX_BLOCK_TOKENS),
            ("tp_size", MAX_PARALLEL),
            ("pp_size", MAX_PARALLEL),
        ):
            value = getattr(self, name)
            # bool is an int subclass; True must not pass for 1.
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= upper:
                raise InvalidArgument(f"namespace.{name} must be in [1, {upper}], got {value!r}")
        # Type first: a float rank passes the range check and then breaks
        # the u32 encoding with a struct.error instead of a client error.
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise InvalidArgument(f"namespace.tp_rank must be an int in [0, tp_size={self.tp_size}), got {self.tp_rank!r}")
        if not isinstance(self.pp_stage, int) or not 0 <= self.pp_stage < self.pp_size:
            raise InvalidArgument(
                f"namespace.pp_stage must be an int in [0, pp_size={self.pp_size}), got {self.pp_stage!r}"
            )

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer (K and V, or the latent) of one block."""
        return KvOrder(self.kv_order).planes * self.block_tokens * self.num_kv_heads * self.head_dim * DType(self.kv_dtype).itemsize

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def block_shape(self) -> tuple[int, ...]:
        if self.inner_layout == InnerLayout.TOKEN_HEAD_DIM:
            inner = (self.block_tokens, self.num_kv_heads, self.head_dim)
        else:
            inner = (self.num_kv_heads, self.block_tokens, self.head_dim)
        return (self.num_layers, KvOrder(self.kv_order).planes, *inner)

    def encode(self) -> bytes:
        """Canonical, tagged encoding of every identity field."""
        parts = [
            _field(b"model_id", self.model_id.encode()),
            _field(b"model_revision", self.model_revision.encode()),
            _field(b"kv_dtype", _u32(int(self.kv_dtype))),
            _field(b"num_layers", _u32(self.num_layers)),
            _field(b"num_kv_heads", _u32(self.num_kv_heads)),
            _field(b"head_dim", _u32(self.head_dim)),
            _field(b"block_tokens", _u32(self.block_tokens)),
            _field(b"inner_layout", _u32(int(self.inner_layout))),
            _field(b"kv_order", _u32(int(self.kv_order))),
            _field(b"tp_rank", _u32(self.tp_rank)),
            _field(b"tp_size", _u32(self.tp_size)),
            _field(b"pp_stage", _u32(self.pp_stage)),
            _field(b"pp_size", _u32(self.pp_size)),
            _field(b"lora_id", self.lora_id.encode()),
            _field(b"tenant_salt", self.tenant_salt),
            _field(b"hash_scheme", self.hash_scheme.encode()),
        ]
        if self.tenant:
            parts.append(_field(b"tenant", self.tenant.encode()))
        return b"".join(parts)

    def without_tenant(self) -> NamespaceSpec:
        """The spec as its client sent it: what the client's namespace id digests."""
        return replace(self, tenant="") if self.tenant else self

    def namespace_id(self) -> bytes:
        return hashlib.sha256(_NAMESPACE_DOMAIN + _VERSION + self.encode()).digest()

    def root_key(self) -> bytes:
        return hashlib.sha256(
            _ROOT_DOMAIN + _VERSION + self.namespace_id() + _field(b"tenant_salt", self.tenant_salt)
        ).digest()


@dataclass(frozen=True, slots=True)
class ExtraKey:
    """A tagged extra input of one block (e.g. tag "mm", value = image hash)."""

    tag: str
    value: bytes = field(default=b"")

    def encode(self) -> bytes:
        if not isinstance(self.tag, str) or not 1 <= len(self.tag.encode()) <= 255:
            raise InvalidArgument("extra key tag must be a string of 1..255 bytes")
        if not isinstance(self.value, bytes):
            raise InvalidArgument("extra key value must be bytes")
        return _field(self.tag.encode(), self.value)


class PackedKeys(Sequence[bytes]):
    """Keys of KEY_BYTES each, back to back in one bytes object.

    A Lookup of a long prefix carries its keys this way (LookupRequest's
    packed_keys): one protobuf field instead of thousands of bytes objects
    to build, parse and check, and the prefix index walks it in native code
    (PrefixIndex.match). Indexing and iteration give the keys as bytes, so
    it is a Sequence[bytes] wherever one is expected.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        if len(data) % KEY_BYTES:
            raise InvalidArgument(f"packed_keys is {len(data)} bytes, not a whole number of {KEY_BYTES}-byte keys")
        self.data = bytes(data)

    def __len__(self) -> int:
        return len(self.data) // KEY_BYTES

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            return [self.data[i * KEY_BYTES : (i + 1) * KEY_BYTES] for i in range(*index.indices(len(self)))]
        count = len(self)
        if not -count <= index < count:
            raise IndexError("PackedKeys index out of range")
        index %= count
        return self.data[index * KEY_BYTES : (index + 1) * KEY_BYTES]

    def __iter__(self) -> Iterator[bytes]:
        data = self.data
        return (data[i : i + KEY_BYTES] for i in range(0, len(data), KEY_BYTES))


def block_key(parent: bytes, token_ids: bytes, extras: Sequence[ExtraKey] = ()) -> bytes:
    """Key of one block given its parent key and its tokens as u32le bytes."""
    if len(parent) != KEY_BYTES:
        raise InvalidArgument(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    hasher = hashlib.sha256(_BLOCK_DOMAIN)
    hasher.update(_VERSION)
    hasher.update(parent)
    hasher.update(_field(b"tokens", token_ids))
    hasher.update(struct.pack("<I", len(extras)))
    for extra in extras:
        hasher.update(extra.encode())
    return hasher.digest()


_U32_MAX = 2**32 - 1


def _token_array(token_ids: Iterable[int] | np.ndarray) -> np.ndarray:
    """token_ids as contiguous u32le, refusing anything a cast would change.

    A plain cast to u32 wraps -1 to 2**32-1 and 2**32 to 0 and truncates
    floats, which would silently give a different prompt the same key.
    """
    if isinstance(token_ids, Iterator):
        # np.asarray makes a 0-d object array of an iterator, not its items.
        token_ids = list(token_ids)
    try:
        array = np.asarray(token_ids)
    except (TypeError, ValueError, OverflowError) as error:
        raise InvalidArgument(f"token_ids is not a sequence of integers: {error}") from None
    if array.ndim != 1:
        raise InvalidArgument("token_ids must be one-dimensional")
    if array.size == 0:
        return np.empty(0, dtype="<u4")
    # Python ints beyond int64 make an object array; they are out of range.
    if array.dtype.kind not in "iu":
        raise InvalidArgument(f"token_ids must be integers in [0, 2**32), got dtype {array.dtype}")
    if int(array.min()) < 0 or int(array.max()) > _U32_MAX:
        raise InvalidArgument("token_ids must be integers in [0, 2**32)")
    return np.ascontiguousarray(array, dtype="<u4")


def chain_keys(
    spec: NamespaceSpec,
    token_ids: Iterable[int] | np.ndarray,
    extras: Sequence[Sequence[ExtraKey]] | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Chained keys of every *full* block of `token_ids`.

    A trailing partial block gets no key (it is not cacheable until full).
    `extras[i]` are the extra inputs of block i. `parent` continues a chain
    (default: the namespace's root key).
    """
    tokens = _token_array(token_ids)
    if parent is not None and len(parent) != KEY_BYTES:
        raise InvalidArgument(f"parent key must be {KEY_BYTES} bytes, got {len(parent)}")
    block_count = len(tokens) // spec.block_tokens
    if extras is not None and len(extras) < block_count:
        raise InvalidArgument(f"extras has {len(extras)} entries for {block_count} blocks")
    raw = tokens[: block_count * spec.block_tokens].tobytes()
    stride = spec.block_tokens * 4
    key = spec.root_key() if parent is None else parent
    keys: list[bytes] = []
    for index in range(block_count):
        block_extras = extras[index] if extras is not None else ()
        key = block_key(key, raw[index * stride : (index + 1) * stride], block_extras)
        keys.append(key)
    return keys
