"""Prefix reuse across processes with a real transformers model and kvd.

Two separate runs share a long prompt prefix:

  store    prefill the prompt, cut its KV cache into full kvd blocks, PUT them
  restore  GET the blocks of the same prefix, rebuild the model's KV cache
           from them and run only the tokens after the stored blocks (the
           prompt's partial tail, if any, plus a new suffix)

The restore run also computes, in the same process, (1) a full recompute of
prompt+suffix, and (2) the model continuing from its *own* in-memory cache
of the same prefix, and reports the time to first token (wall time until
the first next-token logits exist) and the logit differences.

The model is a small Llama built from a LlamaConfig with seeded random
weights, so nothing is downloaded and both runs get identical weights.

    kvd serve --state-dir /tmp/kvd &   # or any running daemon
    python examples/hf_prefix_reuse.py --target unix:///tmp/kvd/kvd.sock --role store
    python examples/hf_prefix_reuse.py --target unix:///tmp/kvd/kvd.sock --role restore

With a disk tier configured, `--durable` makes the store run return only
once its blocks are on disk, so the daemon can be restarted (or killed)
between the two runs and the restore run reads the prefix from disk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvd.client import Client
from kvd.client.hf import blocks_to_cache, cache_to_blocks, spec_from_config
from kvd.core.keys import NamespaceSpec
from kvd.v1 import kvd_pb2

VOCAB = 1000
TIER_NAMES = {kvd_pb2.TIER_HOST: "host", kvd_pb2.TIER_DISK: "disk"}


def build_model(seed: int) -> LlamaForCausalLM:
    """The example model: 4 layers, hidden 256, 4 heads (GQA: 2 KV heads)."""
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        dtype=torch.float32,
        # eager attention is plain matmul + softmax: no kernel choice that
        # could depend on sequence length and blur the exactness comparison.
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def weights_digest(model: torch.nn.Module) -> str:
    """Digest of all parameters, so two processes can prove they built the same model."""
    hasher = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        hasher.update(name.encode())
        hasher.update(tensor.detach().contiguous().view(torch.uint8).numpy())
    return hasher.hexdigest()


def tensor_digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().view(torch.uint8).numpy()).hexdigest()


def make_tokens(seed: int, prompt_tokens: int, suffix_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared prompt and the restore run's new suffix, both from `seed`."""
    prompt = torch.randint(0, VOCAB, (prompt_tokens,), generator=torch.Generator().manual_seed(seed))
    suffix = torch.randint(0, VOCAB, (suffix_tokens,), generator=torch.Generator().manual_seed(seed + 1))
    return prompt, suffix


def make_spec(model: LlamaForCausalLM, seed: int, block_tokens: int, client: Client) -> NamespaceSpec:
    """The example's namespace. block_tokens 0: as many tokens as fill one of
    the daemon's host slots (a power of two, 16 at least), so a block wastes
    no host memory (64 KiB slots: 16 tokens; the default 2 MiB: 512)."""
    if block_tokens == 0:
        per_token = spec_from_config(model.config, 1, model_id="kvd-example-llama").block_bytes
        block_tokens = 16
        while block_tokens * 2 * per_token <= client.arena_info().slot_bytes:
            block_tokens *= 2
    # The seed is part of the identity: another seed is another model, and
    # its blocks must never be served for this one.
    return spec_from_config(model.config, block_tokens, model_id="kvd-example-llama", model_revision=f"seed-{seed}")


def forward(model: LlamaForCausalLM, tokens: torch.Tensor, cache: Any = None) -> Any:
    with torch.inference_mode():
        return model(input_ids=tokens.unsqueeze(0), past_key_values=cache, use_cache=True)


def warm_up(model: LlamaForCausalLM) -> None:
    # The first forward of a process pays for thread pools and allocator
    # growth; keep that out of the timed runs.
    forward(model, torch.arange(64) % VOCAB)


def run_store(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model(args.seed)
    prompt, _ = make_tokens(args.seed, args.prompt_tokens, args.suffix_tokens)
    warm_up(model)

    with Client(args.target, use_shared_memory=args.shared_memory) as client:
        spec = make_spec(model, args.seed, args.block_tokens, client)
        start = time.perf_counter()
        cache = forward(model, prompt).past_key_values
        prefill_s = time.perf_counter() - start
        blocks = cache_to_blocks(cache, spec)
        ns = client.register_namespace(spec)
        keys = ns.keys(prompt.tolist())
        start = time.perf_counter()
        # durable: returns only once the blocks are on kvd's disk tier.
        written = client.put(ns, keys, blocks, durable=args.durable)
        put_s = time.perf_counter() - start
        shared_memory = client.uses_shared_memory

    result = {
        "role": "store",
        "shared_memory": shared_memory,
        "weights_digest": weights_digest(model),
        "blocks": int(blocks.shape[0]),
        "blocks_written": int(written),
        "durable": args.durable,
        "block_bytes": spec.block_bytes,
        "blocks_digest": tensor_digest(blocks),
        "prefill_s": prefill_s,
        "put_s": put_s,
    }
    print(
        f"store: prefilled {args.prompt_tokens} tokens in {prefill_s * 1e3:.1f} ms, "
        f"put {written}/{blocks.shape[0]} blocks ({blocks.numel() * blocks.element_size() / 2**20:.1f} MiB) "
        f"in {put_s * 1e3:.1f} ms"
    )
    return result


def run_restore(args: argparse.Namespace) -> dict[str, Any]:
    model = build_model(args.seed)
    prompt, suffix = make_tokens(args.seed, args.prompt_tokens, args.suffix_tokens)
    request = torch.cat([prompt, suffix])
    warm_up(model)

    with Client(args.target, use_shared_memory=args.shared_memory) as client:
        spec = make_spec(model, args.seed, args.block_tokens, client)
        ns = client.register_namespace(spec)
        # Where the prefix is before the first Get (host memory, or disk
        # after a daemon restart); outside the timed runs.
        lookup = client.lookup(ns, ns.keys(request.tolist()))
        restore_times, full_times = [], []
        for _ in range(args.repeats):
            # Restored TTFT: everything a serving engine would do for this
            # request: chain keys, fetch the matching prefix, rebuild the
            # cache, run the remaining tokens.
            start = time.perf_counter()
            keys = ns.keys(request.tolist())
            fetched = client.get_tensor(ns, keys)
            get_done = time.perf_counter()
            matched_tokens = fetched.shape[0] * spec.block_tokens
            restored_logits = forward(model, request[matched_tokens:], blocks_to_cache(fetched, spec)).logits[0]
            restore_times.append(time.perf_counter() - start)
            get_s = get_done - start

            # Full recompute TTFT: the same request with nothing cached.
            start = time.perf_counter()
            full_logits = forward(model, request).logits[0]
            full_times.append(time.perf_counter() - start)
        shared_memory = client.uses_shared_memory

    own_blocks, own_logits = own_cache_run(model, prompt, request, spec, fetched.shape[0], matched_tokens)

    # Logits of the positions both runs computed: matched_tokens onward.
    full_tail = full_logits[matched_tokens:]
    n_suffix = suffix.shape[0]
    result = {
        "role": "restore",
        "shared_memory": shared_memory,
        "weights_digest": weights_digest(model),
        "requested_blocks": len(keys),
        "lookup_matched": lookup.matched,
        "lookup_tiers": [TIER_NAMES.get(tier, str(tier)) for tier in lookup.tiers],
        "restored_blocks": int(fetched.shape[0]),
        "restored_tokens": matched_tokens,
        "fetched_digest": tensor_digest(fetched),
        "fetched_bytes": fetched.numel() * fetched.element_size(),
        "own_blocks_digest": tensor_digest(own_blocks),
        "restored_equals_own_cache": bool(torch.equal(restored_logits, own_logits)),
        "max_abs_diff_vs_own_cache": float((restored_logits - own_logits).abs().max()),
        "max_abs_diff_vs_full": float((restored_logits - full_tail).abs().max()),
        "suffix_max_abs_diff_vs_full": float((restored_logits[-n_suffix:] - full_tail[-n_suffix:]).abs().max()),
        "get_s": get_s,
        "ttft_restore_s": min(restore_times),
        "ttft_full_s": min(full_times),
        "ttft_restore_all_s": restore_times,
        "ttft_full_all_s": full_times,
    }
    if args.save_logits:
        torch.save({"restored": restored_logits, "own_cache": own_logits, "full": full_tail}, args.save_logits)
    print_restore(result, request.shape[0], args.repeats)
    return result


def own_cache_run(model, prompt, request, spec, blocks: int, matched_tokens: int):
    """This process's own cache of the same prefix: (its blocks, the logits of the rest of `request` on it).

    It is built exactly as the store run built its cache (prefill of the
    whole prompt) and then cut to the tokens that came back from kvd, so any
    difference from the restored run can only come from the store round trip.
    """
    if matched_tokens > prompt.shape[0]:
        raise SystemExit(f"kvd returned {matched_tokens} tokens, more than this prompt; another run stored them?")
    own_cache = forward(model, prompt).past_key_values
    own_blocks = cache_to_blocks(own_cache, spec, blocks)
    own_cache.crop(matched_tokens - prompt.shape[0])
    return own_blocks, forward(model, request[matched_tokens:], own_cache).logits[0]


def print_restore(result: dict[str, Any], request_tokens: int, repeats: int) -> None:
    matched_tokens = result["restored_tokens"]
    path = "shared memory" if result["shared_memory"] else "inline gRPC"
    print(
        f"restore: {result['restored_blocks']}/{result['requested_blocks']} blocks ({matched_tokens} tokens) "
        f"fetched in {result['get_s'] * 1e3:.1f} ms, then ran {request_tokens - matched_tokens} tokens ({path})"
    )
    print(
        f"TTFT restored {result['ttft_restore_s'] * 1e3:.1f} ms vs full recompute of {request_tokens} tokens "
        f"{result['ttft_full_s'] * 1e3:.1f} ms ({result['ttft_full_s'] / result['ttft_restore_s']:.1f}x, "
        f"best of {repeats})"
    )
    print(
        f"max |logits diff|: vs own in-memory cache {result['max_abs_diff_vs_own_cache']:.3g} "
        f"(bit-exact: {result['restored_equals_own_cache']}), vs full recompute {result['max_abs_diff_vs_full']:.3g}"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help='kvd address: "unix:///path/kvd.sock" or "host:port"')
    parser.add_argument("--role", choices=("store", "restore", "both"), default="both")
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--block-tokens", type=int, default=0,
                        help="tokens per block; 0 (default): as many as fill one of the daemon's host slots")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed restore/recompute rounds; the best is reported (the first pays for first "
                             "touches of memory and caches)")
    parser.add_argument(
        "--shared-memory",
        choices=("auto", "on", "off"),
        default="auto",
        help="off forces block bytes inline over gRPC",
    )
    parser.add_argument(
        "--durable", action="store_true", help="store: put with durable=True (needs a daemon with a disk tier)"
    )
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch default)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    parser.add_argument("--save-logits", type=Path, help="restore: save the compared logits here (torch.save)")
    args = parser.parse_args(argv)
    args.shared_memory = {"auto": None, "on": True, "off": False}[args.shared_memory]
    if args.suffix_tokens < 1 or args.prompt_tokens < args.block_tokens or args.repeats < 1 or args.block_tokens < 0:
        parser.error("need --suffix-tokens >= 1, --prompt-tokens >= --block-tokens >= 0, --repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {}
    if args.role in ("store", "both"):
        results["store"] = run_store(args)
    if args.role in ("restore", "both"):
        results["restore"] = run_restore(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
