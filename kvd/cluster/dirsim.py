"""Directory simulation: load, memory and messages of the cluster directory at 10-1,000 nodes.

`python -m kvd.cluster.dirsim --nodes 10,100,1000` fills N nodes with
chains the way a serving cluster would (families of shared prefixes with
Zipf popularity, each request adding a unique suffix, placed on a random
node) and then measures, with kvd.cluster.placement's real segment cuts and
rendezvous owners:

- memory: directory entries per owner (mean and max) and bytes, from the
  per-entry cost of a real DirectoryShard measured with tracemalloc;
- lookups: owners asked per lookup (the messages of its one round trip),
  and how unevenly lookups land on owners (max / mean over nodes);
- updates: owners told per stored request;
- membership: the share of entries that move when one node joins or leaves.

It compares segment lengths (the `segment_blocks` of placement) with
partitioning by whole chain (one owner per chain root). Chains are random
keys cut by the same anchor rule as SHA-256 chain keys, and shared prefixes
are stored once per node. Progress goes to stderr; --json and --plot write
the numbers and a figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import tracemalloc
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from kvd.cluster.directory import DirectoryShard
from kvd.cluster.placement import Rendezvous

# segment_blocks meaning "the whole chain is one segment" (anchors at roots only).
WHOLE_CHAIN = 0


@dataclass(frozen=True, slots=True)
class Workload:
    blocks_per_node: int = 2048
    families_per_node: float = 0.5
    zipf_s: float = 1.1
    prefix_blocks: tuple[int, int] = (8, 512)
    suffix_mean_blocks: float = 200.0
    max_chain_blocks: int = 8000
    lookups: int = 2000
    max_holders: int = 4
    replicas: int = 1


@dataclass(slots=True)
class Row:
    nodes: int
    segment: str
    replicas: int
    entries_mean: float
    entries_max: int
    entry_bytes_max: int
    lookup_msgs_mean: float
    lookup_msgs_p99: float
    lookup_load_max_over_mean: float
    update_msgs_mean: float
    moved_on_join: float
    moved_on_leave: float


class Chains:
    """Chain segments: for each chain, its segments as (anchor id, length)."""

    def __init__(self, rng: np.random.Generator, work: Workload, families: int, segment_blocks: int) -> None:
        self.rng, self.work, self.segment_blocks = rng, work, segment_blocks
        low, high = work.prefix_blocks
        self.family_words = [self._words(int(rng.integers(low, high + 1))) for _ in range(families)]
        ranks = np.arange(1, families + 1, dtype=float)
        weights = ranks ** -work.zipf_s
        self.popularity = weights / weights.sum()

    def _words(self, n: int) -> np.ndarray:
        """(id, anchor word) per key of n fresh random keys."""
        return self.rng.integers(0, 2**63, size=(n, 2), dtype=np.int64).astype(np.uint64)

    def request(self) -> tuple[int, np.ndarray]:
        family = int(self.rng.choice(len(self.popularity), p=self.popularity))
        suffix = max(1, int(self.rng.exponential(self.work.suffix_mean_blocks)))
        prefix = self.family_words[family]
        suffix = min(suffix, self.work.max_chain_blocks - len(prefix))
        return family, np.concatenate([prefix, self._words(max(suffix, 1))])

    def cut(self, words: np.ndarray) -> list[tuple[int, int, int]]:
        """(anchor id, start, end) of each segment of a chain's words."""
        if self.segment_blocks == WHOLE_CHAIN:
            starts = [0]
        else:
            marks = (words[:, 1] & np.uint64(0xFFFFFFFF)) % np.uint64(self.segment_blocks) == 0
            starts = [0, *[int(i) for i in np.flatnonzero(marks) if i]]
        ends = [*starts[1:], len(words)]
        return [(int(words[s, 0]), s, e) for s, e in zip(starts, ends)]


def entry_bytes(holders: int, count: int = 50_000) -> float:
    """Bytes per entry of a real DirectoryShard with `holders` nodes per entry (tracemalloc)."""
    rng = np.random.default_rng(7)
    keys = [bytes(row) for row in rng.integers(0, 256, size=(count, 32), dtype=np.uint8)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    shard = DirectoryShard(max_holders=holders)
    for h in range(holders):
        shard.add(f"node-{h}", keys)
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del keys  # the keys' own bytes objects count: the shard keeps them alive
    return used / len(shard)


class _Fill:
    """One cluster filled with chains; the directory's records of it."""

    def __init__(self, nodes: int, segment_blocks: int, work: Workload, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.work = work
        self.members = [f"node-{i}" for i in range(nodes)]
        self.hrw = Rendezvous(self.members)
        families = max(8, int(nodes * work.families_per_node))
        self.chains = Chains(self.rng, work, families, segment_blocks)
        # Unique (suffix) entries per (owner, anchor); prefix groups per (family, anchor).
        self.unique: dict[int, int] = {}
        self.prefix_groups: dict[tuple[int, int], int] = {}
        self.family_holders = np.zeros(families, dtype=np.int64)
        self.update_msgs: list[int] = []

    def owners(self, anchors: list[int]) -> list[list[int]]:
        """Each anchor's replica set (indices into members)."""
        return self.hrw.replica_indices(np.array(anchors, dtype=np.uint64), self.work.replicas).tolist()

    def run(self) -> None:
        for _node in range(len(self.members)):
            held, families = 0, set()
            while held < self.work.blocks_per_node:
                family, words = self.chains.request()
                prefix_len = len(self.chains.family_words[family])
                new_prefix = family not in families
                if new_prefix:
                    families.add(family)
                    self.family_holders[family] += 1
                held += len(words) - (0 if new_prefix else prefix_len)
                self._record(family, words, prefix_len, new_prefix)

    def _record(self, family: int, words: np.ndarray, prefix_len: int, new_prefix: bool) -> None:
        cut = self.chains.cut(words)
        told = set()
        for (anchor, start, end), owners in zip(cut, self.owners([a for a, _, _ in cut])):
            if start < prefix_len:
                self.prefix_groups[(family, anchor)] = min(end, prefix_len) - start
                if new_prefix:
                    told.update(owners)
            if end > prefix_len:
                self.unique[anchor] = self.unique.get(anchor, 0) + end - max(start, prefix_len)
                told.update(owners)
        self.update_msgs.append(len(told))

    def entry_records(self) -> tuple[np.ndarray, np.ndarray]:
        """(anchor ids, entries) of every group of directory entries."""
        cap = self.work.max_holders
        anchors = list(self.unique) + [anchor for _, anchor in self.prefix_groups]
        entries = list(self.unique.values()) + [
            length * min(int(self.family_holders[family]), cap) for (family, _), length in self.prefix_groups.items()]
        return np.array(anchors, dtype=np.uint64), np.array(entries, dtype=np.int64)


def _lookups(fill: _Fill) -> tuple[np.ndarray, np.ndarray]:
    """Owners asked per lookup (one replica of each segment, at random), and lookups received per node."""
    load = np.zeros(len(fill.members), dtype=np.int64)
    msgs = []
    for _ in range(fill.work.lookups):
        _, words = fill.chains.request()
        replicas = fill.owners([anchor for anchor, _, _ in fill.chains.cut(words)])
        owners = {choices[0] if len(choices) == 1 else choices[int(fill.rng.integers(len(choices)))]
                  for choices in replicas}
        msgs.append(len(owners))
        load[list(owners)] += 1
    return np.array(msgs), load


def _moved(fill: _Fill, anchors: np.ndarray, entries: np.ndarray, owners: np.ndarray) -> tuple[float, float]:
    """Share of (replicated) entries that move when one node joins, and when one leaves."""
    r = owners.shape[1]
    total = entries.sum() * r
    joined = Rendezvous([*fill.members, "node-joining"])
    after_join = np.array(joined.members)[joined.replica_indices(anchors, r)]
    before = np.array(fill.hrw.members)[owners]
    new_copies = (after_join == "node-joining").any(axis=1)  # each such set gains one replica
    on_join = entries[new_copies].sum() / total
    leaver = fill.hrw.members[0]
    on_leave = entries[(before == leaver).any(axis=1)].sum() / total
    return float(on_join), float(on_leave)


def simulate(nodes: int, segment_blocks: int, work: Workload, seed: int, bytes_per_entry: dict[int, float]) -> Row:
    fill = _Fill(nodes, segment_blocks, work, seed)
    fill.run()
    anchors, entries = fill.entry_records()
    owners = fill.hrw.replica_indices(anchors, work.replicas)
    per_owner = np.bincount(owners.ravel(), weights=np.repeat(entries, owners.shape[1]), minlength=nodes)
    msgs, load = _lookups(fill)
    on_join, on_leave = _moved(fill, anchors, entries, owners)
    worst = bytes_per_entry[work.max_holders]
    return Row(
        nodes=nodes,
        segment="whole chain" if segment_blocks == WHOLE_CHAIN else f"{segment_blocks} blocks",
        replicas=work.replicas,
        entries_mean=float(per_owner.mean()),
        entries_max=int(per_owner.max()),
        entry_bytes_max=int(per_owner.max() * worst),
        lookup_msgs_mean=float(msgs.mean()),
        lookup_msgs_p99=float(np.percentile(msgs, 99)),
        lookup_load_max_over_mean=float(load.max() / max(load.mean(), 1e-9)),
        update_msgs_mean=float(np.mean(fill.update_msgs)),
        moved_on_join=on_join,
        moved_on_leave=on_leave,
    )


def table(rows: list[Row], work: Workload, bytes_per_entry: dict[int, float]) -> str:
    lines = [
        f"{work.blocks_per_node} blocks per node, chains of up to {work.max_chain_blocks} blocks, "
        f"{work.lookups} lookups; a directory entry costs {bytes_per_entry[1]:.0f} B with one holder, "
        f"{bytes_per_entry[work.max_holders]:.0f} B with {work.max_holders}",
        "",
        "| nodes | segment | replicas | entries per owner (mean / max) | max shard memory | owners per lookup (mean / p99) "
        "| lookup load max/mean | owners per stored request | moved on join | moved on leave |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.nodes} | {r.segment} | {r.replicas} | {r.entries_mean:,.0f} / {r.entries_max:,} | {r.entry_bytes_max / 2**20:.1f} MiB "
            f"| {r.lookup_msgs_mean:.1f} / {r.lookup_msgs_p99:.0f} | {r.lookup_load_max_over_mean:.1f} "
            f"| {r.update_msgs_mean:.1f} | {r.moved_on_join:.2%} | {r.moved_on_leave:.2%} |")
    return "\n".join(lines)


def write_plot(path: Path, rows: list[Row]) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for segment, replicas in dict.fromkeys((r.segment, r.replicas) for r in rows):
        picked = [r for r in rows if (r.segment, r.replicas) == (segment, replicas)]
        label = segment if replicas == 1 else f"{segment}, {replicas} replicas"
        x = [r.nodes for r in picked]
        axes[0].plot(x, [r.lookup_msgs_mean for r in picked], marker="o", label=label)
        axes[1].plot(x, [r.lookup_load_max_over_mean for r in picked], marker="o", label=label)
        axes[2].plot(x, [r.entries_max / max(r.entries_mean, 1) for r in picked], marker="o", label=label)
    titles = ("owners asked per lookup (one round trip)", "lookup load: busiest node / mean", "entries: largest shard / mean")
    for ax, title in zip(axes, titles):
        ax.set_xscale("log")
        ax.set_xlabel("nodes")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvd.cluster.dirsim", description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", default="10,100,1000", help="cluster sizes, comma-separated")
    p.add_argument("--segments", default="64,256,0", help="segment_blocks values; 0: the whole chain")
    p.add_argument("--replicas", default="1", help="directory replicas per segment, comma-separated")
    p.add_argument("--blocks-per-node", type=int, default=Workload().blocks_per_node)
    p.add_argument("--lookups", type=int, default=Workload().lookups)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--plot", type=Path, help="write a PNG here")
    args = p.parse_args(argv)
    work = Workload(blocks_per_node=args.blocks_per_node, lookups=args.lookups)
    bytes_per_entry = {h: entry_bytes(h) for h in sorted({1, work.max_holders})}
    rows = []
    runs = [(int(n), int(s), int(r)) for n in args.nodes.split(",") for s in args.segments.split(",")
            for r in args.replicas.split(",")]
    for i, (nodes, segment, replicas) in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {nodes} nodes, segment {segment or 'whole chain'}, {replicas} replicas",
              file=sys.stderr, flush=True)
        rows.append(simulate(nodes, segment, replace(work, replicas=replicas), args.seed, bytes_per_entry))
    print(table(rows, work, bytes_per_entry))
    if args.json:
        args.json.write_text(json.dumps({"workload": asdict(work), "bytes_per_entry": bytes_per_entry,
                                         "rows": [asdict(r) for r in rows]}, indent=2))
    if args.plot:
        write_plot(args.plot, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
