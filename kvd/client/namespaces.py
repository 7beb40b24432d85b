"""The namespaces a daemon knows, as an operator sees them, and finding one by name or id.

`NamespaceInfo` is one entry of ListNamespaces (an admin call): the
namespace's ids, tenant and spec, whose model_revision holds the identity
an engine connector records (the vLLM connector's "|vllm 0.32.0|cpu
CPU_ATTN/vec|kv [blocks][2, 128, 128]|cache_dtype auto"), and its blocks
and bytes per tier.

`resolve_namespace` is the one rule for what a NAME_OR_ID names, used by
`Client.find_namespace`, `Client.delete_namespace` and `kvd delete
--namespace`:

    64 hex digits        an id, exactly (the daemon's id of the namespace,
                         or the id its clients know it by)
    8 to 63 hex digits   the namespace whose id starts with them
    anything             the namespace whose model_id (its name) is exactly it
    id:HEX               only ids: HEX is an id or an id prefix as above

A string may match in more than one way (a model_id that is all hex
digits): every namespace it matches is a candidate. Exactly one candidate
is the answer; several are an `AmbiguousNamespace` listing them (id
prefix, tenant, model_id, model_revision); none is NotFound, saying what
was looked for. An empty string, or an id: that is not 8 to 64 hex digits,
is InvalidArgument. Case does not matter in hex digits; it does in names.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvd.core.keys import KEY_BYTES, MAX_STRING_BYTES, DType, InnerLayout, KvOrder, NamespaceSpec
from kvd.errors import InvalidArgument, NotFound
from kvd.v1 import kvd_pb2

ID_HEX_DIGITS = 2 * KEY_BYTES
# The shortest id prefix taken (as git's short ids: long enough to be unique among a daemon's).
ID_PREFIX_MIN_DIGITS = 8
# Forces an id: a model_id that is all hex digits is then not a candidate.
ID_SCHEME = "id:"
# Hex digits of an id shown to people (as `kvd status`).
SHORT_ID_DIGITS = 16
_HEX_DIGITS = frozenset(string.hexdigits)
# Names listed at most in a NotFound, to help find the right one.
LISTED_NAMES_MAX = 10


@dataclass(frozen=True, slots=True)
class TierUsage:
    """One tier's share of a namespace: blocks with a copy there (a block in two tiers counts
    in both), their own bytes and the bytes of the slots they take."""

    tier: str
    blocks: int
    payload_bytes: int
    used_bytes: int


@dataclass(frozen=True, slots=True)
class NamespaceInfo:
    """One namespace as ListNamespaces reports it (see the proto's NamespaceInfo)."""

    namespace_id: bytes
    client_namespace_id: bytes
    tenant: str
    # As registered, but with no tenant_salt (the daemon never sends it back: see `salted`).
    spec: NamespaceSpec
    salted: bool
    block_bytes: int
    blocks: int
    tiers: tuple[TierUsage, ...]
    hits: int
    misses: int
    disk_enabled: bool

    @property
    def name(self) -> str:
        return self.spec.model_id

    @property
    def identity(self) -> str:
        """What the engine's connector recorded about its cache layout (the spec's model_revision)."""
        return self.spec.model_revision

    @property
    def short_id(self) -> str:
        return self.namespace_id.hex()[:SHORT_ID_DIGITS]

    def tier(self, name: str) -> TierUsage | None:
        return next((usage for usage in self.tiers if usage.tier == name), None)

    def describe(self) -> str:
        """One line naming it for a person: id prefix, tenant, model_id, model_revision."""
        tenant = f" tenant {self.tenant!r}" if self.tenant else ""
        return f"{self.short_id}{tenant} model_id {self.name!r} model_revision {self.identity!r}"

    def to_dict(self) -> dict[str, Any]:
        """Plain data (what `kvd namespaces --json` prints for it)."""
        spec = self.spec
        return {
            "namespace_id": self.namespace_id.hex(),
            "client_namespace_id": self.client_namespace_id.hex(),
            "tenant": self.tenant,
            "model_id": spec.model_id,
            "model_revision": spec.model_revision,
            "spec": {
                "kv_dtype": _enum_name(DType, spec.kv_dtype), "num_layers": spec.num_layers,
                "num_kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "block_tokens": spec.block_tokens,
                "inner_layout": _enum_name(InnerLayout, spec.inner_layout),
                "kv_order": _enum_name(KvOrder, spec.kv_order), "tp_rank": spec.tp_rank, "tp_size": spec.tp_size,
                "pp_stage": spec.pp_stage, "pp_size": spec.pp_size, "lora_id": spec.lora_id,
                "hash_scheme": spec.hash_scheme, "salted": self.salted,
            },
            "block_bytes": self.block_bytes,
            "blocks": self.blocks,
            "tiers": {usage.tier: {"blocks": usage.blocks, "payload_bytes": usage.payload_bytes,
                                   "used_bytes": usage.used_bytes} for usage in self.tiers},
            "hits": self.hits,
            "misses": self.misses,
            "disk_enabled": self.disk_enabled,
        }


@dataclass(frozen=True, slots=True)
class NamespaceDeleted:
    """What DeleteNamespace did: blocks deleted, and blocks kept because they were pinned."""

    namespace: NamespaceInfo
    deleted: int
    pinned: int


class AmbiguousNamespace(InvalidArgument):
    """A name or id that matches several namespaces; `candidates` are they."""

    def __init__(self, asked: str, candidates: Sequence[NamespaceInfo]) -> None:
        lines = "".join(f"\n  {candidate.describe()}" for candidate in candidates)
        super().__init__(f"{asked!r} matches {len(candidates)} namespaces; name one by a longer id prefix"
                         f" (or choose a tenant):{lines}")
        self.candidates = tuple(candidates)


def tier_name(tier: int) -> str:
    """"host" for kvd.v1.TIER_HOST, and so on; the number of a tier this client does not know."""
    return kvd_pb2.Tier.Name(tier).removeprefix("TIER_").lower() if tier in kvd_pb2.Tier.values() else str(tier)


def namespace_infos(response: kvd_pb2.ListNamespacesResponse) -> list[NamespaceInfo]:
    return [_info(message) for message in response.namespaces]


def _info(message: kvd_pb2.NamespaceInfo) -> NamespaceInfo:
    spec = message.spec
    return NamespaceInfo(
        namespace_id=message.namespace_id,
        client_namespace_id=message.client_namespace_id,
        tenant=message.tenant,
        spec=NamespaceSpec(
            model_id=spec.model_id, model_revision=spec.model_revision, kv_dtype=DType(spec.kv_dtype),
            num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            block_tokens=spec.block_tokens, inner_layout=InnerLayout(spec.inner_layout),
            kv_order=KvOrder(spec.kv_order), tp_rank=spec.tp_rank, tp_size=spec.tp_size, pp_stage=spec.pp_stage,
            pp_size=spec.pp_size, lora_id=spec.lora_id, hash_scheme=spec.hash_scheme, tenant=message.tenant,
        ),
        salted=message.salted,
        block_bytes=message.block_bytes,
        blocks=message.blocks,
        tiers=tuple(TierUsage(tier_name(usage.tier), usage.blocks, usage.payload_bytes, usage.bytes_used)
                    for usage in message.tiers),
        hits=message.hits,
        misses=message.misses,
        disk_enabled=message.disk_enabled,
    )


def _enum_name(kind: type, value: int) -> str:
    return kind(value).name.lower()


@dataclass(frozen=True, slots=True)
class NamespaceReference:
    """A NAME_OR_ID, checked: the name to match (None: ids only) and the id prefix (None: names only)."""

    asked: str
    name: str | None
    id_prefix: str | None

    @classmethod
    def parse(cls, name_or_id: str) -> NamespaceReference:
        """InvalidArgument, saying what is wrong, for a string that can name no namespace."""
        if not isinstance(name_or_id, str) or not name_or_id.strip():
            raise InvalidArgument("a namespace's name or id must not be empty (`kvd namespaces` lists them)")
        if len(name_or_id.encode("utf-8", "surrogateescape")) > MAX_STRING_BYTES:
            raise InvalidArgument(f"{name_or_id[:40]!r}... is longer than any model_id ({MAX_STRING_BYTES} bytes)")
        if name_or_id.startswith(ID_SCHEME):
            digits = name_or_id[len(ID_SCHEME):]
            problem = _id_problem(digits)
            if problem:
                raise InvalidArgument(f"{name_or_id!r} is not an id: {problem}")
            return cls(name_or_id, None, digits.lower())
        return cls(name_or_id, name_or_id, None if _id_problem(name_or_id) else name_or_id.lower())

    def matches(self, info: NamespaceInfo) -> bool:
        if self.name is not None and info.name == self.name:
            return True
        prefix = self.id_prefix
        return prefix is not None and (info.namespace_id.hex().startswith(prefix)
                                       or info.client_namespace_id.hex().startswith(prefix))

    def not_found(self, namespaces: Sequence[NamespaceInfo], tenant: str) -> NotFound:
        """The error for no match, saying what was looked for, among what, and what there is."""
        looked = []
        if self.name is not None:
            looked.append(f"the model_id {self.name!r}")
        if self.id_prefix is not None:
            looked.append(f"an id {'equal to' if len(self.id_prefix) == ID_HEX_DIGITS else 'starting with'} "
                          f"{self.id_prefix}")
        elif self.name is not None and set(self.name) <= _HEX_DIGITS:
            looked[-1] += f" (nor is it an id: {_id_problem(self.name)})"
        among = f"tenant {tenant!r}'s {len(namespaces)}" if tenant else f"the daemon's {len(namespaces)}"
        names = sorted({info.name for info in namespaces})
        shown = ", ".join(repr(name) for name in names[:LISTED_NAMES_MAX]) + (", ..." if len(names) > LISTED_NAMES_MAX
                                                                              else "")
        return NotFound(f"no namespace has {' or '.join(looked)}, among {among} namespaces"
                        + (f" (model_ids: {shown})" if names else ""))


def _id_problem(digits: str) -> str:
    """Why `digits` is not an id or an id prefix ("" when it is one)."""
    if not set(digits) <= _HEX_DIGITS:
        return f"{digits!r} is not hexadecimal"
    if not ID_PREFIX_MIN_DIGITS <= len(digits) <= ID_HEX_DIGITS:
        return (f"an id is {ID_HEX_DIGITS} hex digits, a prefix of one at least {ID_PREFIX_MIN_DIGITS}; "
                f"{digits!r} has {len(digits)}")
    return ""


def resolve_namespace(namespaces: Sequence[NamespaceInfo], name_or_id: str | NamespaceReference,
                      tenant: str = "") -> NamespaceInfo:
    """The one namespace of `namespaces` that `name_or_id` names (see the module docstring);
    `tenant`: the tenant they were listed for, named in the error when none matches."""
    reference = name_or_id if isinstance(name_or_id, NamespaceReference) else NamespaceReference.parse(name_or_id)
    found = [info for info in namespaces if reference.matches(info)]
    if len(found) == 1:
        return found[0]
    if found:
        raise AmbiguousNamespace(reference.asked, found)
    raise reference.not_found(namespaces, tenant)
