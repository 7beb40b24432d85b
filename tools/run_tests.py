#!/usr/bin/env python3
"""`make test`'s pytest in two groups side by side, on the machine's two cores (issue 36 item 7).

The engine tests (tests/engines and tests/e2e: real vLLM, SGLang and
Hugging Face processes) spend most of their time inside one engine process
on one core; everything else mostly waits on daemons, drives and sockets.
Run one after the other they leave a core idle much of the time, so they
run as two pytest processes at once, each with its own log under
build/test-logs/. Every 30 s this prints each group's progress; at the end
the groups' summaries, and the whole log of a group that failed.

    tools/run_tests.py [PYTEST_ARGS ...]      # exit 0 only if both groups pass

The extra arguments are pytest options for both groups (not test paths:
for a subset, run pytest itself). Tests that need a machine to
themselves must not land in different groups: the test networks take a
subnet per process (kvd.testing.netns), loop devices and cgroups are named
per process, ports are picked free.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ["tests/engines", "tests/e2e"]
GROUPS = {"engines": ENGINES, "rest": ["tests", *(f"--ignore={path}" for path in ENGINES)]}
REPORT_EVERY_S = 30.0
PROGRESS = re.compile(r"\[\s*(\d+)%\]")


def start(name: str, paths: list[str], extra: list[str], logs: Path) -> tuple[subprocess.Popen, Path]:
    log = logs / f"{name}.log"
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--durations=15",
               f"--junitxml={logs / name}.xml", *extra, *paths]
    with open(log, "wb") as sink:  # the child keeps its own descriptor; the parent only reads the file
        process = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, env=os.environ.copy())
    return process, log


def progress(log: Path) -> str:
    """How far a group is (pytest's percentage) and how many of its test files had a failure or error."""
    text = log.read_text(errors="replace") if log.exists() else ""
    marks = PROGRESS.findall(text)
    failing = len(re.findall(r"^tests/\S+\.py [.sxX]*[FE]", text, re.M))
    return f"{marks[-1] if marks else 0}%" + (f", {failing} files failing" if failing else "")


def summary(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines()
    return lines[-1] if lines else "(no output)"


def main() -> int:
    logs = ROOT / "build" / "test-logs"
    logs.mkdir(parents=True, exist_ok=True)
    extra = sys.argv[1:]
    started = time.monotonic()
    running = {name: start(name, paths, extra, logs) for name, paths in GROUPS.items()}
    codes: dict[str, int] = {}
    next_report = started + REPORT_EVERY_S
    while len(codes) < len(running):
        time.sleep(1.0)
        for name, (process, log) in running.items():
            if name not in codes and process.poll() is not None:
                codes[name] = process.returncode
                print(f"[{time.monotonic() - started:6.0f} s] {name}: {summary(log)}", flush=True)
        if time.monotonic() >= next_report:
            next_report += REPORT_EVERY_S
            states = ", ".join(f"{name} {progress(log)}" for name, (_, log) in running.items() if name not in codes)
            if states:
                print(f"[{time.monotonic() - started:6.0f} s] {states}", flush=True)
    for name, (_, log) in running.items():
        if codes[name] != 0:
            print(f"\n===== {name} failed (exit {codes[name]}): {log} =====\n{log.read_text(errors='replace')}")
        else:
            print(f"\n===== {name} =====\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:]))
    print(f"\nall groups: {time.monotonic() - started:.0f} s; " + ", ".join(f"{name} exit {code}"
                                                                       for name, code in codes.items()))
    return 0 if all(code == 0 for code in codes.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
