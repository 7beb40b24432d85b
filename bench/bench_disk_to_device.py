#!/usr/bin/env python3
"""A disk hit into an engine's pool: layer by layer as it lands, against disk -> host -> device.

A real daemon (another process) with a disk tier on real files (O_DIRECT, the native io_uring
engine) and a device plane; this process plays the engine, with a paged KV pool registered through
RegisterPool. Each round stores `--blocks` blocks durably, demotes every host copy (the blocks are
then only on disk), and loads them into the pool two ways, alternating:

- as read (what LoadLayers does now): one LoadLayers; the daemon reads the blocks in extents of
  whole layers, checks each layer's CRC-32C, and issues that layer's copy into the pages and its
  flag as soon as it has landed for every block;
- via host (the path before, as a baseline through the public API): a Get that reads the whole
  blocks into host memory, then a LoadLayers from there;
- by ring (a pool registered with io_ring, the GPU-initiated path): LoadLayers grants the blocks'
  reads, this process publishes them into the pool's I/O ring (io_ring_publish, the submit
  kernel's host code) and waits per layer (the wait kernel's code); kvd's proxy reads the drives
  into staging, checks each layer's CRC-32C and copies it into the page. No host slot is taken.

Printed: the time until the engine may use layer 0 (its flag) and until every layer is in the pages,
median over rounds, and the ratios via-host / as-read and via-host / by-ring. The disk is this machine's (shared, its host
caches even O_DIRECT reads): only the ratio between the two paths in one run means anything. On
the CPU device (no GPU here) the copies are memcpy by the CPU device's stream; no GPU figure.

Run: .venv/bin/python bench/bench_disk_to_device.py [--blocks 64] [--layers 32] [--rounds 5]
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

from _common import progress, ratio, report, write_result  # noqa: E402

from kvd.arena_protocol import socket_path_for_target  # noqa: E402
from kvd.client import Client  # noqa: E402
from kvd.client.device import FAILED, DevicePool  # noqa: E402
from kvd.core.keys import DType, NamespaceSpec, chain_keys  # noqa: E402
from kvd.device import open_device  # noqa: E402
from kvd.testing.daemon import run_daemon  # noqa: E402

KVD_FLAG = 1
PATHS = ("as read", "via host", "by ring")


def daemon_config(work: Path, block_bytes: int, blocks: int) -> dict:
    slot = block_bytes
    return {"host": {"capacity_bytes": 2 * blocks * slot + (64 << 20), "slot_bytes": slot},
            "disk": {"directories": [str(work / "nvme0")], "capacity_bytes": (4 * blocks * slot // (64 << 20) + 4) * (64 << 20),
                     "segment_bytes": 64 << 20, "slot_bytes": slot, "write_mode": "through", "fsync": "none"},
            "device": {"kind": "cpu", "flag_timeout_ms": 10000, "pool_lease_ms": 600000}}


class EnginePool:
    """The engine's paged pool on the CPU device: `pages` pages per layer."""

    def __init__(self, client: Client, spec: NamespaceSpec, pages: int, arena_socket: Path | None = None) -> None:
        """arena_socket: the pool reads disk hits through its I/O ring (handed over that socket)."""
        self.device = open_device("cpu")
        self.namespace = client.register_namespace(spec)
        self.layers = [self.device.alloc(pages * spec.layer_bytes) for _ in range(spec.num_layers)]
        self.pool = DevicePool(client, self.namespace, self.device, self.layers, pages, arena_socket=arena_socket,
                               io_ring=arena_socket is not None)

    def page(self, layer: int, page: int, layer_bytes: int) -> bytes:
        memory = self.layers[layer]
        view = (np.ctypeslib.ctypes.c_uint8 * memory.nbytes).from_address(memory.address)
        return bytes(view[page * layer_bytes:(page + 1) * layer_bytes])


def wait_flag(pool: DevicePool, value: int, started: float) -> float:
    """Seconds from `started` until kvd's flag word reaches `value` (spinning: it is what we time)."""
    while (flag := pool.flag(KVD_FLAG)) < value:
        pass
    if flag >= FAILED:
        raise RuntimeError(f"the load failed (flag {flag:#x})")
    return time.perf_counter() - started


def one_load(client: Client, engine: EnginePool, keys, pages, via_host: bool) -> tuple[float, float]:
    """(seconds to layer 0's flag, seconds to the last layer's) for one load of blocks only on disk."""
    pool = engine.pool
    base = pool.flag(KVD_FLAG) & ~FAILED
    started = time.perf_counter()
    # Via host: the blocks read into host memory and pinned there (no copy out), then loaded.
    pinned = client.get_pinned(engine.namespace, keys) if via_host else None
    try:
        loaded = pool.load(keys, pages, KVD_FLAG, base)
        if loaded.matched != len(keys):
            raise RuntimeError(f"{loaded.matched} of {len(keys)} blocks found")
        first = wait_flag(pool, base + 1, started)
        return first, wait_flag(pool, loaded.done_value, started)
    finally:
        if pinned is not None:
            pinned.release()


def ring_load(engine: EnginePool, keys, pages) -> tuple[float, float]:
    """The same through the pool's I/O ring: the reads published at once, each layer waited for."""
    pool = engine.pool
    started = time.perf_counter()
    loaded = pool.load(keys, pages, KVD_FLAG, pool.flag(KVD_FLAG) & ~FAILED)
    reads = pool.ring_reads(loaded)
    if loaded.matched != len(keys) or reads is None or reads.blocks != len(keys):
        raise RuntimeError(f"{loaded.matched} of {len(keys)} blocks found, "
                           f"{reads.blocks if reads else 0} through the ring")
    reads.publish()
    times = []
    for layer in range(len(engine.layers)):
        result = reads.wait(layer, timeout_s=60)
        if not result.ok:
            raise RuntimeError(f"the ring's reads of layer {layer} ended {result.state.name}")
        times.append(time.perf_counter() - started)
    return times[0], times[-1]


def run(args) -> dict:
    spec = NamespaceSpec(model_id="bench-disk-to-device", num_layers=args.layers, num_kv_heads=8, head_dim=128,
                         block_tokens=16, kv_dtype=DType.FLOAT16)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in PATHS}
    with tempfile.TemporaryDirectory(prefix="kvd-bench-d2d-") as scratch:
        work = Path(scratch)
        with run_daemon(work / "kvd", config=daemon_config(work, spec.block_bytes, args.blocks)) as daemon, \
                Client(daemon.unix_target) as client:
            engines = {"plain": EnginePool(client, spec, args.blocks),
                       "ring": EnginePool(client, spec, args.blocks, socket_path_for_target(daemon.unix_target))}
            rng = np.random.default_rng(1)
            for round_ in range(args.rounds):
                for name in PATHS[round_ % 3:] + PATHS[:round_ % 3]:  # each goes first in turn
                    engine = engines["ring" if name == "by ring" else "plain"]
                    keys = chain_keys(spec, np.arange(args.blocks * spec.block_tokens) + 10_000_000 * len(times[name])
                                      + 3_000_000 * PATHS.index(name))
                    data = rng.standard_normal((args.blocks, *spec.block_shape), dtype=np.float32).astype(np.float16)
                    client.put(engine.namespace, keys, data, durable=True)
                    client.demote()
                    progress(f"round {round_ + 1}/{args.rounds}: {name}, {args.blocks} blocks of "
                             f"{spec.block_bytes >> 10} KiB only on disk")
                    pages = rng.permutation(args.blocks)
                    times[name].append(ring_load(engine, keys, pages.tolist()) if name == "by ring" else
                                       one_load(client, engine, keys, pages.tolist(), name == "via host"))
                    check = int(rng.integers(args.blocks))
                    layer = int(rng.integers(args.layers))
                    expected = data[check].tobytes()[layer * spec.layer_bytes:(layer + 1) * spec.layer_bytes]
                    if engine.page(layer, int(pages[check]), spec.layer_bytes) != expected:
                        raise RuntimeError(f"{name}: block {check} layer {layer} is not the stored bytes")
            for engine in engines.values():
                engine.pool.close()
    return {name: {"first_layer_s": statistics.median(t[0] for t in rows),
                   "all_layers_s": statistics.median(t[1] for t in rows)} for name, rows in times.items()} | {
        "block_bytes": spec.block_bytes}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    result = run(args)
    as_read, via_host, by_ring = result["as read"], result["via host"], result["by ring"]
    mib = args.blocks * result["block_bytes"] / 2**20
    report(f"A disk hit into an engine's pool ({args.blocks} blocks, {args.layers} layers, {mib:.0f} MiB; "
           f"CPU device; median of {args.rounds} rounds each)")
    report(f"{'path':<10} {'layer 0 usable':>15} {'all layers':>11}")
    for name in PATHS:
        report(f"{name:<10} {result[name]['first_layer_s'] * 1e3:>13.1f}ms {result[name]['all_layers_s'] * 1e3:>9.1f}ms")
    ratios = {}
    for name, path in (("as_read", as_read), ("by_ring", by_ring)):
        ratios[name] = {"first_layer": ratio(via_host["first_layer_s"], path["first_layer_s"]),
                        "all_layers": ratio(via_host["all_layers_s"], path["all_layers_s"])}
        report(f"via host / {name.replace('_', ' ')}: layer 0 {ratios[name]['first_layer']:.2f}x, "
               f"all layers {ratios[name]['all_layers']:.2f}x")
    write_result("bench_disk_to_device", {
        "settings": vars(args) | {"device": "cpu", "block_bytes": result["block_bytes"]},
        "results": {name: result[name] for name in PATHS},
        "via_host_over_as_read": ratios["as_read"],
        "via_host_over_by_ring": ratios["by_ring"],
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
