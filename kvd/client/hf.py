"""Bridges between Hugging Face transformers KV caches and kvd blocks.

transformers keeps one (keys, values) pair per decoder layer, each of shape
[batch, kv_heads, seq, head_dim].  A kvd block is [layers, 2, *inner] for
`block_tokens` consecutive tokens.  With InnerLayout.HEAD_TOKEN_DIM the inner
shape is [kv_heads, block_tokens, head_dim], so splitting the seq axis of a
layer into (n_blocks, block_tokens) and moving n_blocks to the front is one
view plus one strided copy per layer; no per-block Python work is needed.

Only clients that talk to transformers import this module, so importing
torch at the top is fine (the daemon never loads it).
"""

from __future__ import annotations

from typing import Any

import torch

from kvd.client.tensors import dtype_of_torch, torch_dtype
from kvd.core.keys import InnerLayout, KvOrder, NamespaceSpec
from kvd.errors import InvalidArgument

__all__ = [
    "blocks_to_cache",
    "cache_layers",
    "cache_to_blocks",
    "kvd_dtype",
    "spec_from_config",
    "torch_dtype",
]

# One dtype table for every client module.
kvd_dtype = dtype_of_torch


def spec_from_config(
    config: Any,
    block_tokens: int,
    *,
    model_id: str,
    model_revision: str = "",
    dtype: torch.dtype | str | None = None,
    inner_layout: InnerLayout = InnerLayout.HEAD_TOKEN_DIM,
    **extra: Any,
) -> NamespaceSpec:
    """NamespaceSpec describing the KV cache of a transformers model.

    `dtype` is the dtype the cache tensors will actually have; it defaults to
    config.dtype (float32 when the config does not say), which is right for a
    model built from its config without a later .to(dtype).  `model_id` is
    required rather than guessed: two checkpoints of one architecture share a
    config shape but must never share cached blocks.  `extra` goes to
    NamespaceSpec unchanged (lora_id, tenant_salt, tp_rank, ...).
    """
    # Multimodal wrappers keep the decoder's geometry in a sub-config.
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if dtype is None:
        dtype = getattr(config, "dtype", None) or torch.float32
    return NamespaceSpec(
        model_id=model_id,
        model_revision=model_revision,
        num_layers=config.num_hidden_layers,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        block_tokens=block_tokens,
        kv_dtype=kvd_dtype(dtype),
        inner_layout=inner_layout,
        **extra,
    )


def cache_layers(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer of a transformers cache.

    Accepts a transformers 5.x Cache (which keeps `.layers[i].keys/.values`)
    or the legacy tuple-of-pairs format, so callers need not care which one
    a model handed back.
    """
    layers = getattr(cache, "layers", None)
    if layers is not None:
        return [(layer.keys, layer.values) for layer in layers]
    return [(pair[0], pair[1]) for pair in cache]


def _kv_slots(spec: NamespaceSpec) -> tuple[int, int]:
    """Indices of K and V on the block's "2" axis."""
    if spec.kv_order == KvOrder.LATENT:
        raise InvalidArgument("a Hugging Face cache holds K and V; this namespace stores one latent per token (MLA)")
    return (0, 1) if spec.kv_order == KvOrder.K_THEN_V else (1, 0)


def cache_to_blocks(
    cache: Any,
    spec: NamespaceSpec,
    n_blocks: int | None = None,
    *,
    batch_index: int = 0,
) -> torch.Tensor:
    """Copy the first n_blocks*block_tokens tokens of a cache into kvd blocks.

    Returns a new contiguous tensor of shape (n_blocks, *spec.block_shape) on
    the cache's device, ready for Client.put.  `n_blocks` defaults to every
    full block in the cache; a trailing partial block is never included
    because its key would change once the block fills up.  One sequence of a
    batched cache is taken (`batch_index`).
    """
    layers = cache_layers(cache)
    if len(layers) != spec.num_layers:
        raise InvalidArgument(f"cache has {len(layers)} layers, spec says {spec.num_layers}")
    first_keys = layers[0][0]
    if first_keys is None:
        raise InvalidArgument("cache is empty")
    seq_len = first_keys.shape[-2]
    t = spec.block_tokens
    available = seq_len // t
    if n_blocks is None:
        n_blocks = available
    if not 0 <= n_blocks <= available:
        raise InvalidArgument(f"asked for {n_blocks} blocks but the cache holds {available} full blocks")
    want = (spec.num_kv_heads, spec.head_dim)
    dtype = torch_dtype(spec.kv_dtype)
    out = torch.empty((n_blocks, *spec.block_shape), dtype=dtype, device=first_keys.device)
    k_slot, v_slot = _kv_slots(spec)
    for layer_index, (keys, values) in enumerate(layers):
        for slot, tensor in ((k_slot, keys), (v_slot, values)):
            if tensor.dtype != dtype:
                # A silent cast would store blocks whose bytes no longer match
                # what the model computed, so reject instead.
                raise InvalidArgument(f"layer {layer_index} cache dtype {tensor.dtype} != spec dtype {dtype}")
            if (tensor.shape[1], tensor.shape[3]) != want:
                raise InvalidArgument(
                    f"layer {layer_index} cache has [heads, head_dim] = {list(tensor.shape[1::2])}, spec says {list(want)}"
                )
            # [H, S, D] -> [H, n, T, D]: a view, no copy yet.
            split = tensor[batch_index, :, : n_blocks * t, :].unflatten(1, (n_blocks, t))
            if spec.inner_layout == InnerLayout.HEAD_TOKEN_DIM:
                blocks = split.permute(1, 0, 2, 3)  # [n, H, T, D]
            else:
                blocks = split.permute(1, 2, 0, 3)  # [n, T, H, D]
            out[:, layer_index, slot].copy_(blocks)
    return out


def blocks_to_cache(
    blocks: torch.Tensor,
    spec: NamespaceSpec,
    *,
    config: Any = None,
    device: torch.device | str | None = None,
) -> Any:
    """Build a transformers DynamicCache holding the tokens of `blocks`.

    `blocks` has shape (n_blocks, *spec.block_shape), as returned by
    Client.get_tensor.  The cache covers n_blocks*block_tokens tokens with
    batch size 1, so a model can continue from it by feeding only the tokens
    that follow.  Passing the model `config` lets transformers pick the right
    layer type per layer (e.g. sliding-window layers); without it every layer
    is a plain DynamicLayer, which is what full-attention models use.
    """
    from transformers import DynamicCache

    if tuple(blocks.shape[1:]) != spec.block_shape:
        raise InvalidArgument(f"blocks have shape {tuple(blocks.shape)}, spec block shape is {spec.block_shape}")
    if blocks.dtype != torch_dtype(spec.kv_dtype):
        raise InvalidArgument(f"blocks dtype {blocks.dtype} != spec dtype {torch_dtype(spec.kv_dtype)}")
    if device is not None:
        blocks = blocks.to(device)
    n_blocks = blocks.shape[0]
    seq = n_blocks * spec.block_tokens
    k_slot, v_slot = _kv_slots(spec)
    pairs = []
    for layer_index in range(spec.num_layers):
        pair = []
        for slot in (k_slot, v_slot):
            part = blocks[:, layer_index, slot]
            if spec.inner_layout == InnerLayout.HEAD_TOKEN_DIM:
                heads_first = part.permute(1, 0, 2, 3)  # [n, H, T, D] -> [H, n, T, D]
            else:
                heads_first = part.permute(2, 0, 1, 3)  # [n, T, H, D] -> [H, n, T, D]
            # DynamicLayer.update concatenates onto an empty tensor, which
            # copies, so the cache never aliases the caller's block tensor.
            pair.append(heads_first.reshape(spec.num_kv_heads, seq, spec.head_dim).unsqueeze(0))
        pairs.append(tuple(pair))
    return DynamicCache(pairs, config=config)
