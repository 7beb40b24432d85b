#!/usr/bin/env python3
"""Host-tier GET/PUT bandwidth through shared memory, against memcpy and Redis.

For each block size (2 MiB and 32 MiB, float16 namespaces whose block_bytes
is exactly that size) one process run measures, interleaved round by round
so that drift on the machine hits every contender alike:

  memcpy      single-thread copy of the same batch, block by block
              (numpy.copyto into a preallocated, pre-faulted destination)
  kvd PUT     Client.put of the batch from a preallocated numpy source, fresh
              keys every round (put writes only blocks not yet stored)
  kvd GET     Client.get_numpy(..., out=preallocated) of the last batch put
  Redis SET   redis-py + hiredis, pipelined SETs of the same payloads
              (memoryviews of the source: no client-side copy)
  Redis GET   pipelined GETs, each value copied into the same preallocated
              output array (a kvd GET also lands in the caller's array)
              The pipeline depth of each is calibrated first (1, 4, 16, 64
              commands; the fastest is kept): for multi-MiB values a deeper
              pipeline is not always faster.

plus, for information: kvd GET without `out=` (allocates its result) and
the inline gRPC path (use_shared_memory=False). The daemon is started with kvd.testing.daemon.run_daemon with
slot_bytes == block size; redis-server is started on a free loopback port
with --save "" --appendonly no.

Bandwidth = batch bytes / wall time of one batch; best and median over the
rounds. Targets (kvd GET through shared memory, median of rounds):
>= 0.8x memcpy and >= 10x Redis GET.

Run:  .venv/bin/python bench/bench_host_tier.py [--sizes 2 32] [--rounds 7] [--batch-mib 512] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    RedisServer,
    fmt_ratio,
    profile_call,
    progress,
    redis_info,
    report,
    summarize_rates,
    warn_if_busy,
    write_result,
)

TARGET_VS_MEMCPY = 0.8
TARGET_VS_REDIS = 10.0
MIB = 1 << 20


def block_spec(block_mib: int):
    """A float16 namespace whose block is exactly `block_mib` MiB.

    32 layers x 8 KV heads x 128 head_dim (a Llama-3-8B-like geometry);
    block_tokens sets the size: 16 tokens -> 2 MiB, 256 tokens -> 32 MiB.
    """
    from kvd.core.keys import DType, NamespaceSpec

    per_token = 32 * 2 * 8 * 128 * 2  # layers * (K,V) * heads * head_dim * fp16
    tokens, remainder = divmod(block_mib * MIB, per_token)
    if remainder or tokens < 1:
        raise SystemExit(f"--sizes: {block_mib} MiB is not a multiple of {per_token // 1024} KiB")
    spec = NamespaceSpec(model_id=f"bench-host-{block_mib}mib", num_layers=32, num_kv_heads=8, head_dim=128,
                         block_tokens=tokens, kv_dtype=DType.FLOAT16)
    assert spec.block_bytes == block_mib * MIB
    return spec


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


def prefaulted(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    array = np.empty(shape, dtype=dtype)
    array.view(np.uint8).reshape(-1)[:] = 0
    return array


class HostTierRun:
    """All contenders for one block size; the daemon and Redis are already up."""

    def __init__(self, spec, count: int, rounds: int, redis_client, redis_depths: list[int], kvd_target: str) -> None:
        from kvd.client import Client

        self.spec = spec
        self.count = count
        self.rounds = rounds
        self.batch_bytes = count * spec.block_bytes
        self.redis = redis_client
        self.redis_depths = redis_depths
        # Commands per pipeline for SET and for GET; set by calibrate_redis().
        self.depth_set = self.depth_get = redis_depths[0]
        self.redis_calibration: dict[str, dict[int, float]] = {}
        self.rng = np.random.default_rng(1234)
        shape = (count, *spec.block_shape)
        progress(f"  allocating and filling {3 * self.batch_bytes / MIB:.0f} MiB of buffers")
        self.src = np.empty(shape, dtype=np.float16)
        self.src.view(np.uint8).reshape(-1)[:] = self.rng.integers(0, 256, size=self.batch_bytes, dtype=np.uint8)
        self.out = prefaulted(shape, np.float16)
        self.dst = prefaulted(shape, np.float16)
        self.src_rows = self.src.view(np.uint8).reshape(count, spec.block_bytes)
        self.out_rows = self.out.view(np.uint8).reshape(count, spec.block_bytes)
        self.dst_rows = self.dst.view(np.uint8).reshape(count, spec.block_bytes)

        self.client = Client(kvd_target)
        if not self.client.uses_shared_memory:
            raise RuntimeError("the kvd client could not map the daemon's arena; shared memory is required here")
        self.ns = self.client.register_namespace(spec)
        self.inline_client = Client(kvd_target, use_shared_memory=False)
        assert not self.inline_client.uses_shared_memory
        self.last_keys: list[bytes] | None = None
        self.redis_keys = [f"bench:{spec.block_bytes}:{i}".encode() for i in range(count)]
        self.samples: dict[str, list[float]] = {}

    def close(self) -> None:
        for client in (self.client, self.inline_client):
            client.close()

    def fresh_keys(self) -> list[bytes]:
        tokens = self.rng.integers(0, 1 << 31, size=self.count * self.spec.block_tokens, dtype=np.int64)
        keys = self.ns.keys(tokens)
        assert len(keys) == self.count
        return keys

    def record(self, name: str, seconds: float) -> None:
        self.samples.setdefault(name, []).append(seconds)

    # -- contenders ----------------------------------------------------------

    def memcpy(self) -> None:
        src, dst = self.src_rows, self.dst_rows
        for i in range(self.count):
            np.copyto(dst[i], src[i])

    def kvd_put(self, client, keys: list[bytes]) -> None:
        written = client.put(self.ns, keys, self.src)
        if written != self.count:
            raise RuntimeError(f"kvd put wrote {written} of {self.count} blocks")

    def kvd_get(self, client, keys: list[bytes], use_out: bool = True) -> None:
        result = client.get_numpy(self.ns, keys, out=self.out if use_out else None)
        if result.shape[0] != self.count:
            raise RuntimeError(f"kvd get matched {result.shape[0]} of {self.count} blocks")

    def redis_put(self, step: int | None = None) -> None:
        step = step or self.depth_set
        for start in range(0, self.count, step):
            pipe = self.redis.pipeline(transaction=False)
            for i in range(start, min(start + step, self.count)):
                pipe.set(self.redis_keys[i], memoryview(self.src_rows[i]))
            pipe.execute()

    def redis_get(self, step: int | None = None) -> None:
        step = step or self.depth_get
        out = self.out_rows
        for start in range(0, self.count, step):
            pipe = self.redis.pipeline(transaction=False)
            for i in range(start, min(start + step, self.count)):
                pipe.get(self.redis_keys[i])
            for offset, value in enumerate(pipe.execute()):
                out[start + offset] = np.frombuffer(value, dtype=np.uint8)

    def calibrate_redis(self, tries: int = 2) -> None:
        """Give Redis its best pipeline depth, separately for SET and GET.

        Deep pipelines are not always faster for multi-MiB values (Redis
        writes a big reply in pieces per event-loop turn), so each candidate
        depth is tried and the fastest kept, as a user tuning Redis would.
        """
        if len(self.redis_depths) == 1:
            return
        sets: dict[int, float] = {}
        gets: dict[int, float] = {}
        for depth in self.redis_depths:
            for _ in range(tries):
                self.redis.flushall()
                seconds, _ = timed(lambda: self.redis_put(depth))
                sets[depth] = max(sets.get(depth, 0.0), self.batch_bytes / seconds / (1 << 30))
                seconds, _ = timed(lambda: self.redis_get(depth))
                gets[depth] = max(gets.get(depth, 0.0), self.batch_bytes / seconds / (1 << 30))
        self.depth_set = max(sets, key=sets.get)
        self.depth_get = max(gets, key=gets.get)
        self.redis_calibration = {"set_gib_s_by_depth": sets, "get_gib_s_by_depth": gets,
                                  "chosen_set_depth": self.depth_set, "chosen_get_depth": self.depth_get}
        progress("  Redis pipeline depth calibration (best GiB/s): "
                 + ", ".join(f"depth {d}: SET {sets[d]:.2f} GET {gets[d]:.2f}" for d in self.redis_depths)
                 + f" -> SET depth {self.depth_set}, GET depth {self.depth_get}")

    # -- rounds --------------------------------------------------------------

    def round(self, number: int, warmup: bool) -> None:
        def measure(name: str, fn: Callable[[], Any]) -> None:
            gc.collect()
            seconds, _ = timed(fn)
            if not warmup:
                self.record(name, seconds)

        keys = self.fresh_keys()
        measure("memcpy", self.memcpy)
        measure("kvd_put_shm", lambda: self.kvd_put(self.client, keys))
        self.last_keys = keys
        measure("kvd_get_shm", lambda: self.kvd_get(self.client, keys))
        measure("kvd_get_shm_alloc", lambda: self.kvd_get(self.client, keys, use_out=False))
        self.redis.flushall()
        measure("redis_set", self.redis_put)
        measure("redis_get", self.redis_get)
        # Drop Redis's copy again (untimed), so that between measurements
        # only kvd's arena holds a copy of the batch.
        self.redis.flushall()
        tag = f"warm-up {number + 1}" if warmup else f"round {number}/{self.rounds}"
        if not warmup:
            last = {name: self.batch_bytes / values[-1] / (1 << 30) for name, values in self.samples.items()}
            progress(f"  {tag}: " + ", ".join(f"{name} {rate:.2f}" for name, rate in last.items()) + " GiB/s")
        else:
            progress(f"  {tag} done")

    def inline_rounds(self, rounds: int) -> None:
        for number in range(rounds + 1):
            keys = self.fresh_keys()
            seconds_put, _ = timed(lambda: self.kvd_put(self.inline_client, keys))
            seconds_get, _ = timed(lambda: self.kvd_get(self.inline_client, keys))
            if number:  # the first is a warm-up
                self.record("kvd_put_inline", seconds_put)
                self.record("kvd_get_inline", seconds_get)
            progress(f"  inline {'warm-up' if not number else f'round {number}/{rounds}'}: "
                     f"put {self.batch_bytes / seconds_put / (1 << 30):.2f}, "
                     f"get {self.batch_bytes / seconds_get / (1 << 30):.2f} GiB/s")
        self.last_keys = keys

    def verify(self) -> None:
        """Every contender really moved the bytes (checked once, untimed)."""
        assert self.last_keys is not None
        self.out_rows[:] = 0
        self.kvd_get(self.client, self.last_keys)
        if not np.array_equal(self.out_rows, self.src_rows):
            raise RuntimeError("kvd GET returned different bytes than were PUT")
        self.out_rows[:] = 0
        self.redis_put()
        self.redis_get()
        if not np.array_equal(self.out_rows, self.src_rows):
            raise RuntimeError("Redis GET returned different bytes than were SET")
        if not np.array_equal(self.dst_rows, self.src_rows):
            raise RuntimeError("memcpy baseline did not copy")


def run_size(block_mib: int, args: argparse.Namespace, redis_server: RedisServer, workdir: Path) -> dict:
    from kvd.testing.daemon import run_daemon

    spec = block_spec(block_mib)
    count = max(2, args.batch_mib * MIB // spec.block_bytes)
    capacity = max(args.capacity_mib * MIB, 2 * count * spec.block_bytes)
    report("")
    report(f"-- {block_mib} MiB blocks: shape {spec.block_shape} float16, batch of {count} blocks "
           f"({count * spec.block_bytes / MIB:.0f} MiB), host capacity {capacity / MIB:.0f} MiB, "
           f"slot_bytes {spec.block_bytes} --")
    progress(f"{block_mib} MiB blocks: starting kvd (capacity {capacity / MIB:.0f} MiB)")
    config = {"host": {"capacity_bytes": capacity, "slot_bytes": spec.block_bytes}}
    with run_daemon(workdir / f"kvd-{block_mib}mib", config=config) as daemon:
        run = HostTierRun(spec, count, args.rounds, redis_server.client(), args.redis_pipeline, daemon.unix_target)
        try:
            run.calibrate_redis()
            # Warm-up rounds until every slot of the arena has been written and
            # read once through each client's own mapping (first touches of a
            # mapping take page faults that a long-running client never sees).
            warmups = max(1, -(-capacity // run.batch_bytes))
            for number in range(warmups):
                run.round(number, warmup=True)
            for number in range(1, args.rounds + 1):
                run.round(number, warmup=False)
            if args.inline_rounds:
                run.inline_rounds(args.inline_rounds)
            run.verify()
            summaries = {name: summarize_rates(run.batch_bytes, seconds) for name, seconds in run.samples.items()}
            result = evaluate(block_mib, spec, count, summaries, run)
            if args.profile or not result["pass"]:
                keys = run.last_keys
                result["profile_kvd_get_shm"] = profile_call(
                    lambda: [run.kvd_get(run.client, keys) for _ in range(5)],
                    title=f"client side of 5 x kvd GET (shared memory, out=), {block_mib} MiB blocks",
                )
                if args.profile and args.inline_rounds:
                    result["profile_kvd_get_inline"] = profile_call(
                        lambda: run.kvd_get(run.inline_client, keys),
                        title=f"client side of 1 x kvd GET (inline gRPC, out=), {block_mib} MiB blocks",
                    )
                put_keys = [run.fresh_keys() for _ in range(3)]
                result["profile_kvd_put_shm"] = profile_call(
                    lambda: [run.kvd_put(run.client, keys) for keys in put_keys],
                    title=f"client side of 3 x kvd PUT (shared memory), {block_mib} MiB blocks",
                )
        finally:
            run.close()
            run.redis.flushall()
            run.redis.close()
    return result


def evaluate(block_mib: int, spec, count: int, summaries: dict[str, dict], run: HostTierRun) -> dict:
    def median(name: str) -> float:
        return summaries[name]["median_gib_s"]

    def best(name: str) -> float:
        return summaries[name]["best_gib_s"]

    ratios = {
        "get_vs_memcpy_median": median("kvd_get_shm") / median("memcpy"),
        "get_vs_memcpy_best": best("kvd_get_shm") / best("memcpy"),
        "get_vs_redis_median": median("kvd_get_shm") / median("redis_get"),
        "get_vs_redis_best": best("kvd_get_shm") / best("redis_get"),
        "put_vs_memcpy_median": median("kvd_put_shm") / median("memcpy"),
        "put_vs_redis_median": median("kvd_put_shm") / median("redis_set"),
    }
    if "kvd_get_inline" in summaries:
        ratios["inline_get_vs_memcpy_median"] = median("kvd_get_inline") / median("memcpy")
        ratios["inline_get_vs_redis_median"] = median("kvd_get_inline") / median("redis_get")
        ratios["inline_put_vs_redis_median"] = median("kvd_put_inline") / median("redis_set")
    pass_memcpy = ratios["get_vs_memcpy_median"] >= TARGET_VS_MEMCPY
    pass_redis = ratios["get_vs_redis_median"] >= TARGET_VS_REDIS

    labels = {
        "memcpy": "memcpy (numpy.copyto, 1 thread)",
        "kvd_put_shm": "kvd PUT  shared memory",
        "kvd_get_shm": "kvd GET  shared memory, out=",
        "kvd_get_shm_alloc": "kvd GET  shared memory, no out= (info)",
        "redis_set": f"Redis SET, pipeline depth {run.depth_set}",
        "redis_get": f"Redis GET + copy out, pipeline depth {run.depth_get}",
        "kvd_put_inline": "kvd PUT  inline gRPC (info)",
        "kvd_get_inline": "kvd GET  inline gRPC, out= (info)",
    }
    report(f"{'contender':<42} {'best GiB/s':>10} {'median GiB/s':>13} {'reps':>5}")
    for name, label in labels.items():
        if name in summaries:
            summary = summaries[name]
            report(f"{label:<42} {summary['best_gib_s']:>10.2f} {summary['median_gib_s']:>13.2f} {summary['reps']:>5}")
    report(f"kvd GET / memcpy    median {fmt_ratio(ratios['get_vs_memcpy_median'])} "
           f"(best {fmt_ratio(ratios['get_vs_memcpy_best'])}), target >= {TARGET_VS_MEMCPY}x: "
           f"{'PASS' if pass_memcpy else 'FAIL'}")
    report(f"kvd GET / Redis GET median {fmt_ratio(ratios['get_vs_redis_median'])} "
           f"(best {fmt_ratio(ratios['get_vs_redis_best'])}), target >= {TARGET_VS_REDIS}x: "
           f"{'PASS' if pass_redis else 'FAIL'}")
    needed = TARGET_VS_REDIS * median("redis_get")
    if not pass_redis:
        report(f"  (>= {TARGET_VS_REDIS}x Redis needs {needed:.2f} GiB/s here; single-thread memcpy does "
               f"{median('memcpy'):.2f} GiB/s, i.e. {needed / median('memcpy'):.2f}x memcpy)")
    report(f"kvd PUT / memcpy    median {fmt_ratio(ratios['put_vs_memcpy_median'])}; "
           f"kvd PUT / Redis SET median {fmt_ratio(ratios['put_vs_redis_median'])} (no target)")
    if "inline_get_vs_memcpy_median" in ratios:
        report(f"inline gRPC GET / memcpy median {fmt_ratio(ratios['inline_get_vs_memcpy_median'])}, "
               f"/ Redis GET {fmt_ratio(ratios['inline_get_vs_redis_median'])} (info)")
    return {
        "block_mib": block_mib,
        "block_bytes": spec.block_bytes,
        "block_shape": list(spec.block_shape),
        "blocks_per_batch": count,
        "batch_bytes": count * spec.block_bytes,
        "measurements": summaries,
        "redis_pipeline": {"set_depth": run.depth_set, "get_depth": run.depth_get, **run.redis_calibration},
        "ratios": ratios,
        "redis_target_needs_gib_s": needed,
        "redis_target_needs_x_memcpy": needed / median("memcpy"),
        "targets": {"get_vs_memcpy_min": TARGET_VS_MEMCPY, "get_vs_redis_min": TARGET_VS_REDIS,
                    "statistic": "median of rounds"},
        "pass_get_vs_memcpy": pass_memcpy,
        "pass_get_vs_redis": pass_redis,
        "pass": pass_memcpy and pass_redis,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 32], help="block sizes in MiB")
    parser.add_argument("--rounds", type=int, default=7, help="measured rounds (after one warm-up round)")
    parser.add_argument("--batch-mib", type=int, default=512, help="bytes moved per measured call, in MiB")
    parser.add_argument("--capacity-mib", type=int, default=1024, help="kvd host capacity (at least 2 batches)")
    parser.add_argument("--redis-pipeline", type=int, nargs="+", default=[1, 4, 16, 64],
                        help="candidate commands per Redis pipeline; the fastest is used for SET and for GET")
    parser.add_argument("--inline-rounds", type=int, default=3, help="rounds of the inline gRPC path (0: skip)")
    parser.add_argument("--profile", action="store_true", help="print client-side profiles even when targets pass")
    args = parser.parse_args()
    warn_if_busy()

    report("== bench_host_tier: host-tier bandwidth, kvd shared memory vs memcpy vs Redis ==")
    results = []
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvd-bench-host-")))
        progress("starting redis-server")
        redis_server = stack.enter_context(RedisServer(workdir / "redis"))
        for block_mib in args.sizes:
            results.append(run_size(block_mib, args, redis_server, workdir))

    overall = all(result["pass"] for result in results)
    write_result("bench_host_tier", {
        "targets": {"kvd_get_shm_vs_memcpy_min": TARGET_VS_MEMCPY, "kvd_get_shm_vs_redis_get_min": TARGET_VS_REDIS,
                    "statistic": "median bandwidth over rounds, measured interleaved in one run"},
        "pass": overall,
        "settings": vars(args),
        "baselines": redis_info(),
        "results": results,
    })
    report("")
    for result in results:
        report(f"{result['block_mib']:>3} MiB: GET/memcpy {fmt_ratio(result['ratios']['get_vs_memcpy_median'])} "
               f"({'PASS' if result['pass_get_vs_memcpy'] else 'FAIL'}), GET/Redis "
               f"{fmt_ratio(result['ratios']['get_vs_redis_median'])} "
               f"({'PASS' if result['pass_get_vs_redis'] else 'FAIL'})")
    report(f"overall: {'PASS' if overall else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
