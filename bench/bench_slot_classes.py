"""Two models of different block sizes sharing one host tier: slot classes vs one slot size.

What: an in-process kvd.core.engine.Engine (the daemon's bookkeeping, no
payload bytes) with host memory of `--pages` pages of 2 MiB, serving two
models at once: one with 2 MiB blocks (a Llama-8B-like layout at 16 tokens
per block) and one with 64 KiB blocks (a small model), the README's example
of a block that fills 3% of a 2 MiB slot. Each request picks a model, then
a prompt by Zipf popularity among `--prompts` per model, Gets its stored
prefix and Puts the rest (chains of `--chain` blocks), as an engine's
connector does.

Contenders, on the same trace in the same process, interleaved request by
request: one slot size (every block takes a 2 MiB slot, kvd before slot
classes) and slot classes from 2 MiB down to 64 KiB.

Reported: the hit rate (blocks served from host memory over blocks asked
for) per model and overall; bytes stored (the blocks' own sizes) against
bytes used (the slots they take), sampled every `--sample-every` requests.

Run: .venv/bin/python bench/bench_slot_classes.py [--requests 20000] [--pages 256]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import progress, report, write_result  # noqa: E402

PAGE_BYTES = 2 << 20
MIN_SLOT_BYTES = 64 << 10
CLIENT = "bench"


def specs():
    from kvd.core.keys import NamespaceSpec

    big = NamespaceSpec(model_id="big-8b", num_layers=32, num_kv_heads=8, head_dim=128, block_tokens=16)
    small = NamespaceSpec(model_id="small-1b", num_layers=8, num_kv_heads=2, head_dim=64, block_tokens=16)
    assert big.block_bytes == PAGE_BYTES and small.block_bytes == MIN_SLOT_BYTES, (big.block_bytes, small.block_bytes)
    return big, small


class Contender:
    """One engine serving both models; counts what each Get found."""

    def __init__(self, name: str, pages: int, min_slot_bytes: int) -> None:
        from kvd.core.engine import Engine

        self.name = name
        self.engine = Engine(host_slot_count=pages, host_slot_bytes=PAGE_BYTES, host_min_slot_bytes=min_slot_bytes)
        self.namespaces = [self.engine.register_namespace(spec).namespace_id for spec in specs()]
        self.asked = [0, 0]
        self.hit = [0, 0]
        self.use_samples: list[float] = []

    def request(self, model: int, keys: list[bytes], now_ms: int) -> None:
        from kvd.core.engine import CommitRequest, KeysRequest
        from kvd.testing import engine_ops

        namespace_id = self.namespaces[model]
        lease, matched = engine_ops.get(self.engine, KeysRequest(namespace_id, CLIENT, keys, 0, now_ms))
        self.asked[model] += len(keys)
        self.hit[model] += len(matched)
        if lease is not None:
            self.engine.release(CLIENT, [lease.lease_id])
        reserved = self.engine.reserve(KeysRequest(namespace_id, CLIENT, keys, 0, now_ms))
        if reserved.lease is not None:
            self.engine.commit(CommitRequest(namespace_id, CLIENT, reserved.lease.lease_id, now_ms))

    def sample(self) -> None:
        """Bytes the stored blocks hold over the bytes of the slots they take."""
        pool = self.engine.host.pool
        if pool.owned_bytes:
            self.use_samples.append(pool.used_bytes / pool.owned_bytes)

    def result(self) -> dict:
        asked, hit = self.asked, self.hit
        pool = self.engine.host.pool
        return {
            "hit_rate": sum(hit) / max(1, sum(asked)),
            "hit_rate_big": hit[0] / max(1, asked[0]),
            "hit_rate_small": hit[1] / max(1, asked[1]),
            "stored_over_used_median": statistics.median(self.use_samples) if self.use_samples else 0.0,
            "stored_bytes_end": pool.used_bytes,
            "used_bytes_end": pool.owned_bytes,
            "capacity_bytes": pool.page_count * pool.page_bytes,
            "blocks_end": pool.resident_blocks,
            "evictions": self.engine.host.counters.evictions,
        }


def trace(args: argparse.Namespace):
    """(model, keys) per request: a model by --small-share, a prompt by Zipf among that model's prompts."""
    from kvd.core.keys import chain_keys

    rng = np.random.default_rng(args.seed)
    model_specs = specs()
    prompts = [[chain_keys(spec, rng.integers(0, 1 << 31, size=args.chain * spec.block_tokens))
                for _ in range(args.prompts)] for spec in model_specs]
    ranks = np.arange(1, args.prompts + 1, dtype=np.float64)
    weights = ranks ** -args.zipf
    weights /= weights.sum()
    for _ in range(args.requests):
        model = int(rng.random() < args.small_share)
        yield model, prompts[model][int(rng.choice(args.prompts, p=weights))]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--pages", type=int, default=256, help="host memory in 2 MiB pages")
    parser.add_argument("--prompts", type=int, default=400, help="distinct prompts per model")
    parser.add_argument("--chain", type=int, default=8, help="blocks per prompt")
    parser.add_argument("--zipf", type=float, default=0.9, help="popularity skew of the prompts")
    parser.add_argument("--small-share", type=float, default=0.5, help="share of requests for the small model")
    parser.add_argument("--sample-every", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    contenders = [Contender("one slot size (2 MiB)", args.pages, PAGE_BYTES),
                  Contender("slot classes (2 MiB .. 64 KiB)", args.pages, MIN_SLOT_BYTES)]
    report(f"== bench_slot_classes: two models (2 MiB and 64 KiB blocks) in {args.pages} pages of 2 MiB, "
           f"{args.requests} requests, {args.prompts} prompts per model of {args.chain} blocks, Zipf {args.zipf} ==")
    for number, (model, keys) in enumerate(trace(args), start=1):
        for contender in contenders:
            contender.request(model, keys, number)
        if number % args.sample_every == 0:
            for contender in contenders:
                contender.sample()
        if number % 5000 == 0:
            progress(f"  {number:,}/{args.requests:,} requests")
    results = {contender.name: contender.result() for contender in contenders}
    for contender in contenders:
        contender.engine.verify()
    report(f"{'contender':<32} {'hit rate':>9} {'big':>7} {'small':>7} {'stored/used':>12} {'blocks':>7}")
    for name, result in results.items():
        report(f"{name:<32} {result['hit_rate']:>9.1%} {result['hit_rate_big']:>7.1%} "
               f"{result['hit_rate_small']:>7.1%} {result['stored_over_used_median']:>12.1%} {result['blocks_end']:>7}")
    one, classes = (results[contender.name] for contender in contenders)
    ratios = {
        "hit_rate_classes_over_one_size": classes["hit_rate"] / max(1e-9, one["hit_rate"]),
        "small_hit_rate_classes_over_one_size": classes["hit_rate_small"] / max(1e-9, one["hit_rate_small"]),
        "big_hit_rate_classes_over_one_size": classes["hit_rate_big"] / max(1e-9, one["hit_rate_big"]),
        "stored_over_used_classes_over_one_size":
            classes["stored_over_used_median"] / max(1e-9, one["stored_over_used_median"]),
    }
    report("ratios, slot classes over one slot size: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    write_result("bench_slot_classes", {"settings": vars(args), "results": results, "ratios": ratios})
    return 0


if __name__ == "__main__":
    sys.exit(main())
