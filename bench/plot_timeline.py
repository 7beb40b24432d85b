#!/usr/bin/env python3
"""Draw the vLLM connector's per-layer timelines (its `timeline` option, kvd.connectors.vllm.timeline).

Each step is one panel with five lanes: when the daemon reported each layer in its arena, the copy
thread copying each layer into vLLM's KV cache, the model's layers computing (between one layer's
wait and the next's), the layers waiting for kvd's bytes, and kvd's calls on the model's thread (the
load's open, the saves' reserve, and at the step's end the copy thread drained, loads closed, saves
committed). A load the compute hides shows copies under compute and no waits.

Run:  .venv/bin/python bench/plot_timeline.py TIMELINE_DIR/worker0.jsonl [--steps 3] [--png out.png]
(without --steps: the last three steps that loaded; bench/bench_vllm_timeline.py draws its own)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

LANES = ("in kvd's arena", "copy thread", "layer compute", "waiting for kvd", "kvd calls")


def spans(step: dict, what: str) -> dict[int, tuple[float, float]]:
    """layer -> (start, end) in ms of the step's events named `what`."""
    return {layer: (t0 / 1e3, t1 / 1e3) for name, layer, t0, t1 in step["events"] if name == what}


def step_summary(step: dict) -> dict[str, float]:
    """Total ms the layers waited, the copy thread copied in, and the step's length."""
    waits, copies = spans(step, "wait"), spans(step, "copy_in")
    return {"wait_ms": sum(t1 - t0 for t0, t1 in waits.values()),
            "copy_ms": sum(t1 - t0 for t0, t1 in copies.values()),
            "step_ms": max(t1 for _, _, _, t1 in step["events"]) / 1e3}


# kvd's time on the model's thread (a CPU engine's saves wait for their reservation on the copy thread,
# which the step's end drains)
MODEL_THREAD = ("open", "wait", "drain", "close", "commit")


class TimelineFiles:
    """A connector's timeline directory, read on from where the last read stopped."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.lines_read = Path(directory), {}

    def new_steps(self, name: str) -> list[dict]:
        """The steps `name`.jsonl (worker0, scheduler) gained since the last call."""
        path = self.directory / f"{name}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        start, self.lines_read[name] = self.lines_read.get(name, 0), len(lines)
        return [json.loads(line) for line in lines[start:]]

    def skip(self) -> TimelineFiles:
        for name in ("worker0", "scheduler"):
            self.new_steps(name)
        return self

    def figures(self) -> dict:
        """Medians (and the largest) of the new steps: the scheduler's Lookups (each one's ms too, in
        order), and per worker step kvd's time on the model's thread and what it was spent on."""
        lookups = [t1 - t0 for step in self.new_steps("scheduler") for name, _, t0, t1 in step["events"]
                   if name == "lookup"]
        steps = self.new_steps("worker0")
        per_step = {what: [sum(t1 - t0 for name, _, t0, t1 in step["events"] if name == what) for step in steps]
                    for what in MODEL_THREAD}
        on_thread = [sum(values) for values in zip(*per_step.values(), strict=True)]
        middle = lambda values: float(np.median(values)) / 1e3 if values else 0.0  # noqa: E731
        return {"lookups": len(lookups), "lookups_ms": [value / 1e3 for value in lookups],
                "lookup_ms_p50": middle(lookups),
                "lookup_ms_max": max(lookups, default=0.0) / 1e3, "worker_steps": len(steps),
                "model_thread_ms_p50": middle(on_thread), "model_thread_ms_max": max(on_thread, default=0.0) / 1e3,
                **{f"{what}_ms_p50": middle(values) for what, values in per_step.items()}}


def compute_spans(step: dict) -> dict[int, tuple[float, float]]:
    """Each layer's compute: from the end of its wait to the start of the next layer's (the last:
    to the step's end)."""
    waits = spans(step, "wait")
    ends = [t0 for name, _, t0, _ in step["events"] if name == "drain"]
    layers = sorted(waits)
    stops = [waits[layer][0] for layer in layers[1:]] + [ends[0] / 1e3 if ends else waits[layers[-1]][1]]
    return {layer: (waits[layer][1], stop) for layer, stop in zip(layers, stops, strict=True)}


def draw(axis, step: dict, title: str) -> None:
    colors = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3", "#8c8c8c"]
    color = lambda layer: colors[layer % len(colors)]  # noqa: E731
    for layer, (t0, _) in spans(step, "landed").items():
        axis.plot([t0], [4], marker="v", color=color(layer))
        axis.annotate(f"L{layer}", (t0, 4.15), fontsize=7, ha="center")
    lanes = ((3, spans(step, "copy_in")), (2, compute_spans(step)), (1, spans(step, "wait")))
    for lane, events in lanes:
        for layer, (t0, t1) in events.items():
            axis.broken_barh([(t0, max(t1 - t0, 0.05))], (lane - 0.35, 0.7), color=color(layer))
    for name, _, t0, t1 in step["events"]:
        if name in ("drain", "close", "commit", "open", "reserve"):
            axis.broken_barh([(t0 / 1e3, max((t1 - t0) / 1e3, 0.05))], (-0.35, 0.7), color="#999999")
            axis.annotate(name, (t0 / 1e3, 0.45), fontsize=6)
    axis.set_yticks([4, 3, 2, 1, 0], LANES, fontsize=8)
    axis.set_title(title, fontsize=9)
    axis.set_xlabel("ms from the step's start", fontsize=8)


def plot_steps(steps: dict[str, dict], png: Path) -> None:
    """One panel per named step, written to `png`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(steps), 1, figsize=(11, 2.2 * len(steps)), squeeze=False)
    for axis, (title, step) in zip(axes[:, 0], steps.items(), strict=True):
        draw(axis, step, title)
    figure.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(png, dpi=110)
    plt.close(figure)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("timeline", type=Path)
    parser.add_argument("--steps", type=int, nargs="+", help="step numbers (default: the last three that loaded)")
    parser.add_argument("--png", type=Path, default=Path("timeline.png"))
    args = parser.parse_args()
    steps = [json.loads(line) for line in args.timeline.read_text().splitlines()]
    chosen = ([step for step in steps if step["step"] in args.steps] if args.steps else
              [step for step in steps if any(event[0] == "open" for event in step["events"])][-3:])
    if not chosen:
        sys.exit(f"{args.timeline}: no such step (or none that loaded)")
    plot_steps({f"step {step['step']}": step for step in chosen}, args.png)
    print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
