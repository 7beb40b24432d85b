#!/usr/bin/env python3
"""A Get from disk into the caller's array: streamed (GetBlocks) against unary, and against no copy.

    .venv/bin/python bench/bench_get_stream.py [--total-mib 1024] [--tokens 16 256] [--rounds 5]

A restore that ends in the caller's array is the daemon's disk read into its
arena, then the client's copy out of the arena. Over a unary Get the copy
starts once the last block has landed. get_numpy streams a large Get
instead (GetBlocks): the daemon reports runs of leading blocks as they are
verified and the client copies them while the rest are read, so only the
last runs' copy is left after the read.

One daemon (two disk directories, huge-page arena; bench/peers/kvd_driver.py
sets it up as bench_peers does) stores the blocks durably once. Each round
then makes the host tier cold (Demote), drops the page cache (as root) and
restores every block three ways, in an order that rotates:

* streamed: `Client.get_numpy(out=...)`, the default for a Get this large;
* unary: the same with streamed_get_min_bytes set past the Get's size;
* pinned: `Client.get_pinned`, the blocks left in the arena: the read
  alone, the floor for both.

Every restore is checked against the pattern after its timed section.
Reported: median GiB/s of each, streamed over unary, and streamed over
pinned (target: 0.9x or better, i.e. the copy adds at most a tenth to a
restore). The disk here is virtual and shared: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import kvd_driver  # noqa: E402
import protocol  # noqa: E402
from _common import REPO_ROOT, progress, ratio, report, write_result  # noqa: E402

from kvd.client import Client  # noqa: E402

LAYERS = 32
TOKEN_BYTES = 2 * kvd_driver.HEADS * kvd_driver.HEAD_DIM * kvd_driver.ITEM
TARGET_STREAMED_OVER_PINNED = 0.9
NEVER_STREAM = 1 << 62


def drop_page_cache() -> bool:
    """Drop the page cache where allowed (root). kvd reads with O_DIRECT, past the page cache;
    this only keeps the rounds alike for anything else on the machine."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError:
        return False
    return True


class Restores:
    """One daemon holding the workload on disk, and the three ways to restore it."""

    def __init__(self, workload: protocol.Workload) -> None:
        self.workload = workload
        self.kvd = kvd_driver.KvdContender(workload, disk=True)
        self.kvd.store({"fsync": "strict"})
        self.unary = Client(self.kvd.daemon.unix_target, streamed_get_min_bytes=NEVER_STREAM)
        self.unary_namespace = self.unary.register_namespace(self.kvd.spec)
        self.unary.arena_info()  # map the arena now, as kvd_driver's client did

    def run(self, mode: str) -> float:
        """Seconds of one cold restore in `mode`; the bytes checked afterwards."""
        kvd = self.kvd
        kvd.cold({})
        drop_page_cache()
        protocol.scramble(kvd.buffer)
        if mode == "pinned":
            seconds, held = protocol.timed(lambda: kvd.client.get_pinned(kvd.namespace, kvd.keys))
            with held:
                matched = held.copy_to(kvd.blocks).shape[0]
        else:
            client, namespace = (kvd.client, kvd.namespace) if mode == "streamed" else (
                self.unary, self.unary_namespace)
            seconds, got = protocol.timed(lambda: client.get_numpy(namespace, kvd.keys, out=kvd.blocks))
            matched = got.shape[0]
        if matched != len(kvd.keys) or not protocol.check(kvd.buffer, self.workload.seed):
            raise SystemExit(f"{mode}: the restore came back wrong ({matched} of {len(kvd.keys)} blocks)")
        return seconds

    def close(self) -> None:
        self.unary.close()
        self.kvd.stop()


def measure(tokens: int, total_mib: int, rounds: int, directory: Path) -> dict:
    layer_bytes = tokens * TOKEN_BYTES
    blocks = (total_mib << 20) // (LAYERS * layer_bytes)
    workload = protocol.Workload(dir=str(directory), layers=LAYERS, layer_bytes=layer_bytes, blocks=blocks)
    modes = ["streamed", "unary", "pinned"]
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    restores = Restores(workload)
    try:
        for round_ in range(rounds):
            order = modes[round_ % len(modes):] + modes[:round_ % len(modes)]
            for mode in order:
                seconds[mode].append(restores.run(mode))
            progress(f"{tokens} tokens, round {round_ + 1}/{rounds}: " + ", ".join(
                f"{mode} {workload.total_bytes / seconds[mode][-1] / 2**30:.2f} GiB/s" for mode in modes))
    finally:
        restores.close()
    gib_s = {mode: workload.total_bytes / statistics.median(values) / 2**30 for mode, values in seconds.items()}
    return {
        "block_bytes": workload.block_bytes, "blocks": blocks,
        "median_gib_s": gib_s,
        "gib_s": {mode: [workload.total_bytes / s / 2**30 for s in values] for mode, values in seconds.items()},
        "streamed_over_unary": ratio(gib_s["streamed"], gib_s["unary"]),
        "streamed_over_pinned": ratio(gib_s["streamed"], gib_s["pinned"]),
        "unary_over_pinned": ratio(gib_s["unary"], gib_s["pinned"]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--tokens", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the daemon's drives go (default: a temp dir under the "
                        "repository)")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="kvd-get-stream-", dir=args.dir or REPO_ROOT))
    results = {}
    try:
        for tokens in args.tokens:
            results[f"tokens{tokens}"] = measure(tokens, args.total_mib, args.rounds, directory / f"t{tokens}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    report(f"{'block':>10} {'streamed':>9} {'unary':>9} {'pinned':>9} {'str/unary':>10} {'str/pinned':>11}")
    met = True
    for name, result in results.items():
        gib_s = result["median_gib_s"]
        met = met and result["streamed_over_pinned"] >= TARGET_STREAMED_OVER_PINNED
        report(f"{name:>10} {gib_s['streamed']:>9.2f} {gib_s['unary']:>9.2f} {gib_s['pinned']:>9.2f} "
               f"{result['streamed_over_unary']:>9.2f}x {result['streamed_over_pinned']:>10.2f}x")
    report(f"target: streamed >= {TARGET_STREAMED_OVER_PINNED}x of pinned at every block size: "
           f"{'met' if met else 'MISSED'}")
    write_result("bench_get_stream", {
        "parameters": {"total_mib": args.total_mib, "tokens": args.tokens, "rounds": args.rounds},
        "page_cache_dropped": drop_page_cache(),
        "targets": {"streamed_over_pinned": TARGET_STREAMED_OVER_PINNED}, "pass": met, "results": results,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
