"""bench/plot_timeline.py: the connector's timeline files summarised and drawn."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "plot_timeline", Path(__file__).resolve().parents[2] / "bench" / "plot_timeline.py")
plot_timeline = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("plot_timeline", plot_timeline)
_SPEC.loader.exec_module(plot_timeline)

# One hit of two layers (times in microseconds from the step's start): opened, both layers landed at
# once, layer 0 waited 1 ms (its copy), layer 1 not at all; the step ended at 30 ms.
HIT = {"step": 4, "start_ns": 0, "events": [
    ["open", -1, 0.0, 1000.0], ["landed", 0, 900.0, 900.0], ["landed", 1, 900.0, 900.0],
    ["copy_in", 0, 1000.0, 2000.0], ["wait", 0, 1500.0, 2500.0], ["copy_in", 1, 2000.0, 3000.0],
    ["wait", 1, 15000.0, 15000.0], ["drain", -1, 29000.0, 29500.0], ["close", -1, 29500.0, 29800.0],
    ["commit", -1, 29800.0, 30000.0]]}


def test_a_step_is_summarised_and_each_layers_compute_runs_from_its_wait_to_the_next():
    assert plot_timeline.step_summary(HIT) == {"wait_ms": 1.0, "copy_ms": 2.0, "step_ms": 30.0}
    assert plot_timeline.compute_spans(HIT) == {0: (2.5, 15.0), 1: (15.0, 29.0)}


def test_timeline_files_are_read_on_from_where_the_last_read_stopped(tmp_path):
    (tmp_path / "worker0.jsonl").write_text(json.dumps(HIT) + "\n")
    (tmp_path / "scheduler.jsonl").write_text(json.dumps({"step": 1, "start_ns": 0, "events": [
        ["lookup", 16, 0.0, 4000.0], ["lookup", 0, 5000.0, 7000.0]]}) + "\n")
    files = plot_timeline.TimelineFiles(tmp_path)
    figures = files.figures()
    assert figures["lookups"] == 2 and figures["lookup_ms_p50"] == 3.0 and figures["lookup_ms_max"] == 4.0
    # kvd on the model's thread: open 1 + waits 1 + drain 0.5 + close 0.3 + commit 0.2
    assert abs(figures["model_thread_ms_p50"] - 3.0) < 1e-9 and figures["worker_steps"] == 1
    assert files.figures()["lookups"] == 0 and files.new_steps("worker0") == []  # nothing new since
    with open(tmp_path / "worker0.jsonl", "a") as sink:
        sink.write(json.dumps(HIT | {"step": 5}) + "\n")
    assert [step["step"] for step in files.new_steps("worker0")] == [5]


def test_steps_are_drawn_to_a_png(tmp_path):
    png = tmp_path / "out" / "timeline.png"
    plot_timeline.plot_steps({"a hit": HIT, "the same again": HIT}, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
