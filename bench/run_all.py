#!/usr/bin/env python3
"""Run every kvd benchmark in sequence (what `make bench` runs).

Each benchmark runs in its own interpreter (so one's daemons, buffers and
allocator state cannot skew the next), prints its report, and writes
bench/results/<name>.json. At the end this prints one line per benchmark
and writes bench/results/summary.json.

Exit status: 1 if a benchmark crashed; 0 otherwise, also when a target is
missed (the figures are the product), unless --strict is given.

Run:  .venv/bin/python bench/run_all.py [--quick] [--strict] [--only lookup host_tier ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BENCH_DIR, RESULTS_DIR, machine_info, progress, report, warn_if_busy  # noqa: E402

# name -> (full arguments, --quick arguments)
BENCHMARKS: dict[str, tuple[list[str], list[str]]] = {
    "index_memory": ([], ["--sizes", "100000"]),
    "lookup": ([], ["--calls", "200"]),
    "host_tier": ([], ["--rounds", "3", "--batch-mib", "128", "--capacity-mib", "256", "--inline-rounds", "1"]),
    "tenant_arena": ([], ["--rounds", "3", "--arena-mib", "128", "--claim-slots", "16"]),
    "ttft": ([], ["--prompt-tokens", "1024", "--repeats", "1"]),
    "io_engine": ([], ["--file-mib", "256", "--rounds", "2"]),
    "disk_restore": ([], ["--total-mib", "512", "--rounds", "2", "--store-rounds", "2"]),
    "get_stream": ([], ["--total-mib", "256", "--rounds", "2"]),
    "vllm_connector": ([], ["--prefix-tokens", "1024", "--prefixes", "3", "--disk-modes", "async"]),
    "cluster_fetch": ([], ["--mib", "64", "--rounds", "2"]),
    "io_ring": ([], ["--reads", "1024", "--file-mib", "256", "--rounds", "2"]),
    "loop_time": ([], ["--quick"]),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions (a smoke run)")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any target is missed")
    parser.add_argument("--only", nargs="+", choices=sorted(BENCHMARKS), help="run only these benchmarks")
    args = parser.parse_args()
    warn_if_busy()

    names = args.only or list(BENCHMARKS)
    summary: dict[str, dict] = {}
    crashed = False
    for name in names:
        full, quick = BENCHMARKS[name]
        script = BENCH_DIR / f"bench_{name}.py"
        command = [sys.executable, str(script), *(quick if args.quick else full)]
        progress(f"=== {script.name} {' '.join(command[2:])}")
        started = time.monotonic()
        # stdout and stderr pass straight through: the report and the progress.
        code = subprocess.run(command, check=False).returncode
        seconds = time.monotonic() - started
        result_path = RESULTS_DIR / f"bench_{name}.json"
        entry: dict = {"exit_code": code, "seconds": round(seconds, 1), "result_file": str(result_path.name)}
        if code != 0:
            crashed = True
            entry["pass"] = None
        else:
            try:
                entry["pass"] = json.loads(result_path.read_text())["pass"]
            except (OSError, ValueError, KeyError):
                entry["pass"] = None
        summary[name] = entry
        report("")

    report("== summary ==")
    for name, entry in summary.items():
        verdict = "CRASHED" if entry["exit_code"] else ("PASS" if entry["pass"] else "FAIL")
        report(f"  bench_{name:<14} {verdict:<8} {entry['seconds']:>7.1f} s   bench/results/{entry['result_file']}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "summary.json").write_text(
        json.dumps({"machine": machine_info(), "quick": args.quick, "benchmarks": summary}, indent=2) + "\n"
    )
    if crashed:
        return 1
    if args.strict and not all(entry["pass"] for entry in summary.values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
