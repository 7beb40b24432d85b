#!/usr/bin/env python3
"""Index memory per block of the in-process engine.

Builds a kvd.core.engine.Engine, inserts N blocks in chains (reserve + commit,
exactly as the daemon does for a Put), and divides the memory growth by N.
There is no payload arena in-process: the engine only keeps bookkeeping, so
everything measured is per-block metadata (Block record, its 32-byte key,
the index dict entry, and whatever the lease/policy machinery leaves behind).

Two figures are reported per N:
  * insert growth: memory after the inserts minus memory after the engine
    (with its N-slot host pool) was built. This is the "index" cost and is
    what the <= 256 B/block target applies to.
  * incl. host pool: memory after the inserts minus memory before the engine
    existed, i.e. also the per-slot bookkeeping the host pool preallocates
    (owners list entry, the slot-number int objects). Reported for
    information, with its own verdict.

The engine's KV event ring (kvd.core.events) keeps references to the keys
of recent events, up to events.ring_keys in all (262,144 by default): a
fixed bound, not a per-block cost, so the per-block figures are taken with
a one-key ring, and one more run at the largest N with the default ring
reports what the ring adds (about 8 B per key it holds).

Each N is measured in a fresh subprocess twice: once under tracemalloc (exact
Python allocations) and once without it for RSS (tracemalloc's own traces
would swamp RSS). RSS includes allocator slack and is a cross-check only.

Run:  .venv/bin/python bench/bench_index_memory.py [--sizes 100000 1000000] [--chain 64] [--policy lru|s3fifo]
          [--no-ring-run]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, progress, report, rss_bytes, warn_if_busy, write_result  # noqa: E402

TARGET_BYTES_PER_BLOCK = 256
CLIENT_ID = "bench-index-memory"


def _spec():
    from kvd.core.keys import DType, NamespaceSpec

    # Tiny blocks: the engine never touches payload, only block_bytes matters
    # for slot accounting.
    return NamespaceSpec(model_id="bench-index", num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16,
                         kv_dtype=DType.FLOAT16)


def _key(counter: int) -> bytes:
    # 32 opaque bytes, like the chained SHA-256 keys clients send.
    return hashlib.sha256(counter.to_bytes(8, "little")).digest()


def _allocated(size: int) -> int:
    """Bytes pymalloc really uses for a request of `size` (16-byte classes up to 512 B)."""
    return (size + 15) // 16 * 16 if 0 < size <= 512 else size


class _Meter:
    """Memory in use now: tracemalloc's count (and pymalloc's rounded sizes), or the RSS."""

    def __init__(self, use_tracemalloc: bool) -> None:
        self.use_tracemalloc = use_tracemalloc
        self.rounded: dict[str, int] = {}
        if use_tracemalloc:
            tracemalloc.start(1)

    def current(self, label: str) -> int:
        gc.collect()
        if not self.use_tracemalloc:
            return rss_bytes()
        # tracemalloc records requested sizes; pymalloc serves requests of up
        # to 512 bytes from 16-byte size classes, so also sum the rounded
        # sizes: that is what the allocator really hands out.
        snapshot = tracemalloc.take_snapshot()
        self.rounded[label] = sum(_allocated(trace.size) for trace in snapshot.traces)
        del snapshot
        return tracemalloc.get_traced_memory()[0]

    def top_sites(self, blocks: int) -> list[dict]:
        """The largest allocation sites, per block; stops tracing."""
        if not self.use_tracemalloc:
            return []
        sites = []
        snapshot = tracemalloc.take_snapshot()
        base_filter = [tracemalloc.Filter(False, tracemalloc.__file__)]
        for stat in snapshot.filter_traces(base_filter).statistics("lineno")[:8]:
            frame = stat.traceback[0]
            sites.append({
                "site": f"{os.path.relpath(frame.filename, REPO_ROOT)}:{frame.lineno}",
                "bytes": stat.size,
                "count": stat.count,
                "bytes_per_block": stat.size / blocks,
            })
        tracemalloc.stop()
        return sites


def _insert(engine, namespace_id: bytes, blocks: int, chain: int, mode: str) -> tuple[float, int]:
    """Put `blocks` blocks in chains of `chain` (reserve + commit, as the daemon does); (seconds, now_ms)."""
    from kvd.core.engine import CommitRequest, KeysRequest

    now_ms = 0
    counter = 0
    started = time.perf_counter()
    last_report = started
    while counter < blocks:
        length = min(chain, blocks - counter)
        keys = [_key(counter + i) for i in range(length)]
        counter += length
        reserved = engine.reserve(KeysRequest(namespace_id, CLIENT_ID, keys, 0, now_ms))
        lease = reserved.lease
        assert lease is not None and len(lease.handles) == length, "every key should be RESERVED"
        engine.commit(CommitRequest(namespace_id, CLIENT_ID, lease.lease_id, now_ms))
        now_ms += 1
        if time.perf_counter() - last_report > 5:
            last_report = time.perf_counter()
            progress(f"  [{mode}] inserted {counter:,}/{blocks:,} blocks")
    return time.perf_counter() - started, now_ms


def _measure_child(blocks: int, chain: int, mode: str, policy: str, ring_keys: int) -> dict:
    """Runs in a fresh interpreter: build, insert, measure, report JSON on stdout."""
    from kvd.core.block import BlockState
    from kvd.core.engine import Engine, EngineLimits
    from kvd.core.events import EventLog

    spec = _spec()
    limits = EngineLimits()
    meter = _Meter(mode == "tracemalloc")
    before_engine = meter.current("before_engine")
    events = EventLog(ring_keys=ring_keys) if ring_keys else EventLog()
    engine = Engine(host_slot_count=blocks, host_slot_bytes=spec.block_bytes, limits=limits, policy=policy,
                    events=events)
    state = engine.register_namespace(spec)
    after_engine = meter.current("after_engine")
    insert_seconds, now_ms = _insert(engine, state.namespace_id, blocks, chain, mode)
    # A running daemon prunes stale lease-deadline entries as time passes;
    # let every deadline pass so the measurement is the steady state.
    heap_entries_before_prune = len(engine.leases._deadlines)
    engine.expire(now_ms + limits.lease_ms_max + 1)
    after_insert = meter.current("after_insert")
    top_sites = meter.top_sites(blocks)

    # Sanity: the measured index really holds N sealed, unpinned blocks.
    assert len(state.index) == blocks
    assert engine.pinned_blocks == 0 and engine.live_handles == 0 and len(engine.leases) == 0
    assert all(block.state is BlockState.SEALED for block in state.index)

    result = {
        "mode": mode,
        "policy": policy,
        "blocks": blocks,
        "chain": chain,
        "insert_seconds": insert_seconds,
        "before_engine_bytes": before_engine,
        "after_engine_bytes": after_engine,
        "after_insert_bytes": after_insert,
        "insert_growth_bytes": after_insert - after_engine,
        "total_growth_bytes": after_insert - before_engine,
        "insert_bytes_per_block": (after_insert - after_engine) / blocks,
        "total_bytes_per_block": (after_insert - before_engine) / blocks,
        "stale_lease_heap_entries_pruned": heap_entries_before_prune,
        "top_allocation_sites": top_sites,
    }
    rounded = meter.rounded
    if rounded:
        result["rounded_insert_bytes_per_block"] = (rounded["after_insert"] - rounded["after_engine"]) / blocks
        result["rounded_total_bytes_per_block"] = (rounded["after_insert"] - rounded["before_engine"]) / blocks
    return result


def _run_child(blocks: int, chain: int, mode: str, policy: str, ring_keys: int = 1) -> dict:
    """ring_keys: the event ring's key bound (1: the ring kept out of the figure; 0: the default)."""
    command = [sys.executable, __file__, "--child", mode, "--sizes", str(blocks), "--chain", str(chain),
               "--policy", policy, "--ring-keys", str(ring_keys)]
    completed = subprocess.run(command, capture_output=True, text=True, check=False, cwd=REPO_ROOT)
    if completed.stderr:
        sys.stderr.write(completed.stderr)
    if completed.returncode != 0:
        raise RuntimeError(f"child {mode} N={blocks} failed with exit code {completed.returncode}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def _breakdown() -> dict:
    """Static view of what one block costs, object by object."""
    from kvd.core.block import Block
    from kvd.core.radix import PrefixIndex

    index = PrefixIndex("x", 1)
    block = Block(key=_key(0), index=index, parent=None)
    record = sys.getsizeof(block)
    key = sys.getsizeof(_key(0))
    slot_int = sys.getsizeof(1 << 20)

    dict_per_entry: dict[str, float] = {}
    for n in (100_000, 1_000_000):
        keys = [_key(i) for i in range(n)]
        table = dict.fromkeys(keys)
        dict_per_entry[str(n)] = sys.getsizeof(table) / n
        del table, keys
    return {
        "block_record_getsizeof": record,
        "block_record_allocated": _allocated(record),
        "block_record_slots": list(Block.__slots__),
        "key_getsizeof": key,
        "key_allocated": _allocated(key),
        "dict_bytes_per_entry": dict_per_entry,
        "host_pool_owner_entry": 8,
        "host_slot_int_getsizeof": slot_int,
        "host_slot_int_allocated": _allocated(slot_int),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 1_000_000])
    parser.add_argument("--chain", type=int, default=64, help="blocks per chain (one reserve+commit each)")
    parser.add_argument("--policy", choices=("lru", "s3fifo"), default="lru", help="host eviction policy")
    parser.add_argument("--no-ring-run", action="store_true", help="skip the run with the default event ring")
    parser.add_argument("--child", choices=("tracemalloc", "rss"), help=argparse.SUPPRESS)
    parser.add_argument("--ring-keys", type=int, default=1, help=argparse.SUPPRESS)
    return parser.parse_args()


def print_breakdown() -> dict:
    breakdown = _breakdown()
    report("breakdown of one block:")
    report(f"  Block record   sys.getsizeof = {breakdown['block_record_getsizeof']} B "
           f"(pymalloc class {breakdown['block_record_allocated']} B; "
           f"{len(breakdown['block_record_slots'])} slots + GC header)")
    report(f"  32-byte key    sys.getsizeof = {breakdown['key_getsizeof']} B "
           f"(pymalloc class {breakdown['key_allocated']} B)")
    for n, per in breakdown["dict_bytes_per_entry"].items():
        report(f"  dict entry     {per:.1f} B/entry at {int(n):,} entries (hash+key+value slot, index, 2/3 load)")
    report(f"  host pool      {breakdown['host_pool_owner_entry']} B owners-list entry + slot int "
           f"{breakdown['host_slot_int_getsizeof']} B (class {breakdown['host_slot_int_allocated']} B) per slot")

    return breakdown


def measure(args: argparse.Namespace) -> list[dict]:
    runs = []
    for blocks in args.sizes:
        for mode in ("tracemalloc", "rss"):
            progress(f"N={blocks:,}: measuring with {mode} (chains of {args.chain}, {args.policy} policy)")
            runs.append(_run_child(blocks, args.chain, mode, args.policy))

    report("")
    report("per-block growth (insert = after inserts - after engine build; +pool = also the host pool's")
    report("per-slot bookkeeping made when the engine is built). 'allocated' rounds every traced object")
    report("up to its pymalloc size class (16 B steps up to 512 B): what the allocator really hands out.")
    report(f"{'N':>10} {'method':>22} {'insert B/blk':>13} {'+pool B/blk':>12} {'insert s':>9}")
    for run in runs:
        report(f"{run['blocks']:>10,} {run['mode'] + ' (requested)' if run['mode'] == 'tracemalloc' else 'RSS':>22} "
               f"{run['insert_bytes_per_block']:>13.1f} {run['total_bytes_per_block']:>12.1f} "
               f"{run['insert_seconds']:>9.2f}")
        if "rounded_insert_bytes_per_block" in run:
            report(f"{run['blocks']:>10,} {'tracemalloc (allocated)':>22} "
                   f"{run['rounded_insert_bytes_per_block']:>13.1f} "
                   f"{run['rounded_total_bytes_per_block']:>12.1f}")

    return runs


def verdicts(args: argparse.Namespace, runs: list[dict]) -> tuple[list[dict], bool]:
    results = []
    all_pass = True
    for blocks in args.sizes:
        traced = next(r for r in runs if r["blocks"] == blocks and r["mode"] == "tracemalloc")
        rss = next(r for r in runs if r["blocks"] == blocks and r["mode"] == "rss")
        measured = traced["rounded_insert_bytes_per_block"]
        measured_pool = traced["rounded_total_bytes_per_block"]
        passed = measured <= TARGET_BYTES_PER_BLOCK
        pool_passed = measured_pool <= TARGET_BYTES_PER_BLOCK
        all_pass &= passed
        results.append({
            "blocks": blocks,
            "bytes_per_block": measured,
            "bytes_per_block_incl_host_pool": measured_pool,
            "requested_bytes_per_block": traced["insert_bytes_per_block"],
            "requested_bytes_per_block_incl_host_pool": traced["total_bytes_per_block"],
            "rss_bytes_per_block": rss["insert_bytes_per_block"],
            "rss_bytes_per_block_incl_host_pool": rss["total_bytes_per_block"],
            "ratio_to_target": measured / TARGET_BYTES_PER_BLOCK,
            "pass": passed,
            "pass_incl_host_pool": pool_passed,
            "insert_us_per_block_no_tracemalloc": rss["insert_seconds"] / blocks * 1e6,
        })
        report("")
        report(f"N={blocks:,}: {measured:.1f} B/block allocated ({traced['insert_bytes_per_block']:.1f} requested, "
               f"{rss['insert_bytes_per_block']:.1f} RSS) = {measured / TARGET_BYTES_PER_BLOCK:.2f}x of the "
               f"{TARGET_BYTES_PER_BLOCK} B target: {'PASS' if passed else 'FAIL'}")
        report(f"  incl. host-pool slot bookkeeping: {measured_pool:.1f} B/block allocated "
               f"({rss['total_bytes_per_block']:.1f} RSS): {'PASS' if pool_passed else 'FAIL'} (information)")
        report(f"  insert speed (reserve+commit, chains of {args.chain}, no tracemalloc): "
               f"{rss['insert_seconds'] / blocks * 1e6:.2f} us/block")
        report("  top allocation sites after insert (tracemalloc, requested bytes, whole process):")
        for site in traced["top_allocation_sites"]:
            report(f"    {site['bytes_per_block']:8.1f} B/block  {site['count']:>9,} objs  {site['site']}")

    return results, all_pass


def ring_run(args: argparse.Namespace, runs: list[dict]) -> dict:
    """The largest N once more with the default event ring: what the ring adds."""
    blocks = max(args.sizes)
    progress(f"N={blocks:,}: with the default event ring (tracemalloc)")
    with_ring = _run_child(blocks, args.chain, "tracemalloc", args.policy, ring_keys=0)
    without = next(r for r in runs if r["blocks"] == blocks and r["mode"] == "tracemalloc")
    added = (with_ring["rounded_insert_bytes_per_block"] - without["rounded_insert_bytes_per_block"]) * blocks
    ring = {"blocks": blocks, "bytes_per_block_with_ring": with_ring["rounded_insert_bytes_per_block"],
            "ring_bytes": added}
    report("")
    report(f"with the default event ring at N={blocks:,}: {ring['bytes_per_block_with_ring']:.1f} B/block; the "
           f"ring adds {added / (1 << 20):.1f} MiB, a fixed bound (events.ring_keys), not a per-block cost")
    return ring


def main() -> int:
    args = parse_args()
    if args.child:
        print(json.dumps(_measure_child(args.sizes[0], args.chain, args.child, args.policy, args.ring_keys)))
        return 0
    warn_if_busy()
    report("== bench_index_memory: engine bookkeeping per block (in-process, no arena) ==")
    breakdown = print_breakdown()
    runs = measure(args)
    results, all_pass = verdicts(args, runs)
    ring = None if args.no_ring_run else ring_run(args, runs)
    write_result("bench_index_memory", {
        "event_ring": ring,
        "target": {"metric": "memory growth per block from inserts (tracemalloc, pymalloc size classes)",
                   "max_bytes_per_block": TARGET_BYTES_PER_BLOCK},
        "pass": all_pass,
        "chain": args.chain,
        "policy": args.policy,
        "breakdown": breakdown,
        "results": results,
        "raw_runs": runs,
    })
    report("")
    report(f"overall: {'PASS' if all_pass else 'FAIL'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
