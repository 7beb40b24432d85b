"""A tiny Gemma-3 (interleaved sliding-window and full attention) with seeded random weights.

The hybrid-attention engine tests cannot download a model either. This one
has Gemma-3's structure: local layers that attend to the last `WINDOW`
tokens only, a global layer after every `PATTERN - 1` local ones, and
different RoPE bases for the two kinds; its geometry (KV heads, head size)
is the tiny Llama's, so the same prompts and block size serve both, and its
tokenizer is the tiny Llama's word-level one:

    python -m kvd.testing.tiny_gemma3 DIR      # writes DIR once (config, weights, tokenizer)

`WINDOW` is two 128-token blocks, so a prefix of a few blocks already
reaches past the local layers' window.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvd.testing import tiny_llama

LAYERS = 4
PATTERN = 4  # layers 0-2 local (sliding window), layer 3 global
WINDOW = 256


def layer_types() -> list[str]:
    return ["full_attention" if (index + 1) % PATTERN == 0 else "sliding_attention" for index in range(LAYERS)]


def _config():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=tiny_llama.VOCAB, hidden_size=tiny_llama.HIDDEN, intermediate_size=4 * tiny_llama.HIDDEN,
        num_hidden_layers=LAYERS, num_attention_heads=tiny_llama.HEADS, num_key_value_heads=tiny_llama.KV_HEADS,
        head_dim=tiny_llama.HEAD_DIM, query_pre_attn_scalar=tiny_llama.HEAD_DIM, sliding_window=WINDOW,
        layer_types=layer_types(), max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, pad_token_id=3,
        torch_dtype="float32", tie_word_embeddings=True,
    )


def build(directory: str | Path, seed: int = 0) -> Path:
    """Write the model into `directory` unless it is already there."""
    def make():
        from transformers import Gemma3ForCausalLM

        return Gemma3ForCausalLM(_config())
    return tiny_llama.build_with(directory, make, seed)


if __name__ == "__main__":
    print(build(sys.argv[1]))
