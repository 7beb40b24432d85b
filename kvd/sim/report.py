"""Hit rate per tier against host capacity, for each eviction policy.

Every (policy, host capacity) pair runs the same seeded trace; the report
is a table, a PNG plot and, on request, JSON. Shares are of prompt tokens
(every token, so a prompt's partial last block is always a miss) and of
prompt blocks (full blocks only).
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TextIO

from kvd.core.policy import make_policy
from kvd.sim.config import SimConfig
from kvd.sim.results import RunResult
from kvd.sim.simulator import Simulator

GIB = 1 << 30


def policy_names() -> list[str]:
    """Every host eviction policy the registry knows, so new ones join the report.

    The registry names them all when it refuses an unknown name.
    """
    try:
        make_policy("")
    except ValueError as error:
        found = re.search(r"\(known: ([^)]*)\)", str(error))
        if found:
            return [name.strip() for name in found.group(1).split(",")]
    raise RuntimeError("the policy registry no longer lists its policies when it refuses a name")


class Progress:
    """One line on stderr: which run, how far through its requests."""

    def __init__(self, total_runs: int, stream: TextIO | None = None) -> None:
        self.total_runs = total_runs
        self.stream = stream if stream is not None else sys.stderr
        self.live = self.stream.isatty()
        self.run = 0
        self.label = ""
        self._last_quarter = -1

    def start(self, label: str) -> Callable[[int, int], None]:
        self.run += 1
        self.label = label
        self._last_quarter = -1
        return self.update

    def update(self, done: int, total: int) -> None:
        quarter = done * 4 // total
        line = f"run {self.run}/{self.total_runs} {self.label}: request {done}/{total}"
        if self.live:
            if done == total or done % 10 == 0:
                self.stream.write(f"\r{line}\033[K")
                self.stream.flush()
        elif quarter != self._last_quarter:
            # Not a terminal (a log, CI): a line per quarter.
            self._last_quarter = quarter
            self.stream.write(line + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\n")
            self.stream.flush()


def sweep(
    base: SimConfig, policies: Sequence[str], host_blocks: Sequence[int], progress: Progress | None = None
) -> list[RunResult]:
    """Run `base` for every policy and host capacity (same seed, same trace)."""
    results = []
    for policy in policies:
        for blocks in host_blocks:
            config = dataclasses.replace(base, policy=policy, host_blocks=blocks)
            callback = progress.start(f"{policy} host {blocks} blocks") if progress is not None else None
            results.append(Simulator(config, progress=callback).run())
    if progress is not None:
        progress.close()
    return results


def _percent(share: float) -> str:
    return f"{100 * share:.1f}%"


def _gib(count: int, block_bytes: int) -> str:
    return f"{count * block_bytes / GIB:g}"


def describe(base: SimConfig) -> str:
    disk = "no disk tier"
    if base.disk_blocks:
        disk = (
            f"disk {base.disk_blocks} blocks ({_gib(base.disk_blocks, base.block_bytes)} GiB), "
            f"write-{base.write_mode}, {base.io_schedule} I/O schedule"
        )
        if base.admission_min_hits > 1:
            disk += f", written after {base.admission_min_hits} sightings"
    if base.middle_blocks:
        disk = f"middle memory tier {base.middle_blocks} blocks ({_gib(base.middle_blocks, base.block_bytes)} GiB), " + disk
    return (
        f"seed {base.seed}: {base.requests} requests, {base.trace.tenants} tenants, "
        f"{base.block_tokens}-token blocks of {base.block_bytes >> 20} MiB, {disk}"
    )


def table(base: SimConfig, results: Sequence[RunResult]) -> str:
    parts = ("host", "middle", "disk", "miss") if base.middle_blocks else ("host", "disk", "miss")
    header = [
        "policy", "host blocks", "host GiB",
        *(f"{part} hit" if part != "miss" else part for part in parts),
        *(f"{part} hit (blocks)" if part != "miss" else "miss (blocks)" for part in parts),
        "TTFT mean ms", "TTFT p99 ms",
    ]
    lines = [
        describe(base),
        "shares of prompt tokens (and of full prompt blocks) served from each tier",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for result in results:
        stats, config = result.stats, result.config
        cells = [
            config.policy, str(config.host_blocks), _gib(config.host_blocks, config.block_bytes),
            *(_percent(stats.share(part, "tokens")) for part in parts),
            *(_percent(stats.share(part, "blocks")) for part in parts),
            f"{stats.ttft_mean_ms:.1f}", f"{stats.ttft_p99_ms:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_json(path: Path, base: SimConfig, results: Sequence[RunResult]) -> None:
    config = dataclasses.asdict(base)
    for varied in ("policy", "host_blocks"):
        config.pop(varied)
    document = {"seed": base.seed, "config": config, "runs": [result.to_dict() for result in results]}
    path.write_text(json.dumps(document, indent=2) + "\n")


def write_plot(path: Path, base: SimConfig, results: Sequence[RunResult]) -> None:
    """Hit rate against host capacity: solid lines host hits, dashed host + disk."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")  # no display, and the same bytes on every machine
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    policies = list(dict.fromkeys(result.config.policy for result in results))
    colors = pyplot.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, weight in zip(axes, ("tokens", "blocks")):
        for position, policy in enumerate(policies):
            runs = [result for result in results if result.config.policy == policy]
            capacity = [result.config.host_blocks * result.config.block_bytes / GIB for result in runs]
            host = [100 * result.stats.share("host", weight) for result in runs]
            both = [100 * (result.stats.share("host", weight) + result.stats.share("disk", weight)) for result in runs]
            color = colors[position % len(colors)]
            axis.plot(capacity, host, marker="o", color=color, label=f"{policy}: host")
            if base.disk_blocks:
                axis.plot(capacity, both, marker="s", linestyle="--", color=color, label=f"{policy}: host + disk")
        axis.set_xscale("log", base=2)
        axis.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda value, _: f"{value:g}"))
        axis.set_xlabel("host tier capacity (GiB)")
        axis.set_title(f"hit rate, share of prompt {weight}")
        axis.set_ylim(0, 100)
        axis.grid(True, alpha=0.3)
    axes[0].set_ylabel("hit rate (%)")
    axes[1].legend(loc="lower right", fontsize="small")
    figure.suptitle(describe(base), fontsize="medium")
    figure.tight_layout()
    # No timestamp in the file, so a seed gives the same PNG.
    figure.savefig(path, format="png", dpi=100, metadata={"Software": None})
    pyplot.close(figure)
