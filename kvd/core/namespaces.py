"""Namespaces: the cache identities the engine knows, and which tenant may see each.

A namespace is one model's cache identity (kvd.core.keys.NamespaceSpec)
with its own prefix index. A spec with a tenant is that tenant's
namespace: its blocks are charged to the tenant's quota, and the tenant
finds it by the id its clients know (the spec's digest without the
tenant); any other tenant gets NOT_FOUND, exactly as for a namespace
nobody registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvd.core.keys import KEY_BYTES, NamespaceSpec
from kvd.core.limits import EngineLimits
from kvd.core.quota import TenantQuota
from kvd.core.radix import PrefixIndex
from kvd.core.tier import MemoryTier, StorageTier
from kvd.errors import InvalidArgument, NotFound, ResourceExhausted
from kvd.invariants import check


@dataclass(slots=True, eq=False)
class NamespaceState:
    namespace_id: bytes
    spec: NamespaceSpec
    block_bytes: int
    index: PrefixIndex
    lookup_hits: int = 0
    lookup_misses: int = 0
    get_hits: int = 0
    get_misses: int = 0
    # The id its clients know it by: the digest of the spec they sent,
    # without the tenant (== namespace_id for a namespace of no tenant).
    public_id: bytes = b""
    # Its tenant's usage and quota (None: no tenant).
    quota: TenantQuota | None = None

    @property
    def hits(self) -> int:
        """Keys Lookups and Gets found (what Stats and ListNamespaces report)."""
        return self.lookup_hits + self.get_hits

    @property
    def misses(self) -> int:
        return self.lookup_misses + self.get_misses


def namespace_not_found(namespace_id: bytes) -> NotFound:
    """The one error for a namespace the caller cannot use, whether or not anyone registered it."""
    return NotFound(f"namespace {namespace_id.hex()[:16]}... is not registered; call RegisterNamespace first")


class NamespaceTable:
    def __init__(self, limits: EngineLimits, host: MemoryTier, lower: Sequence[StorageTier],
                 tenant_quotas: Sequence[TenantQuota]) -> None:
        self.limits = limits
        self.host = host
        self.lower = list(lower)
        self._by_id: dict[bytes, NamespaceState] = {}
        # (tenant, the id its clients know) -> namespace: how the daemon
        # finds a tenant's namespace, and only that tenant's.
        self._public: dict[tuple[str, bytes], NamespaceState] = {}
        # Usage and quotas of the configured tenants (and of tenants whose
        # namespaces were recovered from disk: those have no limits).
        self.tenants: dict[str, TenantQuota] = {quota.name: quota for quota in tenant_quotas}

    def register(self, spec: NamespaceSpec) -> NamespaceState:
        """Register (idempotently) the cache identity `spec`.

        A spec with a tenant (kvd.core.keys) is that tenant's namespace: its
        blocks are charged to the tenant's quota, and tenant_namespace finds
        it for that tenant only.
        """
        spec.validate()
        namespace_id = spec.namespace_id()
        existing = self._by_id.get(namespace_id)
        if existing is not None:
            return existing
        if len(self._by_id) >= self.limits.max_namespaces:
            raise ResourceExhausted(f"too many namespaces (max {self.limits.max_namespaces})")
        if spec.block_bytes > self.host.slot_bytes:
            raise InvalidArgument(
                f"a block of this namespace is {spec.block_bytes} bytes, larger than the host slot "
                f"of {self.host.slot_bytes} bytes; use fewer tokens per block or raise host.slot_bytes"
            )
        quota = self.tenant_quota(spec.tenant) if spec.tenant else None
        public_id = spec.without_tenant().namespace_id() if spec.tenant else namespace_id
        index = PrefixIndex(spec.model_id, spec.block_bytes, namespace_id, quota)
        index.host_class = self.host.pool.class_for(spec.block_bytes).index
        state = NamespaceState(namespace_id, spec, spec.block_bytes, index, public_id=public_id, quota=quota)
        self._by_id[namespace_id] = state
        self._public[(spec.tenant, public_id)] = state
        return state

    def tenant_quota(self, tenant: str) -> TenantQuota:
        """The usage and quota of `tenant` (one with no limits if it is not configured)."""
        check(bool(tenant), "the empty tenant has no quota")
        quota = self.tenants.get(tenant)
        if quota is None:
            quota = self.tenants[tenant] = TenantQuota(tenant)
        return quota

    def tenant_namespace(self, tenant: str, public_id: bytes) -> NamespaceState:
        """The namespace `tenant` knows as `public_id` ("": the namespaces of no tenant).

        Another tenant's namespace is NOT_FOUND exactly like one nobody
        registered, so its existence is not revealed.
        """
        if len(public_id) != KEY_BYTES:
            raise InvalidArgument(f"namespace_id must be {KEY_BYTES} bytes, got {len(public_id)}")
        state = self._public.get((tenant, public_id))
        if state is None:
            raise namespace_not_found(public_id)
        return state

    def enable_disk(self, namespace_id: bytes) -> None:
        """Write this namespace's sealed blocks to the tiers below host memory from now on."""
        check(bool(self.lower), "no tier below host memory")
        self.namespace(namespace_id).index.disk_enabled = True

    def namespace(self, namespace_id: bytes) -> NamespaceState:
        if len(namespace_id) != KEY_BYTES:
            raise InvalidArgument(f"namespace_id must be {KEY_BYTES} bytes, got {len(namespace_id)}")
        state = self._by_id.get(namespace_id)
        if state is None:
            raise namespace_not_found(namespace_id)
        return state

    def namespaces(self) -> list[NamespaceState]:
        return list(self._by_id.values())


    def verify(self) -> None:
        for (tenant, public_id), state in self._public.items():
            check(self._by_id.get(state.namespace_id) is state and state.spec.tenant == tenant
                  and state.public_id == public_id and state.index.quota is state.quota
                  and (state.quota is None) == (not tenant), "namespace {} filed wrongly", public_id.hex()[:16])
        check(len(self._public) == len(self._by_id), "a namespace is missing from the public map")
        for name, quota in self.tenants.items():
            check(quota.name == name, "tenant {!r} filed as {!r}", quota.name, name)
