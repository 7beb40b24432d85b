"""Hypothesis strategies for every request of kvd.v1.Kvd, built from the descriptors.

`request(method)` draws a request message for one RPC of the service, field
by field from the message descriptor, so a field added to the proto is
fuzzed without touching this file:

  * every field gets values of its type (`_by_type`), including the
    adversarial ones: empty, wrong lengths, boundary and huge numbers,
    unknown enum values, text that is not ASCII, nested messages half set;
  * fields whose name says what they hold (`HINTS`: namespace ids, keys,
    parent keys, client ids, lease ids, payloads...) mostly get values
    that reach deep into the daemon (a registered namespace, a stored
    chain, a lease id the daemon handed out, a payload of the right size),
    mixed with malformed ones (31- or 33-byte keys, duplicates, chains out
    of order, 65,537 keys, another client's name, oversized messages).

`Pools` is what the test knows about the daemon: namespaces, stored
chains, client ids, lease ids seen in responses. It grows as responses
arrive, so later calls in an example name leases earlier calls opened.
With tenants, it also knows another tenant's namespaces, keys and lease
ids (`foreign_*`), which the fuzzed calls name now and then, and which
must be NOT_FOUND for them (`foreign_namespace`).

`certainly_invalid(method, request)` is a small oracle: a reason the
daemon must refuse the request (never answer OK), or None when it cannot
tell.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from google.protobuf.descriptor import Descriptor, EnumDescriptor, FieldDescriptor
from hypothesis import strategies as st

from kvd.v1 import kvd_pb2

SERVICE = kvd_pb2.DESCRIPTOR.services_by_name["Kvd"]
METHODS = [method.name for method in SERVICE.methods]
KEY_BYTES = 32
MAX_BATCH_KEYS = 65536
CLIENT_ID_MAX_CHARS = 128
UINT32_MAX = (1 << 32) - 1
UINT64_MAX = (1 << 64) - 1
INT32_MAX = (1 << 31) - 1


def fresh_keys(seed: int, count: int) -> list[bytes]:
    """`count` distinct 32-byte keys nobody stores, derived from `seed` (cheap for huge counts)."""
    block = hashlib.sha256(b"kvd-fuzz-fresh" + seed.to_bytes(8, "little")).digest()
    # Counter mode: key i is sha256(block || i) would cost a hash each; the
    # bytes only need to differ, so vary the first 8 bytes of one digest.
    return [i.to_bytes(8, "little") + block[8:] for i in range(count)]


@dataclass
class Pools:
    """Values known to mean something to the daemon under test."""

    namespace_ids: list[bytes]
    # Chains of stored keys, each in prefix order (parents first).
    chains: list[list[bytes]]
    block_bytes: int
    client_ids: list[str]
    instance_id: str
    max_lease_ms: int
    lease_ids: list[int] = field(default_factory=list)
    # Payload sizes of registered namespaces other than the main one.
    other_block_bytes: list[int] = field(default_factory=list)
    # Another tenant's: namespace ids (its own and the daemon's), chains
    # stored in them, lease ids. Never the fuzzed calls' to use.
    foreign_namespace_ids: list[bytes] = field(default_factory=list)
    foreign_chains: list[list[bytes]] = field(default_factory=list)
    foreign_lease_ids: list[int] = field(default_factory=list)
    # auth.mode = "token": the daemon scopes client ids by tenant (no NUL in them).
    scoped_client_ids: bool = False

    def saw_lease(self, lease_id: int) -> None:
        if lease_id and lease_id not in self.lease_ids:
            self.lease_ids.append(lease_id)
            del self.lease_ids[:-64]


Hint = Callable[[Any, Pools, dict], Any]


def _pick(draw, items: list) -> Any:
    """An item of a pool. The pools grow as the daemon answers, and Hypothesis
    wants the same constraints on each draw when it replays a test case, so
    the draw is an index in a fixed range, taken modulo the pool's size."""
    return items[draw(st.integers(0, 1 << 16)) % len(items)]


def below(draw, bound: int) -> int:
    """An integer in [0, bound) where bound depends on the pools (see _pick)."""
    return draw(st.integers(0, 1 << 30)) % bound


def _bad_bytes(draw) -> bytes:
    """Bytes of a wrong length for a 32-byte identifier."""
    length = draw(st.sampled_from([1, 16, 31, 33, 64, 4096]))
    return draw(st.binary(min_size=length, max_size=length))


def _identifier(draw, known: list[bytes]) -> bytes:
    kind = draw(st.integers(0, 99))
    if kind < 70 and known:
        return _pick(draw, known)
    if kind < 80:
        return draw(st.binary(min_size=KEY_BYTES, max_size=KEY_BYTES))  # well-formed, unknown
    if kind < 85:
        return b""
    return _bad_bytes(draw)


def _foreign(draw, items: list) -> bool:
    """Whether to take another tenant's value, from `items`, this time (one time in ten)."""
    return bool(items) and draw(st.integers(0, 9)) == 0


def _namespace_id(draw, pools: Pools, drawn: dict) -> bytes:
    if _foreign(draw, pools.foreign_namespace_ids):
        return _pick(draw, pools.foreign_namespace_ids)
    return _identifier(draw, pools.namespace_ids)


def _key(draw, pools: Pools) -> bytes:
    known = [key for chain in pools.chains for key in chain]
    return _identifier(draw, known)


def _chain_piece(draw, chains: list[list[bytes]]) -> list[bytes]:
    """A stored chain, or a piece of one, maybe with fresh keys after it: what a real client sends."""
    chain = _pick(draw, chains)
    start = below(draw, len(chain))
    stop = start + below(draw, len(chain) - start + 1)
    keys = chain[start:stop]
    if draw(st.booleans()):
        keys = keys + fresh_keys(draw(st.integers(0, 1 << 30)), draw(st.integers(0, 6)))
    return keys


def _keys(draw, pools: Pools, drawn: dict) -> list[bytes]:
    if drawn.get("namespace_id") in pools.foreign_namespace_ids and pools.foreign_chains and draw(st.booleans()):
        # Another tenant's namespace: the very keys it stored there.
        return _chain_piece(draw, pools.foreign_chains)
    kind = draw(st.integers(0, 99))
    if kind < 35 and pools.chains:
        return _chain_piece(draw, pools.chains)
    if kind < 50:
        return fresh_keys(draw(st.integers(0, 1 << 30)), draw(st.integers(1, 12)))
    if kind < 60:
        return []
    if kind < 70 and pools.chains:
        # Out of order: a stored chain shuffled or reversed.
        chain = list(_pick(draw, pools.chains))
        random.Random(draw(st.integers(0, 1 << 32))).shuffle(chain)
        return chain
    if kind < 80:
        # Duplicates.
        keys = [_key(draw, pools) for _ in range(draw(st.integers(1, 4)))]
        return keys + keys[: draw(st.integers(1, len(keys)))]
    if kind < 90:
        # One malformed key among good ones.
        keys = fresh_keys(draw(st.integers(0, 1 << 30)), draw(st.integers(1, 6)))
        keys.insert(draw(st.integers(0, len(keys))), _bad_bytes(draw))
        return keys
    if kind < 95:
        # Just past the per-call limit.
        return fresh_keys(draw(st.integers(0, 1 << 30)), MAX_BATCH_KEYS + draw(st.integers(1, 3)))
    # Over the daemon's message limit (tests/fuzz configures 4 MiB).
    return fresh_keys(draw(st.integers(0, 1 << 30)), 140_000)


def _parent_key(draw, pools: Pools, drawn: dict) -> bytes:
    kind = draw(st.integers(0, 99))
    if kind < 50:
        return b""
    return _key(draw, pools)


def _client_id(draw, pools: Pools, drawn: dict) -> str:
    kind = draw(st.integers(0, 99))
    if kind < 70:
        return _pick(draw, pools.client_ids)
    if kind < 75:
        return ""
    if kind < 80:
        return "x" * draw(st.sampled_from([CLIENT_ID_MAX_CHARS - 8, CLIENT_ID_MAX_CHARS, CLIENT_ID_MAX_CHARS + 1,
                                           100_000]))
    if kind < 85:
        # The prefix the daemon gives inline Gets' private leases.
        return "inline\x00" + _pick(draw, pools.client_ids)
    return draw(st.text(min_size=1, max_size=40))


def _lease_id(draw, pools: Pools, drawn: dict) -> int:
    if _foreign(draw, pools.foreign_lease_ids):
        return _pick(draw, pools.foreign_lease_ids)
    kind = draw(st.integers(0, 99))
    if kind < 60 and pools.lease_ids:
        return _pick(draw, pools.lease_ids)
    return draw(st.sampled_from([0, 1, 2, 1000, UINT64_MAX])) if kind < 80 else draw(st.integers(0, UINT64_MAX))


def _lease_ids(draw, pools: Pools, drawn: dict) -> list[int]:
    kind = draw(st.integers(0, 99))
    if kind < 80:
        ids = [_lease_id(draw, pools, drawn) for _ in range(draw(st.integers(0, 5)))]
        if ids and kind < 20:
            ids.append(ids[0])  # a duplicate
        return ids
    return list(range(1, MAX_BATCH_KEYS + draw(st.integers(1, 3))))


def _lease_ms(draw, pools: Pools, drawn: dict) -> int:
    return _pick(draw, [0, 0, 1, 50, 1000, pools.max_lease_ms, pools.max_lease_ms + 1, UINT32_MAX])


def _blocks(draw, pools: Pools, drawn: dict) -> list[bytes]:
    count = len(drawn.get("keys", []))
    kind = draw(st.integers(0, 99))
    size = pools.block_bytes
    if kind < 60:
        pass
    elif kind < 70 and pools.other_block_bytes:
        size = _pick(draw, pools.other_block_bytes)
    elif kind < 80:
        count = below(draw, count + 3)
    elif kind < 90:
        size = _pick(draw, [0, 1, size - 1, size + 1])
    elif kind < 95:
        # Over the daemon's message limit.
        count, size = max(count, 1), max(size, 5 << 20)
    else:
        blocks = [bytes([i % 256]) * size for i in range(count)]
        if blocks:
            blocks[below(draw, len(blocks))] = b"\x01" * below(draw, size + 9)
        return blocks
    count = min(count, 4096) if size < (1 << 20) else min(count, 2)
    fill = draw(st.integers(0, 255))
    return [bytes([fill]) * size] * count


def _instance_id(draw, pools: Pools, drawn: dict) -> str:
    kind = draw(st.integers(0, 99))
    if kind < 40:
        return pools.instance_id
    if kind < 70:
        return ""
    return draw(st.text(max_size=40))


def _from_sequence(draw, pools: Pools, drawn: dict) -> int:
    return draw(st.sampled_from([0, 0, 1, 2, 50, 1 << 40, UINT64_MAX])) if draw(st.booleans()) else draw(
        st.integers(0, 10_000))


def _spec(draw, pools: Pools, drawn: dict) -> kvd_pb2.NamespaceSpec | None:
    """Mostly a valid spec with one or two fields made strange; sometimes anything."""
    kind = draw(st.integers(0, 99))
    if kind < 5:
        return None  # unset
    if kind < 25:
        return draw(message(kvd_pb2.NamespaceSpec.DESCRIPTOR, pools))
    spec = kvd_pb2.NamespaceSpec(
        model_id=f"fuzz-model-{draw(st.integers(0, 3))}", kv_dtype=kvd_pb2.DTYPE_FLOAT32, num_layers=2,
        num_kv_heads=1, head_dim=32, block_tokens=16, inner_layout=kvd_pb2.INNER_LAYOUT_TOKEN_HEAD_DIM,
        kv_order=kvd_pb2.KV_ORDER_K_THEN_V, tp_size=1, pp_size=1, hash_scheme="sha256-v1",
    )
    for _ in range(draw(st.integers(0, 2))):
        descriptor = draw(st.sampled_from(list(kvd_pb2.NamespaceSpec.DESCRIPTOR.fields)))
        _assign(spec, descriptor, draw(_by_type(descriptor, pools)))
    return spec


HINTS: dict[str, Hint] = {
    "namespace_id": _namespace_id,
    "keys": _keys,
    "abort_keys": _keys,
    "parent_key": _parent_key,
    "client_id": _client_id,
    "lease_id": _lease_id,
    "lease_ids": _lease_ids,
    "lease_ms": _lease_ms,
    "blocks": _blocks,
    "instance_id": _instance_id,
    "from_sequence": _from_sequence,
    "spec": _spec,
}

_UINT_EDGES = {
    FieldDescriptor.TYPE_UINT32: (UINT32_MAX, [0, 1, 2, 1 << 16, 1 << 31, UINT32_MAX]),
    FieldDescriptor.TYPE_UINT64: (UINT64_MAX, [0, 1, 2, 1 << 32, 1 << 63, UINT64_MAX]),
}
_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(1 << 31), INT32_MAX),
    FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SINT32: (-(1 << 31), INT32_MAX),
    FieldDescriptor.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
}


def _enum_values(enum: EnumDescriptor) -> st.SearchStrategy[int]:
    known = [value.number for value in enum.values]
    unknown = [max(known) + 1, 99, INT32_MAX, -1, -(1 << 31)]
    return st.one_of(st.sampled_from(known), st.sampled_from(unknown))


def _scalar(descriptor: FieldDescriptor, pools: Pools) -> st.SearchStrategy:
    kind = descriptor.type
    if kind in _UINT_EDGES:
        top, edges = _UINT_EDGES[kind]
        return st.one_of(st.sampled_from(edges), st.integers(0, 10_000), st.integers(0, top))
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        return st.one_of(st.sampled_from([low, -1, 0, 1, high]), st.integers(low, high))
    if kind == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if kind == FieldDescriptor.TYPE_ENUM:
        return _enum_values(descriptor.enum_type)
    if kind == FieldDescriptor.TYPE_STRING:
        return st.one_of(st.just(""), st.text(max_size=20), st.just("\x00" * 3), st.just("é" * 300),
                         st.just("m" * 600))
    if kind == FieldDescriptor.TYPE_BYTES:
        return st.one_of(st.just(b""), st.binary(max_size=40), st.binary(min_size=32, max_size=32),
                         st.just(b"\xff" * 300))
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(allow_nan=True, allow_infinity=True, width=32 if kind == FieldDescriptor.TYPE_FLOAT else 64)
    if kind == FieldDescriptor.TYPE_MESSAGE:
        return message(descriptor.message_type, pools)
    raise NotImplementedError(f"no strategy for field {descriptor.full_name} of type {kind}")


def _by_type(descriptor: FieldDescriptor, pools: Pools) -> st.SearchStrategy:
    element = _scalar(descriptor, pools)
    if _is_repeated(descriptor):
        return st.lists(element, max_size=6)
    return element


def _is_repeated(descriptor: FieldDescriptor) -> bool:
    return descriptor.is_repeated


def _assign(target: Any, descriptor: FieldDescriptor, value: Any) -> None:
    if value is None:
        target.ClearField(descriptor.name)
    elif _is_repeated(descriptor):
        container = getattr(target, descriptor.name)
        del container[:]
        container.extend(value)
    elif descriptor.type == FieldDescriptor.TYPE_MESSAGE:
        getattr(target, descriptor.name).CopyFrom(value)
    else:
        setattr(target, descriptor.name, value)


def message(descriptor: Descriptor, pools: Pools) -> st.SearchStrategy:
    """A message of type `descriptor`, its fields drawn one by one (`HINTS`, else by type)."""
    message_class = getattr(kvd_pb2, descriptor.name)

    @st.composite
    def build(draw):
        result = message_class()
        drawn: dict[str, Any] = {}
        for field_descriptor in descriptor.fields:
            if field_descriptor.message_type is not None and field_descriptor.message_type.GetOptions().map_entry:
                continue  # maps appear only in responses
            hint = HINTS.get(field_descriptor.name)
            # Hinted fields are mostly set, so that most requests get past the
            # first check and reach deeper ones; the others half the time.
            if draw(st.integers(0, 9)) < (1 if hint else 5):
                continue
            value = hint(draw, pools, drawn) if hint else draw(_by_type(field_descriptor, pools))
            drawn[field_descriptor.name] = value
            _assign(result, field_descriptor, value)
        return result

    return build()


def summary(message: Any, limit: int = 12) -> str:
    """A short description of a message: Hypothesis prints every drawn value
    as it is drawn, and the text format of 65,537 keys takes seconds."""
    if message is None:
        return "raw bytes"
    parts = []
    for descriptor, value in message.ListFields():
        if _is_repeated(descriptor):
            shown = ", ".join(_short(item) for item in list(value)[:3])
            parts.append(f"{descriptor.name}=[{shown}{', ...' if len(value) > 3 else ''}] ({len(value)})")
        else:
            parts.append(f"{descriptor.name}={_short(value)}")
    return f"{message.DESCRIPTOR.name}({', '.join(parts[:limit])})"


def _short(value: Any) -> str:
    if isinstance(value, bytes):
        return f"<{len(value)} bytes {value[:6].hex()}>"
    if isinstance(value, str):
        return repr(value[:40]) + (f"...({len(value)} chars)" if len(value) > 40 else "")
    if hasattr(value, "ListFields"):
        return summary(value)
    return repr(value)


class Drawn:
    """A drawn request, with a cheap repr (see `summary`)."""

    __slots__ = ("message",)

    def __init__(self, message: Any) -> None:
        self.message = message

    def __repr__(self) -> str:
        return summary(self.message)

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))


def request(method: str, pools: Pools) -> st.SearchStrategy:
    """A request of `method`, wrapped in `Drawn` (take `.message`)."""
    return message(SERVICE.methods_by_name[method].input_type, pools).map(Drawn)




# ----------------------------------------------------------------------
# The oracle: requests no daemon may accept.

_KEY_FIELDS = ("keys", "abort_keys")
_LEASE_MS_METHODS = ("Reserve", "Renew")
_CLIENT_METHODS = ("Reserve", "Commit", "PutInline", "Release", "Renew")


def foreign_namespace(request: Any, pools: Pools) -> bool:
    """Whether `request` names one of another tenant's namespaces (NOT_FOUND, whatever else it holds)."""
    return "namespace_id" in request.DESCRIPTOR.fields_by_name and request.namespace_id in pools.foreign_namespace_ids


def foreign_leases(method: str, request: Any, pools: Pools) -> list[int]:
    """Another tenant's lease ids `request` names (NOT_FOUND for it, never another client's)."""
    if method == "Release":
        return [lease_id for lease_id in request.lease_ids if lease_id in pools.foreign_lease_ids]
    if method == "Renew" and request.lease_id in pools.foreign_lease_ids:
        return [request.lease_id]
    return []


def _malformed_ids(method: str, request: Any, pools: Pools, names: set[str]) -> str | None:
    if "namespace_id" in names and len(request.namespace_id) != KEY_BYTES:
        return f"namespace_id of {len(request.namespace_id)} bytes"
    for name in _KEY_FIELDS:
        if name in names:
            keys = list(getattr(request, name))
            if len(keys) > MAX_BATCH_KEYS:
                return f"{len(keys)} {name}"
            if any(len(key) != KEY_BYTES for key in keys):
                return f"a malformed key in {name}"
    if "parent_key" in names and len(request.parent_key) not in (0, KEY_BYTES):
        return f"parent_key of {len(request.parent_key)} bytes"
    return None


def _leased(method: str, request: Any) -> bool:
    """Whether the call names a client and asks for a lease (a shared-memory Get does; an inline one not)."""
    return method in ("Get", "GetLayers", "GetBlocks") and not request.inline


def _client_and_tenancy(method: str, request: Any, pools: Pools, names: set[str]) -> str | None:
    if method in _CLIENT_METHODS or _leased(method, request):
        if not request.client_id or len(request.client_id) > CLIENT_ID_MAX_CHARS:
            return f"client_id of {len(request.client_id)} characters"
    if pools.scoped_client_ids and "client_id" in names and "\x00" in request.client_id:
        return "a NUL in client_id (tenants scope client ids)"
    if foreign_namespace(request, pools):
        return "another tenant's namespace"
    if foreign_leases(method, request, pools):
        return "another tenant's lease"
    return None


def _call_shape(method: str, request: Any, pools: Pools, names: set[str]) -> str | None:
    if (method in _LEASE_MS_METHODS or _leased(method, request)) and request.lease_ms > pools.max_lease_ms:
        return f"lease_ms {request.lease_ms} over the maximum"
    if method in ("Commit", "PutInline") and request.ack not in kvd_pb2.Ack.values():
        return f"unknown ack {request.ack}"
    if method in ("Reserve", "PutInline") and len(set(request.keys)) != len(request.keys):
        return "duplicate keys in a Put"
    if method == "Release" and (len(request.lease_ids) > MAX_BATCH_KEYS
                                or len(set(request.lease_ids)) != len(request.lease_ids)):
        return "duplicate or too many lease_ids"
    if method == "PutInline" and len(request.blocks) != len(request.keys):
        return "blocks and keys differ in number"
    return None


def _bad_spec(method: str, request: Any, pools: Pools, names: set[str]) -> str | None:
    if method != "RegisterNamespace":
        return None
    if not request.HasField("spec"):
        return "no spec"
    spec = request.spec
    for name in ("kv_dtype", "inner_layout", "kv_order"):
        value = getattr(spec, name)
        if value == 0 or value not in spec.DESCRIPTOR.fields_by_name[name].enum_type.values_by_number:
            return f"spec.{name} {value}"
    if not spec.model_id or not spec.hash_scheme:
        return "spec without model_id or hash_scheme"
    return None


# In the order the daemon checks: the first reason found is the one given.
_INVALIDITY_CHECKS = (_malformed_ids, _client_and_tenancy, _call_shape, _bad_spec)


def certainly_invalid(method: str, request: Any, pools: Pools) -> str | None:
    """Why the daemon must refuse `request`, or None when this oracle cannot tell."""
    names = {descriptor.name for descriptor in request.DESCRIPTOR.fields}
    for check_request in _INVALIDITY_CHECKS:
        reason = check_request(method, request, pools, names)
        if reason is not None:
            return reason
    return None
