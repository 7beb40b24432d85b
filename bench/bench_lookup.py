#!/usr/bin/env python3
"""Round-trip Lookup latency for an 8,000-block prefix, and where the time goes.

A daemon (kvd.testing.daemon.run_daemon) gets 8,000 small blocks of one
chain (a namespace of 512-byte blocks in 4 KiB slots: payload size is
irrelevant to Lookup), then one process run measures, interleaved call by
call so that machine noise hits every contender alike:

  kvd Lookup(8000 keys) over the unix socket      (the target; the client
                                                   sends them as packed_keys)
  kvd Lookup(8000 keys) over loopback TCP         (the target)
  the same over unix, keys as a repeated field    (baseline: the request as
                                                   the client sent it before)
  Engine.lookup(8000 keys) in-process              (baseline: the index work alone)

then, in a second phase, the fixed cost of a gRPC round trip:

  Stats over unix and TCP                          (an empty request)
  Lookup(1 key) over unix and TCP

and in-process costs of the protobuf message of an 8,000-key Lookup
(build + serialize on the client, parse on the server), packed and
repeated. The daemon's own kvd_rpc_duration_seconds histogram gives the
server-side handler time of each phase. Targets: Lookup of 8,000 keys p99
<= 5 ms and p50 <= 2 ms (issue 13) on both transports.

Run:  .venv/bin/python bench/bench_lookup.py [--blocks 8000] [--calls 500] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import re
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    profile_call,
    progress,
    report,
    summarize_latencies,
    warn_if_busy,
    write_result,
)

TARGET_MS = 5.0
TARGET_P50_MS = 2.0
SLOT_BYTES = 4096
CLIENT_ID = "bench-lookup"


def small_spec():
    from kvd.core.keys import DType, NamespaceSpec

    # 1 layer x (K,V) x 16 tokens x 1 head x 8 dims x fp16 = 512 bytes.
    return NamespaceSpec(model_id="bench-lookup", num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16,
                         kv_dtype=DType.FLOAT16)


def rpc_histogram(metrics_url: str) -> dict[str, tuple[float, float]]:
    """{method: (sum_seconds, count)} of kvd_rpc_duration_seconds."""
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(r'kvd_rpc_duration_seconds_(sum|count)\{method="([^"]+)"\} (\S+)', line)
        if match:
            kind, method, value = match.groups()
            (sums if kind == "sum" else counts)[method] = float(value)
    return {method: (sums.get(method, 0.0), counts.get(method, 0.0)) for method in counts}


def server_mean_ms(before: dict, after: dict, method: str) -> float | None:
    s0, c0 = before.get(method, (0.0, 0.0))
    s1, c1 = after.get(method, (0.0, 0.0))
    return (s1 - s0) / (c1 - c0) * 1e3 if c1 > c0 else None


def time_calls(contenders: dict[str, Callable[[], Any]], calls: int, warmup: int, label: str) -> dict[str, list[float]]:
    """Call every contender `calls` times, round robin; seconds per call."""
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    clock = time.perf_counter
    last_report = clock()
    for iteration in range(warmup + calls):
        for name, fn in contenders.items():
            started = clock()
            fn()
            elapsed = clock() - started
            if iteration >= warmup:
                samples[name].append(elapsed)
        if clock() - last_report > 5:
            last_report = clock()
            progress(f"  {label}: {max(0, iteration + 1 - warmup)}/{calls} calls")
    return samples


def build_engine(spec, keys: list[bytes], chunk: int = 512):
    """An in-process engine holding `keys` as one sealed chain."""
    from kvd.core.engine import CommitRequest, Engine, KeysRequest

    engine = Engine(host_slot_count=len(keys) + 16, host_slot_bytes=SLOT_BYTES)
    namespace_id = engine.register_namespace(spec).namespace_id
    parent = b""
    for start in range(0, len(keys), chunk):
        part = keys[start : start + chunk]
        reserved = engine.reserve(KeysRequest(namespace_id, CLIENT_ID, part, 0, 0, parent_key=parent))
        engine.commit(CommitRequest(namespace_id, CLIENT_ID, reserved.lease.lease_id, 0))
        parent = part[-1]
    return engine, namespace_id


class InProcessHandler:
    """kvd.server.service.KvdService.Lookup driven directly, without gRPC.

    Parses the request bytes, awaits the real handler (with its metrics
    wrapper) and serializes the response: the daemon's work for one Lookup
    minus the transport.
    """

    def __init__(self, engine) -> None:
        import asyncio

        from prometheus_client import CollectorRegistry

        from kvd.clock import MonotonicClock
        from kvd.metrics import RpcMetrics
        from kvd.server.service import KvdService
        from kvd.v1 import kvd_pb2

        self._loop = asyncio.new_event_loop()
        self._request_type = kvd_pb2.LookupRequest
        self._service = KvdService(engine, None, MonotonicClock(), RpcMetrics(CollectorRegistry()), 64 << 20)

    def lookup(self, wire: bytes, expect: int) -> bytes:
        request = self._request_type.FromString(wire)
        response = self._loop.run_until_complete(self._service.Lookup(request, None))
        if response.matched != expect:
            raise RuntimeError(f"in-process handler matched {response.matched}, expected {expect}")
        return response.SerializeToString()

    def close(self) -> None:
        self._loop.close()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=8000, help="prefix length in blocks")
    parser.add_argument("--calls", type=int, default=500, help="timed calls per contender (>= 200)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--profile", action="store_true", help="print the client-side profile even on a pass")
    parser.add_argument("--disk", action="store_true", help="give the daemon a disk tier too (two tiers to report)")
    return parser.parse_args()


@dataclass
class Setup:
    """A daemon holding the prefix, a client per transport, and the in-process engine baseline."""

    daemon: Any
    unix: Any
    tcp: Any
    ns: Any
    ns_tcp: Any
    keys: list[bytes]
    engine: Any
    namespace_id: bytes
    put_seconds: float


def start(stack: contextlib.ExitStack, args: argparse.Namespace) -> Setup:
    from kvd.client import Client
    from kvd.testing.daemon import run_daemon

    spec = small_spec()
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 1 << 31, size=args.blocks * spec.block_tokens, dtype=np.int64)
    workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvd-bench-lookup-")))
    capacity = max(64 << 20, (args.blocks + 64) * SLOT_BYTES)
    progress(f"starting kvd (capacity {capacity >> 20} MiB, slot {SLOT_BYTES} B)")
    config: dict = {"host": {"capacity_bytes": capacity, "slot_bytes": SLOT_BYTES}}
    if args.disk:
        # A second tier: Lookup then reports each block's tier (kvd.server.convert.tiers).
        config["disk"] = {"directories": [str(workdir / "disk")], "capacity_bytes": 64 << 20,
                          "slot_bytes": 1 << 20, "segment_bytes": 64 << 20}
    daemon = stack.enter_context(run_daemon(workdir / "kvd", config=config))
    unix = stack.enter_context(Client(daemon.unix_target))
    tcp = stack.enter_context(Client(daemon.tcp_target))
    ns = unix.register_namespace(spec)
    ns_tcp = tcp.register_namespace(spec)
    keys = ns.keys(tokens)
    assert len(keys) == args.blocks
    blocks = np.zeros((args.blocks, *spec.block_shape), dtype=np.float16)
    progress(f"putting {args.blocks:,} blocks in one Client.put call (setup)")
    started = time.perf_counter()
    written = unix.put(ns, keys, blocks)
    put_seconds = time.perf_counter() - started
    if written != args.blocks:
        raise RuntimeError(f"setup put wrote {written} of {args.blocks} blocks")
    progress(f"  setup put took {put_seconds:.2f} s")
    for client, namespace in ((unix, ns), (tcp, ns_tcp)):
        matched = client.lookup(namespace, keys).matched
        if matched != args.blocks:
            raise RuntimeError(f"lookup matched {matched} of {args.blocks}")
    progress("building the in-process engine baseline")
    engine, namespace_id = build_engine(spec, keys)
    assert len(engine.lookup(namespace_id, keys)) == args.blocks
    return Setup(daemon, unix, tcp, ns, ns_tcp, keys, engine, namespace_id, put_seconds)


def listed_lookup_call(target: str, namespace_id: bytes, request_keys: list[bytes], expect: int
                       ) -> Callable[[], None]:
    """Lookup with the keys in LookupRequest.keys (one protobuf bytes per key), on a raw stub."""
    import grpc

    from kvd.v1 import kvd_pb2, kvd_pb2_grpc

    stub = kvd_pb2_grpc.KvdStub(grpc.insecure_channel(target))

    def call() -> None:
        matched = stub.Lookup(kvd_pb2.LookupRequest(namespace_id=namespace_id, keys=request_keys)).matched
        if matched != expect:
            raise RuntimeError(f"listed lookup matched {matched}, expected {expect}")
    return call


def lookup_call(client, namespace, request_keys, expect) -> Callable[[], None]:
    def call() -> None:
        matched = client.lookup(namespace, request_keys).matched
        if matched != expect:
            raise RuntimeError(f"lookup matched {matched}, expected {expect}")
    return call


def run_phases(setup: Setup, handler: InProcessHandler, wires: dict[str, bytes], args: argparse.Namespace
               ) -> tuple[dict[str, list[float]], dict[str, float | None]]:
    """The timed calls of the three phases, and the daemon's own handler times."""
    from kvd.core.keys import PackedKeys
    from kvd.v1 import kvd_pb2

    unix, tcp, keys, engine = setup.unix, setup.tcp, setup.keys, setup.engine
    # Phase 1: the 8,000-key Lookup on both transports, and the engine alone.
    gc.collect()
    before = rpc_histogram(setup.daemon.metrics_url)
    progress(f"phase 1: Lookup({args.blocks} keys) unix / tcp / in-process engine")
    phase1 = time_calls({
        "lookup_unix": lookup_call(unix, setup.ns, keys, args.blocks),
        "lookup_tcp": lookup_call(tcp, setup.ns_tcp, keys, args.blocks),
        "lookup_unix_listed": listed_lookup_call(setup.daemon.unix_target, setup.ns.namespace_id, keys, args.blocks),
        "engine_inprocess": lambda: engine.lookup(setup.namespace_id, PackedKeys(b"".join(keys))),
    }, args.calls, args.warmup, "phase 1")
    after1 = rpc_histogram(setup.daemon.metrics_url)
    # Phase 2: the fixed cost of a round trip.
    progress("phase 2: Stats and Lookup(1 key), unix / tcp")
    one = keys[:1]
    phase2 = time_calls({
        "stats_unix": unix.stats,
        "stats_tcp": tcp.stats,
        "lookup1_unix": lookup_call(unix, setup.ns, one, 1),
        "lookup1_tcp": lookup_call(tcp, setup.ns_tcp, one, 1),
    }, args.calls, args.warmup, "phase 2")
    after2 = rpc_histogram(setup.daemon.metrics_url)
    # Phase 3: protobuf costs of the big request, and the daemon's Lookup
    # handler driven in-process (no transport), on the same engine state.
    progress("phase 3: protobuf build/serialize/parse, in-process service handler")
    namespace_id = setup.ns.namespace_id
    listed = wires["listed"]
    phase3 = time_calls({
        "service_handler_inprocess": lambda: handler.lookup(wires["packed"], args.blocks),
        "service_handler_listed": lambda: handler.lookup(listed, args.blocks),
        "proto_build_serialize": lambda: kvd_pb2.LookupRequest(
            namespace_id=namespace_id, packed_keys=b"".join(keys)).SerializeToString(),
        "proto_build_serialize_listed": lambda: kvd_pb2.LookupRequest(
            namespace_id=namespace_id, keys=keys).SerializeToString(),
        "proto_parse_and_list_keys": lambda: list(kvd_pb2.LookupRequest.FromString(listed).keys),
    }, args.calls, args.warmup, "phase 3")
    server = {
        "lookup_8000_handler_mean_ms": server_mean_ms(before, after1, "Lookup"),
        "lookup_1_handler_mean_ms": server_mean_ms(after1, after2, "Lookup"),
        "stats_handler_mean_ms": server_mean_ms(after1, after2, "Stats"),
    }
    return {**phase1, **phase2, **phase3}, server


def print_table(summaries: dict, server: dict, blocks: int) -> None:
    labels = [
        ("lookup_unix", f"kvd Lookup({blocks}) unix socket"),
        ("lookup_tcp", f"kvd Lookup({blocks}) loopback TCP"),
        ("lookup_unix_listed", f"kvd Lookup({blocks}) unix, repeated keys"),
        ("engine_inprocess", f"Engine.lookup({blocks}) in-process"),
        ("stats_unix", "kvd Stats unix (empty round trip)"),
        ("stats_tcp", "kvd Stats TCP (empty round trip)"),
        ("lookup1_unix", "kvd Lookup(1) unix"),
        ("lookup1_tcp", "kvd Lookup(1) TCP"),
        ("proto_build_serialize", f"LookupRequest({blocks}) packed build+serialize"),
        ("proto_build_serialize_listed", f"LookupRequest({blocks}) repeated build+ser."),
        ("proto_parse_and_list_keys", f"LookupRequest({blocks}) repeated parse+list"),
        ("service_handler_inprocess", "service: parse + Lookup + serialize, packed"),
        ("service_handler_listed", "service: the same, repeated keys"),
    ]
    report("")
    report(f"{'contender':<44} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8} {'calls':>6}")
    for name, label in labels:
        summary = summaries[name]
        report(f"{label:<44} {summary['p50_ms']:>8.3f} {summary['p90_ms']:>8.3f} {summary['p99_ms']:>8.3f} "
               f"{summary['max_ms']:>8.3f} {summary['calls']:>6}")
    report("")
    report("server-side handler time (daemon's kvd_rpc_duration_seconds, mean):")
    for name, value in server.items():
        report(f"  {name:<34} {'n/a' if value is None else f'{value:.3f} ms'}")


def verdicts(summaries: dict, blocks: int) -> tuple[dict[str, Any], bool]:
    """Per transport: the figures against the target, and whether both met it."""
    results: dict[str, Any] = {}
    overall = True
    for transport in ("unix", "tcp"):
        summary = summaries[f"lookup_{transport}"]
        passed = summary["p99_ms"] <= TARGET_MS and summary["p50_ms"] <= TARGET_P50_MS
        overall &= passed
        results[transport] = {
            "p50_ms": summary["p50_ms"],
            "p99_ms": summary["p99_ms"],
            "p50_meets_target": summary["p50_ms"] <= TARGET_P50_MS,
            "p50_over_listed_keys": summary["p50_ms"] / summaries["lookup_unix_listed"]["p50_ms"],
            "p99_over_target": summary["p99_ms"] / TARGET_MS,
            "p50_over_engine_inprocess": summary["p50_ms"] / summaries["engine_inprocess"]["p50_ms"],
            "p50_over_empty_round_trip": summary["p50_ms"] / summaries[f"stats_{transport}"]["p50_ms"],
            "pass": passed,
        }
    report("")
    for transport, result in results.items():
        verdict = "PASS" if result["pass"] else "FAIL"
        report(f"Lookup({blocks}) {transport:>4}: p50 {result['p50_ms']:.3f} ms (target {TARGET_P50_MS}), "
               f"p99 {result['p99_ms']:.3f} ms = {result['p99_over_target']:.2f}x of the {TARGET_MS} ms target: "
               f"{verdict}; {result['p50_over_listed_keys']:.2f}x the repeated-keys request; "
               f"p50 is {result['p50_over_engine_inprocess']:.1f}x the in-process engine and "
               f"{result['p50_over_empty_round_trip']:.1f}x an empty round trip")
    return results, overall


def profiles_of(setup: Setup, handler: InProcessHandler, wire: bytes, blocks: int) -> dict[str, str]:
    from kvd.core.keys import PackedKeys

    packed = PackedKeys(b"".join(setup.keys))
    return {
        "service_handler_inprocess": profile_call(
            lambda: [handler.lookup(wire, blocks) for _ in range(50)],
            title=f"daemon side, in-process: 50 x (parse + KvdService.Lookup({blocks}) + serialize)"),
        "client_lookup_unix": profile_call(
            lambda: [setup.unix.lookup(setup.ns, setup.keys) for _ in range(50)],
            title=f"client side of 50 x Lookup({blocks}) over the unix socket"),
        "engine_lookup": profile_call(
            lambda: [setup.engine.lookup(setup.namespace_id, packed) for _ in range(50)],
            title=f"50 x Engine.lookup({blocks}) in-process"),
    }


def main() -> int:
    from kvd.v1 import kvd_pb2

    args = parse_args()
    warn_if_busy()
    report(f"== bench_lookup: Lookup of a {args.blocks:,}-block prefix, {args.calls} calls per contender ==")
    with contextlib.ExitStack() as stack:
        setup = start(stack, args)
        namespace_id = setup.ns.namespace_id
        wires = {"packed": kvd_pb2.LookupRequest(namespace_id=namespace_id, packed_keys=b"".join(setup.keys)),
                 "listed": kvd_pb2.LookupRequest(namespace_id=namespace_id, keys=setup.keys)}
        wires = {name: message.SerializeToString() for name, message in wires.items()}
        wire = wires["packed"]
        handler = InProcessHandler(setup.engine)
        raw, server = run_phases(setup, handler, wires, args)
        summaries = {name: summarize_latencies(values) for name, values in raw.items()}
        print_table(summaries, server, args.blocks)
        results, overall = verdicts(summaries, args.blocks)
        report(f"(setup: one Client.put of {args.blocks:,} blocks took {setup.put_seconds:.2f} s)")
        profiles = profiles_of(setup, handler, wire, args.blocks) if args.profile or not overall else {}
        handler.close()
        write_result("bench_lookup", {
            "target": {"metric": f"Lookup of {args.blocks} keys, p99 and p50 round trip", "max_ms": TARGET_MS,
                       "max_p50_ms": TARGET_P50_MS},
            "pass": overall,
            "settings": vars(args),
            "setup_put_seconds": setup.put_seconds,
            "results": results,
            "latencies": summaries,
            "server_side": server,
            "raw_seconds": raw,
            "profiles": profiles,
        })
        report(f"overall: {'PASS' if overall else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
