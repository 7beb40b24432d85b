"""The engine's paged KV cache as kvd sees it: per layer, one byte row per block.

vLLM hands the worker one tensor per attention layer. kvd stores a block
as its layers one after another, each layer's K and V as one opaque byte
run (kvd never looks inside). So all the connector needs per layer is a
[num_blocks, bytes] view whose row i is engine block i of that layer:

- one part, when each block of a layer is contiguous (the CPU backend:
  [num_blocks, kv_heads, block_size, 2 * head_dim], K transposed and V in
  an ISA-specific interior; FlashInfer-like [num_blocks, 2, ...]);
- two parts, K then V, when the tensor is [2, num_blocks, ...]
  (FlashAttention-like layouts): a block's layer is the K row then the V row;
- one part holding one latent per token for MLA models ([num_blocks,
  block_size, latent width]), stored under kv_order LATENT.

The bytes' meaning depends on all of that, so the namespace's identity
records the attention backend, the tensor layout, the CPU ISA path and
the cache dtype besides the model: blocks written under one layout are
never served to another (they are in a different namespace).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvd.client.tensors import dtype_of_torch
from kvd.core.keys import DType, KvOrder, NamespaceSpec


class UnsupportedLayout(Exception):
    """The engine's KV cache cannot be stored block by block as kvd does."""


@dataclass(frozen=True, slots=True)
class PagedLayout:
    """Per-layer row views of the engine's KV cache, in layer order.

    The rows are of `word`, int64 when every part's width allows (torch's
    indexed copies move 8-byte words about 14x faster than bytes: 2.4 vs
    34 ms for 4 MiB of 128 KiB rows on this machine), else uint8; the
    arena is viewed the same way for the copies."""

    names: tuple[str, ...]
    parts: tuple[tuple[torch.Tensor, ...], ...]  # parts[layer] = 1 or 2 [num_blocks, words] views
    layer_bytes: int
    num_blocks: int
    description: str  # the tensor layout, for the namespace identity
    word: torch.dtype = torch.uint8
    groups: KvGroups | None = None  # None: one group, every layer in it

    def index_of(self) -> dict[str, int]:
        return {name: index for index, name in enumerate(self.names)}

    def group_of(self, layer: int) -> int:
        return self.groups.of_layer[layer] if self.groups is not None else 0


@dataclass(frozen=True, slots=True)
class KvGroups:
    """vLLM's KV cache groups (its hybrid KV cache manager): each has a block table of its own.

    A hybrid model's layers fall into groups by attention type (full, sliding
    window, ...); a request's position i is engine block block_ids[g][i] in
    the layers of group g. The groups share the physical blocks, so layers of
    different groups may be views of one tensor. A windowed group's table
    holds vLLM's null block at the positions its window has left: nothing of
    those layers is there to save, and nothing needs loading."""

    of_layer: tuple[int, ...]  # the group of each layer, in the layout's layer order
    windowed: frozenset[int]  # groups whose table may hold the null block

    @property
    def count(self) -> int:
        return max(self.of_layer) + 1


def kv_groups(kv_cache_config: Any, names: tuple[str, ...]) -> KvGroups | None:
    """The groups of vLLM's KV cache config for the layers `names` (None: a single group);
    UnsupportedLayout for a group kvd cannot store block by block."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
    if len(groups) <= 1:
        return None
    of_name, windowed = {}, set()
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        inner = list(spec.kv_cache_specs.values()) if isinstance(spec, UniformTypeKVCacheSpecs) else [spec]
        if not all(isinstance(one, (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec)) for one in inner):
            raise UnsupportedLayout(
                f"KV cache group {index} holds {type(inner[0]).__name__} layers ({', '.join(group.layer_names[:3])}"
                f"{', ...' if len(group.layer_names) > 3 else ''}): their state is kept per request, not per block "
                "of tokens, and kvd stores blocks")
        if any(isinstance(one, (SlidingWindowSpec, ChunkedLocalAttentionSpec)) for one in inner):
            windowed.add(index)
        of_name.update(dict.fromkeys(group.layer_names, index))
    missing = [name for name in names if name not in of_name]
    if missing:
        raise UnsupportedLayout(f"layers {missing[:3]} are in no KV cache group")
    return KvGroups(tuple(of_name[name] for name in names), frozenset(windowed))


def _byte_rows(tensor: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """tensor[i] flattened to bytes, as a view; UnsupportedLayout if it is not one."""
    if tensor.shape[0] != num_blocks:
        raise UnsupportedLayout(f"expected {num_blocks} blocks on the block axis, got shape {tuple(tensor.shape)}")
    try:
        return tensor.view(num_blocks, -1).view(torch.uint8)
    except RuntimeError as error:
        raise UnsupportedLayout(f"a block of a layer is not contiguous in shape {tuple(tensor.shape)}: {error}") from None


def _layer_parts(tensor: torch.Tensor, num_blocks: int) -> tuple[tuple[torch.Tensor, ...], str]:
    shape = tuple(tensor.shape)
    if shape[0] == num_blocks:
        return (_byte_rows(tensor, num_blocks),), f"[blocks]{list(shape[1:])}"
    if shape[0] == 2 and len(shape) > 1 and shape[1] == num_blocks:
        return (_byte_rows(tensor[0], num_blocks), _byte_rows(tensor[1], num_blocks)), f"[2][blocks]{list(shape[2:])}"
    raise UnsupportedLayout(f"no block axis of size {num_blocks} in KV cache shape {shape}")


def paged_layout(kv_caches: dict[str, torch.Tensor], num_blocks: int) -> PagedLayout:
    """Views of `kv_caches` (vLLM's register_kv_caches argument), checked to be uniform."""
    if not kv_caches:
        raise UnsupportedLayout("the engine registered no KV cache tensors")
    names, parts, descriptions = [], [], set()
    dtypes = set()
    for name, tensor in kv_caches.items():
        layer, description = _layer_parts(tensor, num_blocks)
        names.append(name)
        parts.append(layer)
        descriptions.add(description)
        dtypes.add(tensor.dtype)
    widths = {sum(part.shape[1] for part in layer) for layer in parts}
    if len(descriptions) != 1 or len(widths) != 1 or len(dtypes) != 1:
        raise UnsupportedLayout(
            f"layers differ in layout ({sorted(descriptions)}), bytes per block ({sorted(widths)}) or dtype: "
            "kvd stores layers of one geometry only"
        )
    if all(part.shape[1] % 8 == 0 for layer in parts for part in layer):
        parts = [tuple(part.view(torch.int64) for part in layer) for layer in parts]
        word = torch.int64
    else:
        word = torch.uint8
    return PagedLayout(tuple(names), tuple(parts), widths.pop(), num_blocks, descriptions.pop(), word)


def cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int, cache_dtype: str) -> str:
    """The interior layout path vLLM's CPU attention picks for these parameters."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:
        return "unknown"
    return _get_attn_isa(dtype, block_size, head_dim, cache_dtype)


def backend_name(vllm_config: Any, layer_name: str) -> str:
    layer = vllm_config.compilation_config.static_forward_context.get(layer_name)
    backend = getattr(layer, "attn_backend", None)
    return backend.get_name() if backend is not None else "unknown"


# vLLM's quantized kv_cache_dtype values whose elements kvd knows, kept in uint8 tensors ("fp8" is e4m3).
FP8_CACHE_DTYPES = {"fp8": DType.FLOAT8_E4M3, "fp8_e4m3": DType.FLOAT8_E4M3, "fp8_e5m2": DType.FLOAT8_E5M2}


def element_type(dtype: torch.dtype, cache_dtype: str) -> DType:
    """The kvd element type of a KV cache vLLM allocated as `dtype` for its kv_cache_dtype `cache_dtype`:
    a 16- or 32-bit float cache holds its tensors' own type; a one-byte cache holds a float8 format only
    for the fp8 kinds above. Any other quantized cache (fp8 with scales per block, MLA's packed fp8, ...)
    is not a plain array of one element type, and is refused."""
    if dtype.itemsize == 1:
        if cache_dtype in FP8_CACHE_DTYPES:
            return FP8_CACHE_DTYPES[cache_dtype]
    elif dtype.is_floating_point:
        return dtype_of_torch(dtype)
    raise UnsupportedLayout(f"vLLM's kv_cache_dtype {cache_dtype!r} (tensors of {dtype}) is not a KV cache kvd "
                            f"stores: it takes the model's dtype or one of {', '.join(sorted(FP8_CACHE_DTYPES))}")


def namespace_spec(
    vllm_config: Any, layout: PagedLayout, dtype: torch.dtype, *, namespace: str, tp: tuple[int, int],
    pp: tuple[int, int],
) -> NamespaceSpec:
    """The kvd namespace of this worker's blocks: model, geometry and engine layout."""
    import vllm
    from vllm.platforms import current_platform

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    block_size = cache.block_size
    head_dim = model.get_head_size()
    kv_heads = model.get_num_kv_heads(vllm_config.parallel_config)
    device = current_platform.device_type
    engine = f"{backend_name(vllm_config, layout.names[0])}"
    if device == "cpu":
        engine += f"/{cpu_isa(dtype, block_size, head_dim, cache.cache_dtype)}"
    identity = "|".join((
        model.revision or "",
        f"vllm {vllm.__version__}",
        f"{device} {engine}",
        f"kv {layout.description}",
        f"cache_dtype {cache.cache_dtype}",
    ))
    # MLA keeps one latent per token (K and V are derived from it): one plane.
    order = KvOrder.LATENT if getattr(model, "use_mla", False) else KvOrder.K_THEN_V
    if order == KvOrder.LATENT and device == "cpu" and not cache.enable_prefix_caching:
        # vLLM's CPU MLA backend computes a prompt after a cached prefix
        # wrongly (measured: other tokens than vLLM alone), so vLLM turns
        # its own prefix caching off for it; a prefix from kvd is no better.
        raise UnsupportedLayout(
            "vLLM's CPU MLA backend cannot compute a prompt after a cached prefix (vLLM turned its own prefix "
            "caching off for this model), so a prefix loaded from kvd would give wrong answers")
    # Without decode context parallelism every TP rank caches the same latent: one namespace for
    # all of them (tp 0 of 1), written by rank 0 alone (kvd.connectors.vllm.connector).
    if order == KvOrder.LATENT and vllm_config.parallel_config.decode_context_parallel_size == 1:
        tp = (0, 1)
    spec = NamespaceSpec(
        model_id=namespace or model.model,
        kv_order=order,
        model_revision=identity,
        num_layers=len(layout.names),
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_tokens=block_size,
        kv_dtype=element_type(dtype, cache.cache_dtype),
        tp_rank=tp[0],
        tp_size=tp[1],
        pp_stage=pp[0],
        pp_size=pp[1],
    )
    if spec.layer_bytes != layout.layer_bytes:
        what = "the latent" if order == KvOrder.LATENT else "K and V"
        raise UnsupportedLayout(
            f"a layer of a block is {layout.layer_bytes} bytes, but {what} of {block_size} tokens x "
            f"{kv_heads} heads x {head_dim} would be {spec.layer_bytes}: not a plain paged KV cache"
        )
    return spec
