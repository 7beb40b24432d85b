"""Step d of the device check: a Hugging Face Llama on the GPU, its prompt's KV restored from kvd.

A LlamaForCausalLM from a LlamaConfig with seeded random weights (nothing is downloaded): on a GPU a
Llama-3-8B-like shape (hidden 4096, 32 heads, 8 KV heads, head_dim 128, MLP 14336, vocab 128256) cut
to `--layers` layers, bf16, SDPA attention; without a GPU a tiny shape on the CPU (the same code
path, small enough for two cores). For each prompt length:

* store: prefill the prompt, cut its KV cache into kvd blocks (kvd.client.hf), a durable Put
  (host memory and the disk tier);
* restore from host memory: Get, rebuild the DynamicCache on the model's device, run the suffix;
  TTFT is all of that, against a full recompute of prompt + suffix (best of `--repeats`);
* the logits of the restored run must equal, bit for bit, those of the same model continuing from
  its own in-memory cache of the same prefix (a run without kvd), and are compared with the
  recompute's (a different kernel order: a small difference is expected, reported).

Then the daemon is restarted on the same state (host memory empty, blocks on disk) and every prompt
is restored again, from the disk tier, with the same checks. examples/hf_prefix_reuse.py is the CPU
version of this; its prompt generator is reused.

    python -m tools.device_check.hf_restore --device cuda --tokens 8192,32768 --dir /tmp/x --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))

from hf_prefix_reuse import make_tokens  # noqa: E402

from kvd.client import Client  # noqa: E402
from kvd.client.hf import blocks_to_cache, cache_to_blocks, spec_from_config  # noqa: E402
from kvd.v1 import kvd_pb2  # noqa: E402

SUFFIX_TOKENS = 32
GPU_SHAPE = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "block_tokens": 64}
CPU_SHAPE = {"hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 32000, "block_tokens": 256}
TIERS = {kvd_pb2.TIER_HOST: "host", kvd_pb2.TIER_DISK: "disk"}


def build_model(device: str, layers: int, max_tokens: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(GPU_SHAPE if device == "cuda" else CPU_SHAPE)
    shape.pop("block_tokens")
    config = LlamaConfig(num_hidden_layers=layers, max_position_embeddings=max_tokens + 2 * SUFFIX_TOKENS,
                         dtype=torch.bfloat16, attn_implementation="sdpa" if device == "cuda" else "eager", **shape)
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    return model


def forward(model, tokens: torch.Tensor, cache=None, keep: int = 1):
    """Logits of the last `keep` positions (a 32k prompt's full logits would be 8 GiB) and the cache."""
    with torch.inference_mode():
        out = model(input_ids=tokens.unsqueeze(0).to(model.device), past_key_values=cache, use_cache=True,
                    logits_to_keep=keep)
    return out.logits[0], out.past_key_values


def synchronized(model) -> None:
    if model.device.type == "cuda":
        torch.cuda.synchronize()


class Prompt:
    """One prompt length: its tokens, keys, and the reference logits of a run without kvd."""

    def __init__(self, model, spec, namespace, tokens: int, seed: int) -> None:
        self.prompt, suffix = make_tokens(seed, tokens, SUFFIX_TOKENS)
        self.request = torch.cat([self.prompt, suffix])
        self.keys = namespace.keys(self.request.tolist())
        self.blocks_stored = tokens // spec.block_tokens
        self.matched = self.blocks_stored * spec.block_tokens
        self.keep = self.request.shape[0] - self.matched
        self.tokens = tokens

    def store(self, model, spec, client, namespace) -> dict:
        _, cache = forward(model, self.prompt)
        blocks = cache_to_blocks(cache, spec).cpu()
        started = time.perf_counter()
        written = client.put(namespace, self.keys[:self.blocks_stored], blocks, durable=True)
        put_s = time.perf_counter() - started
        # The run without kvd: the same prefix from the model's own cache, then the rest.
        if self.matched < self.tokens:  # (negative: tokens to drop, in every transformers version)
            cache.crop(self.matched - self.tokens)
        self.own_logits, _ = forward(model, self.request[self.matched:], cache, keep=self.keep)
        return {"blocks": int(blocks.shape[0]), "written": int(written), "bytes": blocks.numel() * 2, "put_s": put_s}

    def restore(self, model, spec, client, namespace) -> tuple[float, torch.Tensor, int]:
        """TTFT of one restored run: keys, Get, cache on the device, the rest of the request."""
        started = time.perf_counter()
        keys = namespace.keys(self.request.tolist())
        fetched = client.get_tensor(namespace, keys)
        cache = blocks_to_cache(fetched, spec, device=model.device)
        logits, _ = forward(model, self.request[fetched.shape[0] * spec.block_tokens:], cache, keep=self.keep)
        synchronized(model)
        return time.perf_counter() - started, logits, int(fetched.shape[0])

    def recompute(self, model) -> tuple[float, torch.Tensor]:
        started = time.perf_counter()
        logits, _ = forward(model, self.request, keep=self.keep)
        synchronized(model)
        return time.perf_counter() - started, logits


def measure(prompt: Prompt, model, spec, client, namespace, repeats: int, with_recompute: bool) -> dict:
    tiers = [TIERS.get(t, str(t)) for t in client.lookup(namespace, prompt.keys).tiers]
    restores = [prompt.restore(model, spec, client, namespace) for _ in range(repeats)]
    ttft_s, logits, blocks = min(restores, key=lambda run: run[0])
    row = {"tokens": prompt.tokens, "tiers_before": sorted(set(tiers)), "restored_blocks": blocks,
           "ttft_restore_s": ttft_s, "ttft_restore_all_s": [run[0] for run in restores],
           "logits_equal_without_kvd": bool(torch.equal(logits, prompt.own_logits)),
           "max_abs_diff_without_kvd": float((logits.float() - prompt.own_logits.float()).abs().max())}
    if with_recompute:
        runs = [prompt.recompute(model) for _ in range(repeats)]
        full_s, full_logits = min(runs, key=lambda run: run[0])
        row |= {"ttft_recompute_s": full_s, "speedup": full_s / ttft_s,
                "max_abs_diff_vs_recompute": float((logits.float() - full_logits.float()).abs().max())}
    return row


def daemon_config(directory: Path, spec, prompts_tokens: int) -> dict:
    """Host memory and one disk directory big enough for every prompt's blocks."""
    need = -(-prompts_tokens // spec.block_tokens) * spec.block_bytes
    capacity = max(2 * need, 256 << 20)
    return {"host": {"capacity_bytes": capacity, "slot_bytes": spec.block_bytes},
            "disk": {"directories": [str(directory / "disk")], "capacity_bytes": capacity,
                     "slot_bytes": spec.block_bytes, "min_slot_bytes": spec.block_bytes,
                     "segment_bytes": capacity}}


def run(args: argparse.Namespace) -> dict:
    from kvd.testing.daemon import start_daemon

    model = build_model(args.device, args.layers, max(args.tokens))
    block_tokens = (GPU_SHAPE if args.device == "cuda" else CPU_SHAPE)["block_tokens"]
    spec = spec_from_config(model.config, block_tokens, model_id="device-check-llama", dtype=torch.bfloat16)
    forward(model, torch.arange(256) % 1000)  # warm-up: kernels, allocator
    config = daemon_config(args.dir, spec, sum(args.tokens))
    result = {"device": args.device, "layers": args.layers, "shape": GPU_SHAPE if args.device == "cuda" else CPU_SHAPE,
              "block_tokens": block_tokens, "block_bytes": spec.block_bytes, "host": [], "disk": [], "stored": []}
    daemon = start_daemon(args.dir, config)
    try:
        with Client(daemon.unix_target) as client:
            namespace = client.register_namespace(spec)
            prompts = [Prompt(model, spec, namespace, tokens, seed=index) for index, tokens in enumerate(args.tokens)]
            for prompt in prompts:
                result["stored"].append(prompt.store(model, spec, client, namespace))
                result["host"].append(measure(prompt, model, spec, client, namespace, args.repeats, True))
        daemon.stop()
        daemon = start_daemon(args.dir, config)  # same state: host memory empty, the blocks on disk
        with Client(daemon.unix_target) as client:
            namespace = client.register_namespace(spec)
            for prompt in prompts:
                result["disk"].append(measure(prompt, model, spec, client, namespace, 1, False))
    finally:
        daemon.stop()
    result["ok"] = _verdict(result)
    return result


def _verdict(result: dict) -> bool:
    rows = result["host"] + result["disk"]
    stored = all(row["written"] == row["blocks"] for row in result["stored"])
    from_disk = all(row["tiers_before"] == ["disk"] for row in result["disk"])
    return stored and from_disk and all(row["logits_equal_without_kvd"] for row in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=lambda text: [int(x) for x in text.split(",")], default=[8192, 32768])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dir", type=Path, required=True, help="the daemon's directory (its disk tier too)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = run(args)
    for tier in ("host", "disk"):
        for row in result[tier]:
            extra = (f", recompute {row['ttft_recompute_s'] * 1e3:.1f} ms ({row['speedup']:.1f}x)"
                     if "ttft_recompute_s" in row else "")
            print(f"{tier}: {row['tokens']} tokens: TTFT restored {row['ttft_restore_s'] * 1e3:.1f} ms{extra}; "
                  f"logits equal without kvd: {row['logits_equal_without_kvd']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
