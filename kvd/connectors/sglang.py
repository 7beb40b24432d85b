"""kvd as an SGLang HiCache storage backend (the L3 tier under HiCache's host pool).

Selected by SGLang's own dynamic-backend factory:

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvd",
        "module_path": "kvd.connectors.sglang", "class_name": "KvdHiCacheStorage",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
        "target": "unix:///run/kvd/kvd.sock"}'

Extra-config keys read here: `target` (default $KVD_TARGET, else
unix:///run/kvd/kvd.sock), `token` (default $KVD_TOKEN), `namespace` (a
string mixed into the cache identity, e.g. a model name override) and
`prefill_profile` (a prefill profile of the served model, as `make
prefill-profile` writes for vLLM: batch_exists then reports only the
leading pages that kvd can bring sooner than SGLang computes them, from
each page's load time as kvd prices it now; kvd.planner.prefill).
`interface_v1` makes SGLang call the zero-copy batch_get_v1/batch_set_v1;
`hicache_storage_pass_prefix_keys` makes it tell us each batch's parent
(see "Keys" below). This module imports sglang; nothing else in kvd does.

Data path. Each call makes one vectorised copy on each side and no Python
loop over pages or layers:

    host pool kv_buffer  --torch index (page ids)-->  rows [n, L, 2, P, H, D]
    rows  --kvd Reserve, one numpy scatter into arena slots, Commit-->  kvd

and back with Get, one numpy gather out of the arena slots, and one
indexed torch assignment into the host pool's pages. Every host layout
(layer_first, page_first, page_first_direct, page_head) is seen through a
strided view of shape [pages, layers, 2, page_size, heads, head_dim], so a
page is stored in kvd's own block layout (layer-major, K then V, token-major
inside), whatever the host layout. Without the shared-memory arena (another
host, another user) kvd's client falls back to inline bytes by itself.

Keys. SGLang names a page by a hash string chained over its prefix. kvd's
key for it is SHA-256("kvd/sglang-hicache/v1" 0x00 string): 32 bytes, as
content-addressed as SGLang's own. kvd's index is a tree, so every Lookup,
Reserve and Get also names the parent of the batch's first page:
 - when SGLang passes prefix keys (extra_info.prefix_keys, turned on by
   "hicache_storage_pass_prefix_keys": true), the parent is the kvd key of
   the last prefix page, and a sequence becomes one chain in kvd: one RPC per
   batch, and kvd's eviction (leaves first) and prefix matching work as for
   any other engine;
 - without them (SGLang's default, and the legacy get/set/exists), the first
   page of a batch is taken as a root. That is still correct, because a key
   names its whole prefix and kvd only matches a key under the parent it was
   stored with, so nothing is ever read for the wrong prefix; but a batch
   that starts mid-sequence becomes a chain of its own, and a later batch
   cut at other page boundaries misses the pages stored that way (kvd
   answers a miss, SGLang recomputes). Passing prefix keys avoids that.
A batch whose parent kvd no longer holds (evicted, deleted, the daemon
restarted without a disk tier) is a miss on Lookup and Get, and on a write
is reported as not stored: never a wrong page.

Identity. The kvd namespace is built from the host pool: layers, KV heads,
head dim, page size (block_tokens), dtype, TP rank/size, PP stage/size
(an MLA pool's latent: kv_order LATENT, one head as wide as the latent,
and TP rank 0 of 1, since every rank holds the same latent and SGLang
lets one of them write);
model_revision carries the rest of the layout's identity (host layout name,
layer range, DP and context-parallel rank, the `namespace` string). Pages
stored under one geometry are never served to another.

Failures. A kvd error (daemon down, a refused request) is logged and the
call answers a miss (False / 0); SGLang then recomputes or retries. A call
SGLang makes wrongly (host indices not on page boundaries) raises.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvd.client import Client, Namespace
from kvd.client.tensors import dtype_of_torch, torch_dtype
from kvd.connectors.sglang_pages import (
    LATENT_LAYOUTS,
    SUPPORTED_LAYOUTS,
    flat_page_view,
    is_latent,
    page_ids,
    page_view,
)
from kvd.connectors.sglang_pools import PoolsV2
from kvd.core.keys import DType, KvOrder, NamespaceSpec
from kvd.errors import KvdError
from kvd.planner.prefill import PrefillProfile, best_stop

logger = logging.getLogger(__name__)

DEFAULT_TARGET = "unix:///run/kvd/kvd.sock"
TARGET_ENV = "KVD_TARGET"
KEY_DOMAIN = b"kvd/sglang-hicache/v1\x00"
KVD_ERRORS = (grpc.RpcError, KvdError)


def kvd_key(page_hash: str) -> bytes:
    """The 32-byte kvd key of one SGLang page hash string."""
    return hashlib.sha256(KEY_DOMAIN + page_hash.encode()).digest()


def kvd_keys(page_hashes: list[str]) -> list[bytes]:
    return [kvd_key(page_hash) for page_hash in page_hashes]


def parent_of(extra_info: HiCacheStorageExtraInfo | None) -> bytes:
    """kvd key of the page before a batch: the last prefix key SGLang passed, else the root (b"")."""
    prefix = extra_info.prefix_keys if extra_info is not None else None
    return kvd_key(prefix[-1]) if prefix else b""


# ---------------------------------------------------------------------------
# Configuration and identity


@dataclass(frozen=True, slots=True)
class KvdSettings:
    """What the backend reads from SGLang's extra config (and the environment)."""

    target: str
    token: str | None
    namespace: str
    profile: PrefillProfile | None = None

    @classmethod
    def from_extra_config(cls, extra_config: dict | None) -> KvdSettings:
        extra = extra_config or {}
        target = extra.get("target") or os.environ.get(TARGET_ENV) or DEFAULT_TARGET
        token = extra.get("token") or None  # None: the client reads $KVD_TOKEN
        profile = extra.get("prefill_profile")
        return cls(target=str(target), token=token, namespace=str(extra.get("namespace", "")),
                   profile=PrefillProfile.load(profile) if profile else None)


# SGLang's --kv-cache-dtype values whose pools hold plain float8 in uint8 tensors.
FP8_CACHE_DTYPES = {"fp8_e4m3": DType.FLOAT8_E4M3, "fp8_e5m2": DType.FLOAT8_E5M2}


def element_type(host_pool: Any) -> DType:
    """The kvd element type of the host pool's KV: its tensors' own type, or, for the one-byte tensors
    SGLang keeps an fp8 cache in, the float8 format its --kv-cache-dtype names."""
    if host_pool.dtype.itemsize > 1:
        return dtype_of_torch(host_pool.dtype)
    kind = served_kv_cache_dtype()
    if kind in FP8_CACHE_DTYPES:
        return FP8_CACHE_DTYPES[kind]
    raise NotImplementedError(f"kvd: a host pool of {host_pool.dtype} with --kv-cache-dtype {kind!r} is not "
                              f"supported (supported: the model's dtype, {', '.join(sorted(FP8_CACHE_DTYPES))})")


def served_kv_cache_dtype() -> str:
    """The --kv-cache-dtype of the SGLang server this process belongs to ("unknown" if none is published)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return str(get_server_args().kv_cache_dtype)
    except (ImportError, AttributeError, RuntimeError, LookupError):
        return "unknown"


def namespace_spec(host_pool: Any, config: HiCacheStorageConfig, settings: KvdSettings) -> NamespaceSpec:
    """The kvd cache identity of this host pool, rank and configuration."""
    check_host_pool(host_pool, config)
    revision = ";".join([
        "sglang-hicache/v1",
        f"layout={host_pool.layout}",
        f"layers={host_pool.start_layer}-{host_pool.end_layer}/{host_pool.layer_num}",
        f"dp={config.dp_rank}",
        f"cp={config.attn_cp_rank}/{config.attn_cp_size}",
        f"namespace={settings.namespace}",
    ])
    if is_latent(host_pool):
        # Every TP rank holds the same latent (SGLang lets one of them write): one namespace for all.
        geometry = {"num_kv_heads": 1, "head_dim": host_pool.kv_cache_dim, "kv_order": KvOrder.LATENT,
                    "tp_rank": 0, "tp_size": 1}
    else:
        geometry = {"num_kv_heads": host_pool.head_num, "head_dim": host_pool.head_dim, "tp_rank": config.tp_rank,
                    "tp_size": config.tp_size}
    return NamespaceSpec(
        model_id=config.model_name or "sglang-unnamed-model",
        model_revision=revision,
        num_layers=host_pool.layer_num,
        block_tokens=host_pool.page_size,
        kv_dtype=element_type(host_pool),
        pp_stage=config.pp_rank,
        pp_size=config.pp_size,
        **geometry,
    )


def check_host_pool(host_pool: Any, config: HiCacheStorageConfig) -> None:
    """Refuse the pools and modes this backend does not handle, naming why."""
    if config.dcp_size > 1:
        raise NotImplementedError("kvd: decode-context-parallel pools are not supported yet")
    if config.is_mla_model != is_latent(host_pool):
        raise NotImplementedError(f"kvd: a {type(host_pool).__name__} host pool in a storage config with "
                                  f"is_mla_model={config.is_mla_model} (DeepSeek-V4's compressed pools, say) is not "
                                  "supported")
    if config.should_split_heads:
        raise NotImplementedError("kvd: heterogeneous-TP head splitting is not supported")
    if hasattr(host_pool, "k_scale_host"):  # MXFP8: the values' scales live in buffers of their own
        raise NotImplementedError(f"kvd: a {type(host_pool).__name__} host pool keeps scales beside its KV pages, "
                                  "which kvd does not store: not supported")
    layouts = LATENT_LAYOUTS if is_latent(host_pool) else SUPPORTED_LAYOUTS
    if host_pool.layout not in layouts:
        raise NotImplementedError(f"kvd: host layout {host_pool.layout!r} is not supported (supported: {layouts})")
    if not is_latent(host_pool) and getattr(host_pool, "v_head_dim", host_pool.head_dim) != host_pool.head_dim:
        raise NotImplementedError("kvd: K and V head dims differ")
    if host_pool.size % host_pool.page_size:
        raise ValueError(f"kvd: host pool size {host_pool.size} is not a multiple of its page size")


# ---------------------------------------------------------------------------
# The backend


class KvdHiCacheStorage(HiCacheStorage):
    """HiCache L3 storage in a kvd daemon on this node (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        self.storage_config = storage_config
        self.settings = KvdSettings.from_extra_config(storage_config.extra_config)
        self.mem_pool_host: Any = None
        self._spec: NamespaceSpec | None = None
        # One client per calling thread (SGLang's prefetch, prefetch I/O and
        # backup threads): each maps the arena itself and registers the
        # namespace once; no lock is held across an RPC.
        self._local = threading.local()
        # Pages kvd reported lost to damage (a block failed its checksum), since start.
        self.corrupt_pages = 0
        self._clients: list[Client] = []
        self._clients_lock = threading.Lock()
        # Hybrid models' sliding-window and Mamba pools, each in a namespace of its own.
        self._extra = PoolsV2(self, lambda host_pool: namespace_spec(host_pool, storage_config, self.settings))

    # -- set-up ------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._spec = namespace_spec(mem_pool_host, self.storage_config, self.settings)
        # As the namespace's elements: an fp8 pool keeps float8 values in uint8 tensors.
        self._pages = page_view(mem_pool_host).view(torch_dtype(self._spec.kv_dtype))
        logger.info("kvd HiCache backend: %s, namespace %s", self.settings.target, self._spec.namespace_id().hex()[:16])

    def _session(self, spec: NamespaceSpec | None = None) -> tuple[Client, Namespace]:
        """This thread's client and its registration of `spec` (the KV pool's by default), made
        on first use."""
        spec = spec or self._spec
        if spec is None:
            raise RuntimeError("kvd: no host pool registered yet (register_mem_pool_host)")
        client = getattr(self._local, "client", None)
        if client is None:
            client = Client(self.settings.target, token=self.settings.token)
            with self._clients_lock:
                self._clients.append(client)
            self._local.client = client
            self._local.namespaces = {}
        namespace = self._local.namespaces.get(spec)
        if namespace is None:
            namespace = self._local.namespaces[spec] = client.register_namespace(spec)
        return client, namespace

    def _call(self, operation: Any, spec: NamespaceSpec | None = None) -> Any:
        """Run operation(client, namespace) in `spec` (the KV pool's by default), registering the
        namespace again once if the daemon no longer knows it (restarted without a disk tier)."""
        client, namespace = self._session(spec)
        try:
            return operation(client, namespace)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND or "namespace" not in (error.details() or ""):
                raise
        self._local.namespaces.pop(spec or self._spec, None)
        client, namespace = self._session(spec)
        return operation(client, namespace)

    def close(self) -> None:
        with self._clients_lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()

    # -- zero-copy interface (interface_v1) --------------------------------

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many leading pages of `keys` kvd can serve, from its tiers or (in a cluster) a peer's:
        one Lookup; batch_get_v1 then has the daemon fetch a peer's pages."""
        if not keys:
            return 0
        profile = self.settings.profile
        try:
            found = self._call(lambda client, ns: client.lookup(ns, kvd_keys(keys), parent_of(extra_info),
                                                                include_remote=None, load_times=profile is not None))
        except KVD_ERRORS as error:
            logger.warning("kvd: exists of %d pages failed, reporting none: %s", len(keys), describe(error))
            return 0
        if profile is None or not found.matched:
            return found.matched
        page = self.mem_pool_host.page_size
        before = len(extra_info.prefix_keys or []) * page if extra_info is not None else 0
        choice = best_stop(profile, 0, found.matched, page, before + len(keys) * page, np.asarray(found.load_s),
                           before_tokens=before)
        if choice.stop < found.matched:
            logger.info("kvd: %d of %d stored pages are worth loading; SGLang computes the rest (about %.3f s "
                        "against %.3f s loading them all)", choice.stop, found.matched,
                        choice.load_s + choice.compute_s, choice.load_all_s)
        return choice.stop

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Load the stored prefix of `keys` into the host pages at host_indices.

        True for each page loaded; the first page kvd does not have is
        False and so is every page after it (their host pages untouched)."""
        if not keys:
            return []
        pages = page_ids(host_indices, self.mem_pool_host.page_size, len(keys))
        try:
            rows = self._get(keys, parent_of(extra_info))
        except KVD_ERRORS as error:
            logger.warning("kvd: get of %d pages failed, reporting misses: %s", len(keys), describe(error))
            return [False] * len(keys)
        matched = rows.shape[0]
        if matched:
            self._pages[pages[:matched]] = self._rows_as_pages(rows)
        return [index < matched for index in range(len(keys))]

    def _get(self, keys: list[str], parent_key: bytes):
        """The stored prefix of `keys`, as rows; damage kvd found on the way is logged and counted
        (the pages are then misses, which SGLang recomputes, as for any miss)."""
        result = self._call(lambda client, ns: client.get(ns, kvd_keys(keys), parent_key=parent_key))
        if result.corrupt:
            self.corrupt_pages += len(keys) - result.blocks.shape[0]
            logger.warning("kvd: page %d of %d was corrupt on kvd's disk (failed its checksum) and is gone; "
                           "it and the %d pages after it are misses", result.blocks.shape[0], len(keys),
                           len(keys) - result.blocks.shape[0] - 1)
        return result.blocks

    # -- hybrid models' extra pools (kvd.connectors.sglang_pools) ------------

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._extra.register(host_pool_name, host_pool)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """The KV prefix (batch_exists), cut to the longest end whose extra pools' state kvd holds."""
        try:
            return self._extra.exists(keys, pool_transfers, extra_info)
        except KVD_ERRORS as error:
            logger.warning("kvd: exists of %d pages with %d pools failed, reporting none: %s", len(keys),
                           len(pool_transfers or ()), describe(error))
            return PoolTransferResult.empty()

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._pools_io(transfers, extra_info, self.batch_get_v1, self._extra.get, "get")

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._pools_io(transfers, extra_info, self.batch_set_v1, self._extra.set, "set")

    def _pools_io(self, transfers, extra_info, kv_call, extra_call, what: str) -> dict[str, list[bool]]:
        """KV transfers through the v1 call, the others through the extra pools; a failure is
        reported as pages not moved."""
        results = {transfer.name: kv_call(list(transfer.keys or ()), transfer.host_indices, extra_info)
                   for transfer in transfers if transfer.name == PoolName.KV}
        extra = [transfer for transfer in transfers if transfer.name != PoolName.KV]
        try:
            results.update(extra_call(extra))
        except KVD_ERRORS as error:
            logger.warning("kvd: %s of pools %s failed: %s", what, [str(t.name) for t in extra], describe(error))
            results.update({transfer.name: [False] * len(transfer.keys or ()) for transfer in extra})
        return results

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: HiCacheStorageExtraInfo | None = None
    ) -> list[bool]:
        """Store the host pages at host_indices under `keys`; True for each
        page kvd holds afterwards (a leading run)."""
        if not keys:
            return []
        pages = page_ids(host_indices, self.mem_pool_host.page_size, len(keys))
        try:
            stored = self._call(lambda client, ns: self._store(client, ns, kvd_keys(keys), pages, parent_of(extra_info)))
        except KVD_ERRORS as error:
            logger.warning("kvd: set of %d pages failed, reporting none stored: %s", len(keys), describe(error))
            stored = 0
        return [index < stored for index in range(len(keys))]

    def _store(self, client: Client, namespace: Namespace, keys: list[bytes], pages: torch.Tensor, parent: bytes) -> int:
        """Write the pages kvd does not hold yet; how many leading keys it holds after.

        A Lookup first, so pages already stored (write-through rewrites
        shared prefixes often) are neither copied nor sent. Then one gather
        of the missing pages from the host pool and one Put (Reserve, a
        scatter into the arena, Commit). A concurrent writer of the same
        pages can make the count low, never high.
        """
        held = client.lookup(namespace, keys, parent).matched
        if held == len(keys):
            return held
        rows = self._pages[pages[held:]].contiguous()  # the one gather: [n, L, 2, P, H, D]
        written = client.put(namespace, keys[held:], rows, parent_key=keys[held - 1] if held else parent)
        return held + written

    def _rows_as_pages(self, rows: np.ndarray) -> torch.Tensor:
        """kvd rows (the namespace's numpy dtype) as a [n, L, 2, P, H, D] tensor of the namespace's elements."""
        tensor = torch.from_numpy(rows.reshape(rows.shape[0], -1).view(np.uint8))
        return tensor.view(self._pages.dtype).view(rows.shape[0], *self._pages.shape[1:])

    # -- legacy interface (one flat page per key) ---------------------------
    # SGLang uses these without "interface_v1". They pass no prefix keys, so
    # each batch is a chain from the root (see "Keys" in the module docstring).

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list:
        """Fill each flat page of target_locations from kvd; None from the first page kvd lacks."""
        if not keys:
            return []
        try:
            rows = self._get(keys, b"")
        except KVD_ERRORS as error:
            logger.warning("kvd: get of %d pages failed, reporting misses: %s", len(keys), describe(error))
            return [None] * len(keys)
        pages = self._rows_as_pages(rows)
        results: list = [None] * len(keys)
        for index in range(rows.shape[0]):  # one copy per page: this interface hands over one tensor per page
            flat_page_view(self.mem_pool_host, target_locations[index]).view(pages.dtype).copy_(pages[index])
            results[index] = target_locations[index]
        return results

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        """Store flat pages under `keys` (a chain from the root); True when all are held."""
        if not keys:
            return True
        rows = torch.stack([flat_page_view(self.mem_pool_host, value) for value in values]).view(self._pages.dtype)
        try:
            written = self._call(lambda client, ns: self._store_rows(client, ns, kvd_keys(keys), rows))
        except KVD_ERRORS as error:
            logger.warning("kvd: set of %d pages failed: %s", len(keys), describe(error))
            return False
        return written == len(keys)

    @staticmethod
    def _store_rows(client: Client, namespace: Namespace, keys: list[bytes], rows: torch.Tensor) -> int:
        client.put(namespace, keys, rows.contiguous())
        return client.lookup(namespace, keys).matched

    def clear(self) -> None:
        """Not offered: kvd deletes by key (Client.delete), and its eviction
        already bounds what the namespace holds."""
        logger.warning("kvd: clear() is not supported; pages leave kvd by eviction or Client.delete")


def describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code().name}: {error.details()}"
    return f"{type(error).__name__}: {error}"
