"""The device check's driver: steps a-e (tools/device_check/steps.py) each in its own time limit, all
within the visit's deadline; then device_check.json, device_check.log and a table in RESULTS_DIR.

tools/device_check.sh installs and builds first and hands over what those steps took (--prior, one
JSON object a line); this driver runs the rest with the venv's Python. A step that fails or runs out
of time is recorded and the next one runs.

    python -m tools.device_check RESULTS_DIR --prior setup.jsonl --deadline EPOCH_S [--scale full|small]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tools.device_check.steps import Context, Step, load_json, plan

ROOT = Path(__file__).resolve().parents[2]
RESERVE_S = 10  # kept for writing the results
MIN_STEP_S = 15  # a step with less time than this left is not started


def find_gpu() -> tuple[str | None, str]:
    """(the GPU's name, "") or (None, why not), asked in a child so this process holds no CUDA context."""
    probe = ("from kvd.device import open_device; d = open_device('cuda'); "
             "print(d.runtime.cudaGetDeviceProperties(d.index)[1].name.decode(errors='replace'))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT,
                          check=False)
    if done.returncode == 0:
        return done.stdout.strip(), ""
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return None, (lines[-1] if lines else f"exit {done.returncode}")[:200]


def tool_env() -> dict[str, str]:
    """What the tests need to find: nvcc and the ring's fatbin."""
    env = {"KVD_IO_RING_FATBIN": str(ROOT / "build/cuda/io_ring_kernel.fatbin")}
    nvcc = shutil.which("nvcc")
    if nvcc:
        env["KVD_NVCC"] = nvcc
    return env


def find_fio() -> str | None:
    bundled = ROOT / ".device-bundle/bin/fio"
    return shutil.which("fio") or (str(bundled) if os.access(bundled, os.X_OK) else None)


def run_step(step: Step, deadline: float, log) -> dict:
    """One step: ok, failed (why) or skipped (why), its seconds and its figures."""
    row = {"step": step.name, "status": "skipped", "seconds": 0.0, "figures": {}, "why": step.skip or ""}
    left = deadline - time.time() - RESERVE_S
    if step.skip is not None:
        return row
    if left < MIN_STEP_S:
        row["why"] = f"out of time ({left:.0f} s left of the visit)"
        return row
    limit = min(step.limit_s, left)
    print(f"[device-check {time.strftime('%H:%M:%S')}] {step.name} (limit {limit:.0f} s)", flush=True)
    log.write(f"\n===== {step.name}: {' '.join(step.argv)}\n")
    log.flush()
    started = time.monotonic()
    try:
        done = subprocess.run(step.argv, cwd=ROOT, env=os.environ | step.env, capture_output=True, text=True,
                              timeout=limit, check=False)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as expired:
        output = _text(expired.stdout) + _text(expired.stderr)
        code = None
    row["seconds"] = round(time.monotonic() - started, 1)
    log.write(output)
    log.flush()
    row.update(_verdict(step, output, code, limit))
    return row


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else (data or "")


def _verdict(step: Step, output: str, code: int | None, limit: float) -> dict:
    figures = {}
    if step.output_figures is not None:
        figures |= step.output_figures(output)
    result = load_json(step.result_json) if code is not None else None
    if result is not None and step.figures is not None:
        try:
            figures |= step.figures(result)
        except (KeyError, TypeError) as error:
            figures["figures_error"] = repr(error)
    if code is None:
        return {"status": "failed", "why": f"timed out after {limit:.0f} s", "figures": figures}
    if code != 0:
        last = [line for line in output.strip().splitlines() if line.strip()][-1:] or [""]
        return {"status": "failed", "why": f"exit {code}: {last[0][:160]}", "figures": figures}
    return {"status": "ok", "why": "", "figures": figures}


def keep_results(results: Path, steps: list[Step]) -> None:
    """The JSON files steps wrote inside the tree (bench/results) go to RESULTS_DIR too."""
    for step in steps:
        path = step.result_json
        if path is not None and path.exists() and path.parent != results:
            shutil.copy(path, results / path.name)


def disk_versus_fio(rows: list[dict]) -> dict:
    """kvd's restore (each granularity) against the best of the fio sweep, when both ran."""
    figures = {row["step"]: row["figures"] for row in rows}
    best = figures.get("e fio sweep", {}).get("best_gib_s")
    restore = figures.get("e bench_disk_restore", {})
    if not best:
        return {}
    return {key.replace("_kvd_gib_s", "_vs_fio_best_x"): round(value / best, 3)
            for key, value in restore.items() if key.endswith("_kvd_gib_s")}


def table(rows: list[dict]) -> str:
    lines = [f"{'step':<46} {'status':<8} {'seconds':>8}  key figures / why"]
    for row in rows:
        detail = ", ".join(f"{key}={value}" for key, value in row["figures"].items())
        if row["why"]:
            detail = f"{row['why']}" + (f"; {detail}" if detail else "")
        lines.append(f"{row['step'][:46]:<46} {row['status']:<8} {row['seconds']:>8.1f}  {detail}")
    return "\n".join(lines)


def environment(gpu: str | None, why: str, fio: str | None) -> dict:
    import platform

    return {"python": sys.version.split()[0], "platform": platform.platform(), "gpu": gpu, "no_gpu_reason": why,
            "nvcc": shutil.which("nvcc"), "fio": fio, "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path)
    parser.add_argument("--prior", type=Path, help="the set-up steps' rows (JSON lines), from device_check.sh")
    parser.add_argument("--deadline", type=float, default=time.time() + 480, help="epoch seconds")
    parser.add_argument("--scale", choices=("full", "small"), default="full")
    parser.add_argument("--work", type=Path, default=None, help="scratch space (default: RESULTS_DIR/work)")
    args = parser.parse_args(argv)
    args.results.mkdir(parents=True, exist_ok=True)
    work = args.work or args.results / "work"
    work.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in args.prior.read_text().splitlines() if line.strip()] if args.prior else []
    gpu, why = find_gpu()
    fio = find_fio()
    print(f"[device-check] GPU: {gpu or 'none (' + why + ')'}; fio: {fio or 'none'}", flush=True)
    context = Context(ROOT, work, args.results, gpu, why, args.scale, tool_env(), fio)
    steps = plan(context)
    with open(args.results / "device_check.log", "a", encoding="utf-8") as log:
        for step in steps:
            rows.append(run_step(step, args.deadline, log))
    keep_results(args.results, steps)
    shutil.rmtree(work, ignore_errors=True)
    summary = {"environment": environment(gpu, why, fio), "scale": args.scale, "steps": rows,
               "disk_vs_fio_best": disk_versus_fio(rows),
               "total_s": round(sum(row["seconds"] for row in rows), 1)}
    (args.results / "device_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(table(rows))
    print(f"disk restore vs the fio sweep's best: {summary['disk_vs_fio_best'] or 'n/a'}")
    print(f"total {summary['total_s']} s; wrote {args.results / 'device_check.json'} and device_check.log")
    return 0 if all(row["status"] != "failed" for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
