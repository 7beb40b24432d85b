"""The device check's steps a-e: what each runs, its time limit, and the figures read from its output.

A step is one subprocess. Where the machine has no GPU, a step that needs one is listed as skipped
with the reason, and its CPU counterpart (the same code on kvd's CPU device, smaller) runs instead
where one exists, under its own name, so a row never passes a CPU figure off as a GPU one.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PY = sys.executable
RING = ["tests/device/test_ring_gpu.py"]


@dataclass
class Step:
    name: str
    argv: list[str]
    limit_s: float
    env: dict[str, str] = field(default_factory=dict)
    result_json: Path | None = None  # what the step writes; its figures come from there
    figures: Callable[[dict], dict] | None = None
    skip: str | None = None  # why it is not run
    output_figures: Callable[[str], dict] | None = None  # figures from its printed output


@dataclass(frozen=True)
class Context:
    tree: Path  # the working tree
    work: Path  # scratch space on the machine's disk
    results: Path
    gpu: str | None  # the GPU's name, or None
    no_gpu_reason: str
    scale: str  # "full" (the GPU machine) or "small" (the simulated image)
    env: dict[str, str]  # KVD_NVCC, KVD_IO_RING_FATBIN
    fio: str | None


def pytest_counts(output: str) -> dict:
    """The counts of pytest's closing line ("3 passed, 1 skipped in 2.0s")."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|error)", line)]
    if not lines:
        return {}
    return {kind: int(count) for count, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", lines[-1])}


def _pytest(context: Context, paths: list[str], extra: list[str] = ()) -> list[str]:
    return [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-rfE", *extra, *paths]


def device_tests(context: Context) -> list[Step]:
    """a: tests/device (the ring's GPU tests are step c) and the vLLM worker's test, CUDA required."""
    paths = ["tests/device", "tests/integration/test_vllm_device_worker.py"]
    ignore = [f"--ignore={p}" for p in RING]
    env = dict(context.env) | ({"KVD_REQUIRE_GPU": "1"} if context.gpu else {})
    name = "a device tests [cpu+cuda]" if context.gpu else "a device tests [cpu]"
    steps = [Step(name, _pytest(context, paths, ignore), 200, env, output_figures=pytest_counts)]
    if not context.gpu:
        steps.append(Step("a device tests [cuda]", [], 0, skip=f"no GPU: {context.no_gpu_reason}"))
    return steps


def engine_pair(context: Context) -> list[Step]:
    """b: two engine processes through the daemon's device plane, every byte checked."""
    kind = "cuda" if context.gpu else "cpu"
    out = context.results / f"engine_pair_{kind}.json"
    step = Step(f"b engine pair [{kind}]", [PY, "-m", "tools.device_check.engine_pair", "--kind", kind,
                                            "--dir", str(context.work / f"engine-pair-{kind}"), "--json", str(out)],
                90, result_json=out, figures=lambda r: {
                    "saved": r["save"]["saved_blocks"], "loaded": r["load"]["loaded_blocks"],
                    "exact_layers": f"{r['load']['exact_layers']}/{r['layers']}",
                    "save_step_s": round(r["save"]["step_s"], 3), "load_step_s": round(r["load"]["step_s"], 3)})
    return [step] + ([] if context.gpu else [Step("b engine pair [cuda]", [], 0, skip=f"no GPU: {context.no_gpu_reason}")])


def _copy_figures(result: dict) -> dict:
    return {f"{name}_x": round(row["ratio"], 3) for name, row in result["copies"].items()} | {
        f"{name}_gib_s": round(row["kvd_gib_s"], 2) for name, row in result["copies"].items()} | {
        "exact": all(result["checks"].values()), "target_met": result["target_met"]}


def layer_bandwidth(context: Context) -> list[Step]:
    """b: kvd's per-layer saves and loads against one plain copy (bench/bench_gpu_layers.py)."""
    out = context.tree / "bench/results/bench_gpu_layers.json"
    if context.gpu:
        argv = [PY, "bench/bench_gpu_layers.py", "--device", "cuda"]
        return [Step("b layer copies vs cudaMemcpyAsync [cuda]", argv, 90, result_json=out, figures=_copy_figures)]
    argv = [PY, "bench/bench_gpu_layers.py", "--device", "cpu", "--layers", "8", "--blocks", "64",
            "--pool-blocks", "256", "--rounds", "3"]
    return [Step("b layer copies vs one copy [cpu]", argv, 90, result_json=out, figures=_copy_figures),
            Step("b layer copies vs cudaMemcpyAsync [cuda]", [], 0, skip=f"no GPU: {context.no_gpu_reason}")]


def ring(context: Context) -> list[Step]:
    """c: the GPU-initiated ring's kernels against a real file; bench_gpu."""
    env = dict(context.env) | {"KVD_REQUIRE_GPU": "1"}
    tests = _pytest(context, RING, ["-rA"])
    if not context.gpu:
        why = f"no GPU: {context.no_gpu_reason}"
        return [Step("c ring tests [no-driver branches]", tests, 60, dict(context.env),
                     output_figures=pytest_counts),
                Step("c ring tests [cuda]", [], 0, skip=why),
                Step("c bench_gpu copies + ring restore [cuda]", [], 0, skip=why)]
    bench = [PY, "bench/bench_gpu.py", "--mib", "512", "--file-mib", "512", "--rounds", "3"]
    return [Step("c ring tests [cuda]", tests, 90, env,
                 output_figures=pytest_counts),
            Step("c bench_gpu copies + ring restore [cuda]", bench, 120, dict(context.env),
                 result_json=context.tree / "bench/results/bench_gpu.json", figures=lambda r: {
                     "ring_over_cpu_x": r["restore"]["ring_over_cpu"],
                     **{f"{k}_x": round(v["ratio"], 3) for k, v in r["copies"].items()}})]


def _model_figures(result: dict) -> dict:
    figures = {}
    for row in result["host"]:
        figures[f"{row['tokens']}_host_ms"] = round(row["ttft_restore_s"] * 1e3, 1)
        figures[f"{row['tokens']}_recompute_ms"] = round(row["ttft_recompute_s"] * 1e3, 1)
    for row in result["disk"]:
        figures[f"{row['tokens']}_disk_ms"] = round(row["ttft_restore_s"] * 1e3, 1)
    figures["logits_equal"] = all(row["logits_equal_without_kvd"] for row in result["host"] + result["disk"])
    return figures


def hf_model(context: Context) -> list[Step]:
    """d: a Llama-architecture model, its prefix restored from kvd's host and disk tiers."""
    kind = "cuda" if context.gpu else "cpu"
    out = context.results / f"hf_restore_{kind}.json"
    sizes = ["--layers", "8", "--tokens", "8192,32768"] if context.gpu else ["--layers", "4", "--tokens", "1024,2048"]
    argv = [PY, "-m", "tools.device_check.hf_restore", "--device", kind, *sizes,
            "--dir", str(context.work / f"hf-{kind}"), "--json", str(out)]
    name = "d HF Llama-8B-like, 8 layers [cuda]" if context.gpu else "d HF tiny Llama, 4 layers [cpu]"
    steps = [Step(name, argv, 150, result_json=out, figures=_model_figures)]
    if not context.gpu:
        steps.append(Step("d HF Llama-8B-like, 8 layers [cuda]", [], 0, skip=f"no GPU: {context.no_gpu_reason}"))
    return steps


def disk(context: Context) -> list[Step]:
    """e: bench_disk_restore on this machine's disk, and an fio sweep for the drive's best."""
    full = context.scale == "full"
    sweep_out = context.results / "fio_sweep.json"
    sweep = [PY, "bench/fio_sweep.py", "--fio", context.fio or "", "--dir", str(context.work), "--json", str(sweep_out),
             "--size-mib", "1024" if full else "256"]
    if not full:
        sweep += ["--bs", "1m,4m", "--iodepth", "8,32", "--numjobs", "1"]
    restore = [PY, "bench/bench_disk_restore.py", "--total-mib", "1024" if full else "256", "--rounds",
               "3" if full else "2", "--store-rounds", "1", "--dir", str(context.work)]
    fio_step = Step("e fio sweep", sweep, 90, result_json=sweep_out, figures=lambda r: {
        "best_gib_s": round(r["best"]["gib_s"], 2), "best": f"{r['best']['bs']}/qd{r['best']['iodepth']}"
                                                          f"/j{r['best']['numjobs']}", "settings": len(r["runs"])},
        skip=None if context.fio else "no fio on this machine or in the bundle: kvd's own sequential read "
                                      "(bench_disk_restore's 'kvd.io seq 1M') is the reference")
    restore_env = {"PATH": f"{Path(context.fio).parent}:{os.environ['PATH']}"} if context.fio else {}
    restore_step = Step("e bench_disk_restore", restore, 150, restore_env,
                        result_json=context.tree / "bench/results/bench_disk_restore.json", figures=_restore_figures)
    return [fio_step, restore_step]


def _restore_figures(result: dict) -> dict:
    figures = {}
    for row in result["results"].values():
        tokens = row["block_tokens"]
        restore = row["restore"]
        figures[f"t{tokens}_kvd_gib_s"] = round(restore["kvd restore"]["median_gib_s"], 2)
        if "fio read" in restore:
            figures[f"t{tokens}_fio_1m_gib_s"] = round(restore["fio read"]["median_gib_s"], 2)
        figures[f"t{tokens}_seq_1m_gib_s"] = round(restore["kvd.io seq 1M"]["median_gib_s"], 2)
    figures["bench_pass"] = result["pass"]
    return figures


def plan(context: Context) -> list[Step]:
    """Every step, in the order they run (the most telling first, should time run short)."""
    return [*device_tests(context), *engine_pair(context), *layer_bandwidth(context), *ring(context),
            *hf_model(context), *disk(context)]


def load_json(path: Path | None) -> dict | None:
    if path is None or not path.exists():
        return None
    return json.loads(path.read_text())
