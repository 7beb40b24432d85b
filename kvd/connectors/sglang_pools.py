"""SGLang's extra host pools (sliding-window KV, Mamba states) in kvd: HiCache storage's v2 calls.

SGLang 0.5.23 serves every model through its hybrid cache controller. For a
model with sliding-window or Mamba layers it writes, beside each radix
node's KV pages (the v1 calls, kvd.connectors.sglang), what those layers
need to resume at the node's end: the sliding-window layers' last pages
(the window) or the Mamba state at the last page. A prefix of L pages is
restorable only if that state for L is stored ("trailing pages").

Each extra pool gets a kvd namespace of its own: the pool's geometry, with
its name in the identity. A pool of KV pages (sliding-window layers, MHA or
MLA) is stored as KV pages are; any other (a Mamba state: bytes in SGLang's
flat page format) as one opaque plane of bytes per page, padded to whole
disk blocks. The state for a
prefix end is one chain from the root, its pages under keys derived from
(page hash, end page hash): windows ending at different pages never share
a block, and "is the state for L pages stored" is one Lookup.

batch_exists_v2 takes the KV prefix from the v1 Lookup (the prefill rule
included), then the longest L up to it whose state every extra pool holds,
trying from the longest down, at most MAX_PROBES prefix ends: SGLang writes
a node's state at the node's end, which is where a KV prefix it wrote ends.
Pools with another hit policy (every page, block groups: DeepSeek's
indexer and compressed pools) are not stored: a request that needs one is
a miss, never a wrong page.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, PoolTransferResult

from kvd.client.tensors import torch_dtype
from kvd.connectors.sglang_pages import page_ids, page_view
from kvd.core.keys import LAYER_ALIGN_BYTES, DType, KvOrder, NamespaceSpec

logger = logging.getLogger(__name__)

STATE_DOMAIN = b"kvd/sglang-hicache/state/v1\x00"
MAX_PROBES = 32  # prefix ends tried per batch_exists_v2, from the longest down


def state_keys(page_hashes: list[str]) -> list[bytes]:
    """kvd keys of the pages of one prefix end's state: (page hash, the last page's hash)."""
    end = page_hashes[-1].encode()
    return [hashlib.sha256(STATE_DOMAIN + page.encode() + b"\x00" + end).digest() for page in page_hashes]


def window(all_keys: list[str], offset: int, length: int, pages: int) -> list[str]:
    """The hashes of the last `pages` pages of the prefix of `length` pages of the span at `offset`."""
    return all_keys[max(0, offset + length - pages):offset + length]


@dataclasses.dataclass
class ExtraPool:
    """One registered extra pool: how its pages look to kvd, and its namespace."""

    name: str
    host_pool: Any
    spec: NamespaceSpec
    paged: bool  # KV pages (viewed with page_view); else SGLang's flat byte pages
    pages: torch.Tensor | None = None  # page_view of a paged pool
    page_bytes: int = 0  # a flat page's bytes (its kvd block is padded to whole disk blocks)

    def gather(self, host_indices: torch.Tensor, count: int) -> torch.Tensor:
        """`count` pages of the pool at host_indices, as kvd rows (n, *spec.block_shape)."""
        if self.paged:
            return self.pages[page_ids(host_indices, self.host_pool.page_size, count)].contiguous()
        rows = torch.zeros((count, self.spec.block_bytes), dtype=torch.uint8)
        for row, start in zip(rows, self._starts(host_indices, count), strict=True):
            row[:self.page_bytes] = self.host_pool.get_data_page(start, flat=True).contiguous().view(torch.uint8)
        return rows.view(torch.int8).reshape(count, *self.spec.block_shape)

    def scatter(self, host_indices: torch.Tensor, rows: np.ndarray) -> None:
        """kvd rows into the pool's pages at host_indices."""
        size, count = self.host_pool.page_size, rows.shape[0]
        data = torch.from_numpy(np.ascontiguousarray(rows).reshape(count, -1).view(np.uint8))
        if self.paged:
            self.pages[page_ids(host_indices[:count * size], size, count)] = \
                data.view(self.host_pool.dtype).view(count, *self.pages.shape[1:])
            return
        for row, start in zip(data, self._starts(host_indices, count), strict=True):
            self.host_pool.set_from_flat_data_page(start, row[:self.page_bytes])

    def _starts(self, host_indices: torch.Tensor, count: int) -> list[int]:
        """The first host index of each of `count` flat pages."""
        return [int(start) for start in host_indices.reshape(-1)[::self.host_pool.page_size][:count].tolist()]


def extra_pool(name: str, host_pool: Any, kv_spec: NamespaceSpec, pool_spec: Callable[[Any], NamespaceSpec]) -> ExtraPool:
    """The kvd view of one extra pool: its own namespace, named after the pool. `pool_spec(host_pool)`:
    the namespace a pool of KV pages would have as the anchor pool."""
    if hasattr(host_pool, "kv_buffer") and (hasattr(host_pool, "head_num") or hasattr(host_pool, "kv_cache_dim")):
        spec = pool_spec(host_pool)
        spec = dataclasses.replace(spec, model_revision=f"{spec.model_revision};pool={name}")
        return ExtraPool(name, host_pool, spec, paged=True, pages=page_view(host_pool).view(torch_dtype(spec.kv_dtype)))
    dummy = host_pool.get_dummy_flat_data_page()
    nbytes = dummy.numel() * dummy.element_size()
    # Padded to whole disk blocks: the disk tier stores layers of LAYER_ALIGN_BYTES multiples only.
    spec = dataclasses.replace(kv_spec, num_layers=1, num_kv_heads=1, head_dim=LAYER_ALIGN_BYTES,
                               block_tokens=-(-nbytes // LAYER_ALIGN_BYTES), kv_dtype=DType.INT8, kv_order=KvOrder.LATENT,
                               model_revision=f"{kv_spec.model_revision};pool={name};page_bytes={nbytes}")
    return ExtraPool(name, host_pool, spec, paged=False, page_bytes=nbytes)


class PoolsV2:
    """The v2 calls, on the backend's sessions (`backend._call(operation, spec)`)."""

    def __init__(self, backend: Any, pool_spec: Callable[[Any], NamespaceSpec]) -> None:
        self.backend = backend
        self.pool_spec = pool_spec
        self.pools: dict[str, ExtraPool] = {}  # by SGLang's PoolName; a pool kvd refused is absent

    def register(self, name: str, host_pool: Any) -> None:
        if name == PoolName.KV:
            return  # the anchor pool: register_mem_pool_host, the v1 calls
        try:
            self.pools[name] = extra_pool(name, host_pool, self.backend._spec, self.pool_spec)
        except (NotImplementedError, ValueError) as error:
            logger.warning("kvd: host pool %r is not stored (%s); prefixes that need it are misses", name,
                           str(error) or type(error).__name__)

    def exists(self, keys: list[str], transfers: list[PoolTransfer] | None, extra_info: Any) -> PoolTransferResult:
        kv_pages = self.backend.batch_exists(keys, extra_info)
        hits = {PoolName.KV: kv_pages} if kv_pages else {}
        extra = [transfer for transfer in transfers or [] if transfer.name != PoolName.KV]  # (KV: kv_pages)
        trailing = [transfer for transfer in extra if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES]
        if len(trailing) < len(extra) or any(t.name not in self.pools for t in trailing):
            return PoolTransferResult(0, hits, [])  # a pool kvd does not store: no prefix is restorable
        if not trailing:
            return PoolTransferResult(kv_pages, hits, list(range(1, kv_pages + 1)))
        prefix = list(getattr(extra_info, "prefix_keys", None) or [])
        all_keys, offset = prefix + list(keys), len(prefix)
        for length in range(kv_pages, max(0, kv_pages - MAX_PROBES), -1):
            if all(self._held(transfer, all_keys, offset, length) for transfer in trailing):
                hits.update({transfer.name: length for transfer in trailing})
                return PoolTransferResult(length, hits, [length])
        return PoolTransferResult(0, hits, [])

    def _held(self, transfer: PoolTransfer, all_keys: list[str], offset: int, length: int) -> bool:
        pages = window(all_keys, offset, length, max(1, len(transfer.keys or ())))
        derived = state_keys(pages)
        return self.backend._call(lambda client, ns: client.lookup(ns, derived).matched,
                                  self.pools[transfer.name].spec) == len(derived)

    def get(self, transfers: list[PoolTransfer]) -> dict[str, list[bool]]:
        return self._each(transfers, self._get_one)

    def set(self, transfers: list[PoolTransfer]) -> dict[str, list[bool]]:
        return self._each(transfers, self._set_one)

    def _each(self, transfers: list[PoolTransfer], move: Callable) -> dict[str, list[bool]]:
        """Per transfer, True for the leading pages `move` moved (none, in a pool kvd does not store)."""
        results = {}
        for transfer in transfers:
            keys, pool = list(transfer.keys or ()), self.pools.get(transfer.name)
            moved = move(pool, transfer, state_keys(keys)) if pool is not None and keys else 0
            results[transfer.name] = [index < moved for index in range(len(keys))]
        return results

    def _get_one(self, pool: ExtraPool, transfer: PoolTransfer, keys: list[bytes]) -> int:
        rows = self.backend._call(lambda client, ns: client.get_numpy(ns, keys), pool.spec)
        pool.scatter(transfer.host_indices, rows)
        return rows.shape[0]

    def _set_one(self, pool: ExtraPool, transfer: PoolTransfer, keys: list[bytes]) -> int:
        rows = pool.gather(transfer.host_indices, len(keys))
        return self.backend._call(lambda client, ns: _store(client, ns, keys, rows), pool.spec)


def _store(client: Any, namespace: Any, keys: list[bytes], rows: torch.Tensor) -> int:
    """The state's pages as one chain from the root; how many leading ones kvd holds after."""
    held = client.lookup(namespace, keys).matched
    if held < len(keys):
        client.put(namespace, keys[held:], rows[held:], parent_key=keys[held - 1] if held else b"")
    return client.lookup(namespace, keys).matched
