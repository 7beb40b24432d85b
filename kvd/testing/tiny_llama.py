"""A tiny Llama with seeded random weights, and a word-level tokenizer, made locally.

The engine tests and benchmarks cannot download a model. This one has the
shape of a real Llama (GQA, RoPE) but 4 layers of width 256, so a real
vLLM serves it on the CPU in a fraction of a second per 1,000 tokens:

    python -m kvd.testing.tiny_llama DIR      # writes DIR once (config, weights, tokenizer)

The tokenizer maps "w0".."w{vocab-5}" to ids 4.. (whitespace split), so a
prompt of n distinct words is n tokens: `prompt_words(ids)` writes one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LAYERS = 4
HIDDEN = 256
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 64
VOCAB = 4096
MAX_POSITIONS = 65536  # room for the long-context benchmark's 32K-token prefixes
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITIONS,
        bos_token_id=1, eos_token_id=2, pad_token_id=3, torch_dtype="float32", tie_word_embeddings=False,
    )


def write_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: index for index, token in enumerate(SPECIALS)}
    vocab.update({f"w{index}": index + len(SPECIALS) for index in range(VOCAB - len(SPECIALS))})
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(directory)
    # A chat template, so `vllm serve` answers chat requests too.
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    config_path.write_text(json.dumps(config, indent=1))


def build(directory: str | Path, seed: int = 0) -> Path:
    """Write the model into `directory` unless it is already there."""
    def make():
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(_config())
    return build_with(directory, make, seed)


def build_with(directory: str | Path, make, seed: int = 0) -> Path:
    """Write the model `make()` builds (seeded), with this tokenizer, into `directory` unless a model
    is already there: the tiny models of kvd.testing share it."""
    directory = Path(directory)
    if (directory / "model.safetensors").exists() and (directory / "tokenizer.json").exists():
        return directory
    import torch

    torch.manual_seed(seed)
    model = make()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return directory


def prompt_words(token_ids) -> str:
    """A prompt string that the tokenizer turns into exactly `token_ids` (ids >= 4)."""
    return " ".join(f"w{token - len(SPECIALS)}" for token in token_ids)


if __name__ == "__main__":
    print(build(sys.argv[1]))
