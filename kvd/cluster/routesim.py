"""Routing simulation: where a cluster's prompt tokens come from, per routing policy and size.

`python -m kvd.cluster.routesim --nodes 4,16,64` drives N nodes, each with
a host tier of `--blocks-per-node` blocks (LRU, leaves out first, so each
node's cache stays prefix-closed as kvd's index does), with a stream of
requests: prompt families of Zipf popularity (a shared prefix of 8-512
blocks, a system prompt or a document) each followed by a unique suffix.
Each request's blocks come from one of three places, in this order:

- local: the longest prefix the serving node holds;
- remote: what another node holds beyond that (kvd's fetch on Get, found
  through the directory), when the policy uses the cluster;
- recomputed: the rest (prefill).

Policies:

- `random`: a random node, nothing shared between nodes (N separate caches);
- `random+fetch`: a random node that fetches from peers (kvd's cluster tier);
- `kv-aware+fetch`: the node ClusterLookup reports with the longest match,
  among nodes under 1.25x the mean load (bounded load, so one hot family
  does not pile onto one node), then fetch as above.

A modelled network turns the shares into a prefill-time proxy per request:
recomputing a block costs 1, fetching one from a peer `--fetch-cost`
(default 0.05: a 16-token block of an 8B model is about 2 MiB, about
0.2 ms at 10 GB/s, against about 4 ms of prefill), reading a local one
`--local-cost` (0.005). The table gives the share of prompt blocks per
source, the mean cost per request relative to recomputing everything, and
the load imbalance (busiest node / mean). --json and --plot write them.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

POLICIES = ("random", "random+fetch", "kv-aware+fetch")
LOAD_BOUND = 1.25


@dataclass(frozen=True, slots=True)
class Workload:
    requests: int = 6000
    blocks_per_node: int = 4096
    families: int = 64
    zipf_s: float = 1.1
    prefix_blocks: tuple[int, int] = (8, 512)
    suffix_mean_blocks: float = 64.0
    fetch_cost: float = 0.05
    local_cost: float = 0.005


@dataclass(slots=True)
class Row:
    nodes: int
    policy: str
    local: float
    remote: float
    recomputed: float
    cost_vs_recompute: float
    load_max_over_mean: float


class Node:
    """An LRU cache of block ids; a chain is touched leaf first, so parents stay newer."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[tuple, None] = OrderedDict()
        self.load = 0

    def match(self, chain: list[tuple]) -> int:
        """Longest held prefix (binary search: the cache is prefix-closed)."""
        low, high = 0, len(chain)
        while low < high:
            middle = (low + high + 1) // 2
            if chain[middle - 1] in self.blocks:
                low = middle
            else:
                high = middle - 1
        return low

    def store(self, chain: list[tuple]) -> None:
        for block in reversed(chain):
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class Trace:
    def __init__(self, work: Workload, seed: int) -> None:
        self.rng = random.Random(seed)
        self.work = work
        low, high = work.prefix_blocks
        self.prefix_lengths = [self.rng.randint(low, high) for _ in range(work.families)]
        weights = [rank ** -work.zipf_s for rank in range(1, work.families + 1)]
        total = sum(weights)
        self.weights = [w / total for w in weights]
        self.serial = 0

    def request(self) -> list[tuple]:
        family = self.rng.choices(range(self.work.families), self.weights)[0]
        self.serial += 1
        suffix = max(1, int(self.rng.expovariate(1 / self.work.suffix_mean_blocks)))
        return ([("f", family, i) for i in range(self.prefix_lengths[family])]
                + [("u", self.serial, i) for i in range(suffix)])


def _choose(policy: str, nodes: list[Node], chain: list[tuple], rng: random.Random) -> int:
    if policy != "kv-aware+fetch":
        return rng.randrange(len(nodes))
    mean = sum(node.load for node in nodes) / len(nodes)
    bound = LOAD_BOUND * mean + 1
    eligible = [i for i, node in enumerate(nodes) if node.load <= bound]
    matches = {i: nodes[i].match(chain) for i in eligible}
    best = max(matches.values())
    return min((i for i in eligible if matches[i] == best), key=lambda i: (nodes[i].load, rng.random()))


def simulate(size: int, policy: str, work: Workload, seed: int) -> Row:
    trace, rng = Trace(work, seed), random.Random(seed + 1)
    nodes = [Node(work.blocks_per_node) for _ in range(size)]
    local = remote = recomputed = 0
    for _ in range(work.requests):
        chain = trace.request()
        chosen = _choose(policy, nodes, chain, rng)
        node = nodes[chosen]
        here = node.match(chain)
        there = here
        if policy != "random":
            there = max([here] + [other.match(chain) for i, other in enumerate(nodes) if i != chosen])
        local += here
        remote += there - here
        recomputed += len(chain) - there
        node.load += 1
        node.store(chain)
    total = local + remote + recomputed
    cost = (local * work.local_cost + remote * work.fetch_cost + recomputed) / total
    loads = [node.load for node in nodes]
    return Row(size, policy, local / total, remote / total, recomputed / total, cost,
               max(loads) / (sum(loads) / len(loads)))


def table(rows: list[Row], work: Workload) -> str:
    lines = [
        f"{work.requests} requests, {work.families} prompt families (Zipf {work.zipf_s}), "
        f"{work.blocks_per_node} blocks per node; cost: recompute 1, fetch {work.fetch_cost}, "
        f"local {work.local_cost} per block",
        "",
        "| nodes | policy | local | remote | recomputed | prefill cost vs recomputing all | load max/mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r.nodes} | {r.policy} | {r.local:.1%} | {r.remote:.1%} | {r.recomputed:.1%} "
                     f"| {r.cost_vs_recompute:.3f} | {r.load_max_over_mean:.2f} |")
    return "\n".join(lines)


def write_plot(path: Path, rows: list[Row]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r.nodes for r in rows})
    fig, axes = plt.subplots(1, len(sizes), figsize=(4.5 * len(sizes), 4), sharey=True, squeeze=False)
    for ax, size in zip(axes[0], sizes):
        picked = [r for r in rows if r.nodes == size]
        names = [r.policy for r in picked]
        bottom = [0.0] * len(picked)
        for source, color in (("local", "#2a9d8f"), ("remote", "#e9c46a"), ("recomputed", "#e76f51")):
            values = [getattr(r, source) for r in picked]
            ax.bar(names, values, bottom=bottom, color=color, label=source)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(f"{size} nodes", fontsize=10)
        ax.tick_params(axis="x", labelsize=8)
    axes[0][0].set_ylabel("share of prompt blocks")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    defaults = Workload()
    p = argparse.ArgumentParser(prog="python -m kvd.cluster.routesim", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="4,16,64", help="cluster sizes, comma-separated")
    p.add_argument("--requests", type=int, default=defaults.requests)
    p.add_argument("--blocks-per-node", type=int, default=defaults.blocks_per_node)
    p.add_argument("--families", type=int, default=defaults.families)
    p.add_argument("--fetch-cost", type=float, default=defaults.fetch_cost)
    p.add_argument("--local-cost", type=float, default=defaults.local_cost)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path)
    p.add_argument("--plot", type=Path)
    args = p.parse_args(argv)
    work = Workload(requests=args.requests, blocks_per_node=args.blocks_per_node, families=args.families,
                    fetch_cost=args.fetch_cost, local_cost=args.local_cost)
    runs = [(int(n), policy) for n in args.nodes.split(",") for policy in POLICIES]
    rows = []
    for i, (size, policy) in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {size} nodes, {policy}", file=sys.stderr, flush=True)
        rows.append(simulate(size, policy, work, args.seed))
    print(table(rows, work))
    if args.json:
        args.json.write_text(json.dumps({"workload": asdict(work), "rows": [asdict(r) for r in rows]}, indent=2))
    if args.plot:
        write_plot(args.plot, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
