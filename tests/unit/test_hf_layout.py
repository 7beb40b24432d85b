"""HF cache <-> kvd block conversion, without a daemon.

The model is a tiny Llama with seeded random weights (no download).  Its
real DynamicCache is converted to blocks and back; the rebuilt cache must
hold exactly the same bits as the original's full-block prefix, and a model
continuing from it must produce exactly the logits it produces continuing
from its own (cropped) cache.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvd.client.hf import blocks_to_cache, cache_layers, cache_to_blocks, spec_from_config
from kvd.core.keys import DType, InnerLayout, KvOrder
from kvd.errors import InvalidArgument

BLOCK_TOKENS = 16


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config).eval()


def _prefill(model: LlamaForCausalLM, tokens: torch.Tensor) -> DynamicCache:
    with torch.inference_mode():
        out = model(input_ids=tokens.unsqueeze(0), use_cache=True)
    return out.past_key_values


def _tokens(n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (n,), generator=gen)


def test_spec_from_config_reads_geometry(model: LlamaForCausalLM) -> None:
    spec = spec_from_config(model.config, BLOCK_TOKENS, model_id="tiny")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (3, 2, 16)
    assert spec.kv_dtype == DType.FLOAT32
    assert spec.inner_layout == InnerLayout.HEAD_TOKEN_DIM
    assert spec.block_shape == (3, 2, 2, BLOCK_TOKENS, 16)
    # An explicit head_dim in the config wins over hidden_size // heads.
    odd = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, head_dim=32, num_hidden_layers=1)
    assert spec_from_config(odd, 8, model_id="x", dtype=torch.bfloat16).head_dim == 32
    assert spec_from_config(odd, 8, model_id="x", dtype="bfloat16").kv_dtype == DType.BFLOAT16


@pytest.mark.parametrize("prompt_len", [4 * BLOCK_TOKENS, 4 * BLOCK_TOKENS + 7])
@pytest.mark.parametrize("layout", [InnerLayout.HEAD_TOKEN_DIM, InnerLayout.TOKEN_HEAD_DIM])
def test_round_trip_is_bit_exact(model: LlamaForCausalLM, prompt_len: int, layout: InnerLayout) -> None:
    spec = spec_from_config(model.config, BLOCK_TOKENS, model_id="tiny", inner_layout=layout)
    cache = _prefill(model, _tokens(prompt_len, seed=prompt_len))
    full = prompt_len // BLOCK_TOKENS * BLOCK_TOKENS

    blocks = cache_to_blocks(cache, spec)
    assert blocks.shape == (prompt_len // BLOCK_TOKENS, *spec.block_shape)
    assert blocks.is_contiguous() and blocks.dtype == torch.float32

    # Spot-check the documented layout element by element, independent of
    # the vectorised conversion: block b, layer l, K/V s, token t, head h.
    originals = cache_layers(cache)
    for b, l, s, h, t in [(0, 0, 0, 0, 0), (1, 2, 1, 1, 5), (3, 1, 0, 1, BLOCK_TOKENS - 1)]:
        expected = originals[l][s][0, h, b * BLOCK_TOKENS + t]
        if layout == InnerLayout.HEAD_TOKEN_DIM:
            got = blocks[b, l, s, h, t]
        else:
            got = blocks[b, l, s, t, h]
        assert torch.equal(got, expected)

    rebuilt = blocks_to_cache(blocks, spec, config=model.config)
    assert rebuilt.get_seq_length() == full
    for (k0, v0), (k1, v1) in zip(originals, cache_layers(rebuilt), strict=True):
        assert k1.shape == (1, spec.num_kv_heads, full, spec.head_dim)
        assert torch.equal(k1, k0[:, :, :full])
        assert torch.equal(v1, v0[:, :, :full])
        # The cache must own its memory: the client may reuse the block buffer.
        assert k1.data_ptr() != blocks.data_ptr()

    # Converting the rebuilt cache again reproduces the same bytes.
    assert torch.equal(cache_to_blocks(rebuilt, spec), blocks)


@pytest.mark.parametrize("prompt_len", [4 * BLOCK_TOKENS, 4 * BLOCK_TOKENS + 7])
def test_model_continues_identically_from_rebuilt_cache(model: LlamaForCausalLM, prompt_len: int) -> None:
    spec = spec_from_config(model.config, BLOCK_TOKENS, model_id="tiny")
    prompt = _tokens(prompt_len, seed=7)
    suffix = _tokens(9, seed=8)
    full = prompt_len // BLOCK_TOKENS * BLOCK_TOKENS
    # Everything after the stored full blocks must be run again.
    rest = torch.cat([prompt[full:], suffix]).unsqueeze(0)

    cache = _prefill(model, prompt)
    blocks = cache_to_blocks(cache, spec)
    # The in-memory reference keeps exactly the stored tokens (transformers
    # 5.x crop takes a negative count of tokens to drop).
    cache.crop(full - prompt_len)
    with torch.inference_mode():
        reference = model(input_ids=rest, past_key_values=cache, use_cache=True).logits
        restored = model(input_ids=rest, past_key_values=blocks_to_cache(blocks, spec), use_cache=True).logits
    assert torch.equal(restored, reference)


def test_partial_selection_and_v_then_k(model: LlamaForCausalLM) -> None:
    spec = spec_from_config(model.config, BLOCK_TOKENS, model_id="tiny", kv_order=KvOrder.V_THEN_K)
    cache = _prefill(model, _tokens(3 * BLOCK_TOKENS, seed=3))
    blocks = cache_to_blocks(cache, spec, n_blocks=2)
    keys, values = cache_layers(cache)[1]
    assert torch.equal(blocks[1, 1, 0, :, 3], values[0, :, BLOCK_TOKENS + 3])
    assert torch.equal(blocks[1, 1, 1, :, 3], keys[0, :, BLOCK_TOKENS + 3])
    rebuilt = cache_layers(blocks_to_cache(blocks, spec))
    assert torch.equal(rebuilt[1][0], keys[:, :, : 2 * BLOCK_TOKENS])
    assert torch.equal(rebuilt[1][1], values[:, :, : 2 * BLOCK_TOKENS])


def test_mismatches_are_rejected(model: LlamaForCausalLM) -> None:
    spec = spec_from_config(model.config, BLOCK_TOKENS, model_id="tiny")
    cache = _prefill(model, _tokens(2 * BLOCK_TOKENS, seed=5))
    with pytest.raises(InvalidArgument, match="full blocks"):
        cache_to_blocks(cache, spec, n_blocks=3)
    with pytest.raises(InvalidArgument, match="dtype"):
        cache_to_blocks(cache, spec_from_config(model.config, BLOCK_TOKENS, model_id="tiny", dtype=torch.float16))
    with pytest.raises(InvalidArgument, match="head_dim"):
        cache_to_blocks(cache, dataclasses.replace(spec, num_kv_heads=4))
    blocks = cache_to_blocks(cache, spec)
    with pytest.raises(InvalidArgument, match="shape"):
        blocks_to_cache(blocks[:, :2], spec)
    with pytest.raises(InvalidArgument, match="dtype"):
        blocks_to_cache(blocks.to(torch.float16), spec)
    # An MLA namespace holds one latent per token: no K and V for a Hugging Face cache.
    latent = dataclasses.replace(spec, num_kv_heads=1, kv_order=KvOrder.LATENT)
    with pytest.raises(InvalidArgument, match="one latent per token"):
        cache_to_blocks(cache, latent)
    with pytest.raises(InvalidArgument, match="one latent per token"):
        blocks_to_cache(torch.zeros((1, *latent.block_shape), dtype=blocks.dtype), latent)
