#!/usr/bin/env python3
"""Remote fetch between two daemons on this machine: NIXL and gRPC against a local host hit.

Per transport, a real etcd and two daemons (a holder and a fetcher, cluster
on loopback). Each round the holder stores a fresh chain of --mib MiB
(2 MiB blocks: 32 layers x 16 tokens x 8 heads x 128 dims, fp16), the
fetcher's client Gets it (the fetcher finds the holder through the
directory, reserves slots, moves and verifies the bytes, seals them, then
serves the Get), and Gets it again (a local host hit: the baseline). Rounds
of the transports interleave, so machine noise hits each alike. Printed:
GiB/s of the fetching Get and of the local Get, their ratio, NIXL over
gRPC, and, from the fetcher's kvd_cluster_fetch_* metrics, the rate of the
NIXL READ inside the same fetch between the same two processes (the raw
READ of those bytes) and where the rest of the fetch's time goes (pin,
read, release, verify, seal). Results in bench/results/bench_cluster_fetch.json.

Run:  .venv/bin/python bench/bench_cluster_fetch.py [--mib 256] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import fmt_ratio, progress, ratio, report, warn_if_busy, write_result  # noqa: E402

from kvd.client import Client  # noqa: E402
from kvd.core.keys import DType, NamespaceSpec  # noqa: E402
from kvd.testing.daemon import start_daemon  # noqa: E402
from kvd.testing.etcd import EtcdServer  # noqa: E402

SPEC = NamespaceSpec(model_id="bench-fetch", num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16,
                     kv_dtype=DType.FLOAT16)
TRANSPORTS = ("nixl", "grpc")


def cluster(directory: Path, etcd: EtcdServer, transport: str, mib: int) -> tuple:
    secret = directory / "secret"
    secret.write_text("bench-cluster-secret-0123456789\n")
    daemons = []
    for name in ("holder", "fetcher"):
        config = {
            "host": {"capacity_bytes": max(4 * mib, 256) << 20, "slot_bytes": 2 << 20},
            "server": {"max_message_bytes": 64 << 20},
            "cluster": {"etcd_endpoints": [etcd.endpoint], "node_name": name, "secret_file": str(secret),
                        "key_prefix": f"/bench-{transport}/", "transport": transport, "fetch_timeout_s": 30.0},
        }
        daemons.append(start_daemon(directory / f"{transport}-{name}", config))
    return tuple(daemons)


def wait_members(daemon, count: int) -> None:
    deadline = time.monotonic() + 30
    while daemon.metric("kvd_cluster_members") != count:
        if time.monotonic() > deadline:
            raise SystemExit("the cluster did not form")
        time.sleep(0.05)


def fetch_stages(daemon, transport: str) -> dict[str, float]:
    """The fetcher's stage seconds for `transport` (kvd_cluster_fetch_seconds_total) and the bytes it moved."""
    label = f'transport="{transport}"'
    stages = {line.split('stage="')[1].split('"')[0]: value
              for line, value in daemon.metric_samples("kvd_cluster_fetch_seconds_total").items() if label in line}
    moved = sum(value for line, value in daemon.metric_samples("kvd_cluster_fetch_bytes_total").items()
                if label in line)
    return stages | {"bytes": moved}


def one_round(pair, transport: str, round_index: int, blocks: np.ndarray) -> tuple[float, float, dict[str, float]]:
    """(seconds of the Get that fetched, seconds of the local Get after it, the fetch's stages)."""
    holder, fetcher = pair
    with Client(holder.unix_target) as put_client, Client(fetcher.unix_target) as get_client:
        ns_h, ns_f = put_client.register_namespace(SPEC), get_client.register_namespace(SPEC)
        keys = ns_h.keys(np.arange(len(blocks) * SPEC.block_tokens) + round_index * 10_000_000)
        assert put_client.put(ns_h, keys, blocks) == len(blocks)
        deadline = time.monotonic() + 30
        while not any(n.node == "holder" and n.matched == len(keys)
                      for n in get_client.cluster_lookup(ns_f, keys).nodes):
            if time.monotonic() > deadline:
                raise SystemExit("the directory never listed the holder")
            time.sleep(0.02)
        out = np.empty_like(blocks)
        out[:] = 0  # its pages touched before, not in the timed Get
        # A Get of a key nobody stored: this client maps the arena now (MAP_POPULATE, once per
        # connection), not inside the timed Get.
        get_client.get_numpy(ns_f, ns_f.keys(np.arange(SPEC.block_tokens) + 999_999_999))
        stages_before = fetch_stages(fetcher, transport)
        started = time.perf_counter()
        get_client.get_numpy(ns_f, keys, out=out)
        remote_s = time.perf_counter() - started
        after = fetch_stages(fetcher, transport)
        stages = {stage: after[stage] - stages_before.get(stage, 0.0) for stage in after}
        if not np.array_equal(out, blocks):
            raise SystemExit("a fetched block differs from what the holder stored")
        started = time.perf_counter()
        get_client.get_numpy(ns_f, keys, out=out)
        local_s = time.perf_counter() - started
        get_client.delete(ns_f, keys)
        put_client.delete(ns_h, keys)
    return remote_s, local_s, stages


def report_stages(stage_rounds: dict[str, list[dict[str, float]]], nixl_get_s: float) -> dict:
    """The fetches themselves, from the fetcher's metrics (medians over rounds): the NIXL READ inside
    the same fetch, between the same two processes (the raw READ of those bytes), beside the whole
    fetch; where a NIXL fetch's time goes; each transport's whole fetch beside the other's."""
    medians = {transport: {stage: statistics.median(round_.get(stage, 0.0) for round_ in rounds)
                           for stage in rounds[0]} for transport, rounds in stage_rounds.items() if rounds}
    nixl, grpc = medians.get("nixl", {}), medians.get("grpc", {})
    if not nixl.get("read") or not nixl.get("whole"):
        return {}
    rate = {name: stages["bytes"] / 2**30 / stages["whole"] for name, stages in medians.items() if stages.get("whole")}
    read_gib_s = nixl["bytes"] / 2**30 / nixl["read"]
    report(f"  NIXL READ inside the fetch {read_gib_s:6.2f} GiB/s (each piece checksummed while the next lands); "
           f"the whole fetch {rate['nixl']:6.2f} GiB/s: fetch / READ {fmt_ratio(ratio(rate['nixl'], read_gib_s))}")
    report("  where a NIXL fetch's time goes (median ms): " + ", ".join(
        f"{stage} {nixl[stage] * 1e3:.1f}" for stage in ("lookup", "pin", "read", "release", "verify", "seal", "whole")
        if stage in nixl) + f"; the Get around it {nixl_get_s * 1e3:.1f}")
    if "grpc" in rate:
        report(f"  gRPC fetch {rate['grpc']:6.2f} GiB/s (stream {grpc.get('stream', 0) * 1e3:.1f} ms of "
               f"{grpc['whole'] * 1e3:.1f}); NIXL fetch / gRPC fetch {fmt_ratio(ratio(rate['nixl'], rate['grpc']))}")
    return {"fetch_stages_s": medians, "nixl_read_gib_s": read_gib_s, "fetch_gib_s": rate,
            "fetch_vs_read": ratio(rate["nixl"], read_gib_s),
            "nixl_vs_grpc_fetch": ratio(rate["nixl"], rate["grpc"]) if "grpc" in rate else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    warn_if_busy()
    count = max(1, (args.mib << 20) // SPEC.block_bytes)
    blocks = np.random.default_rng(0).standard_normal((count, *SPEC.block_shape)).astype(np.float16)
    gib = blocks.nbytes / 2**30
    times: dict[str, dict[str, list[float]]] = {t: {"remote": [], "local": []} for t in TRANSPORTS}
    stage_rounds: dict[str, list[dict[str, float]]] = {t: [] for t in TRANSPORTS}
    with tempfile.TemporaryDirectory(prefix="kvd-bench-fetch-") as tmp, EtcdServer() as etcd:
        pairs = {t: cluster(Path(tmp), etcd, t, args.mib) for t in TRANSPORTS}
        try:
            for pair in pairs.values():
                wait_members(pair[1], 2)
            for r in range(args.rounds + 1):  # round 0 warms up (connections, first touch)
                for transport, pair in pairs.items():
                    progress(f"round {r}/{args.rounds} {transport}")
                    remote_s, local_s, stages = one_round(pair, transport, r, blocks)
                    if r:
                        times[transport]["remote"].append(remote_s)
                        times[transport]["local"].append(local_s)
                        stage_rounds[transport].append(stages)
        finally:
            for pair in pairs.values():
                for daemon in pair:
                    daemon.stop()
    results = {}
    report(f"remote fetch of {gib:.2f} GiB ({count} blocks of {SPEC.block_bytes >> 20} MiB), "
           f"median of {args.rounds} interleaved rounds")
    for transport in TRANSPORTS:
        remote = gib / statistics.median(times[transport]["remote"])
        local = gib / statistics.median(times[transport]["local"])
        results[transport] = {"fetch_gib_s": remote, "local_get_gib_s": local,
                              "fetch_vs_local": ratio(remote, local), "seconds": times[transport]}
        report(f"  {transport:5s} Get with fetch {remote:6.2f} GiB/s   local Get {local:6.2f} GiB/s   "
               f"fetch/local {fmt_ratio(ratio(remote, local))}")
    nixl_vs_grpc = ratio(results["nixl"]["fetch_gib_s"], results["grpc"]["fetch_gib_s"])
    report(f"  NIXL fetch / gRPC fetch: {fmt_ratio(nixl_vs_grpc)}")
    stages = report_stages(stage_rounds, statistics.median(times["nixl"]["remote"]))
    write_result("bench_cluster_fetch", {"mib": args.mib, "rounds": args.rounds, "block_bytes": SPEC.block_bytes,
                                         "results": results, "nixl_vs_grpc": nixl_vs_grpc} | stages)
    return 0


if __name__ == "__main__":
    sys.exit(main())
