"""Shared helpers for the kvd benchmarks (not a test module).

Every benchmark measures kvd and its baseline side by side in one process
run, prints a human-readable report on stdout, progress on stderr, and
writes bench/results/<name>.json with the raw numbers, the ratios, the
targets, pass/fail and a description of the machine.
"""

from __future__ import annotations

import cProfile
import datetime as _dt
import io
import json
import os
import platform
import pstats
import shutil
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
LOADAVG_AT_START = os.getloadavg()

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))


# ---------------------------------------------------------------------------
# Output


def warn_if_busy() -> None:
    """Say so on stderr when the machine is busy before a benchmark starts."""
    load = LOADAVG_AT_START[0]
    cpus = os.cpu_count() or 1
    if load > 0.25 * cpus:
        progress(f"note: 1-minute load average is {load:.2f} on {cpus} CPUs; absolute figures will be noisy "
                 "(ratios are measured interleaved in one run)")


def progress(message: str) -> None:
    """One line of progress on stderr (stdout carries the report)."""
    stamp = time.strftime("%H:%M:%S")
    print(f"[{stamp}] {message}", file=sys.stderr, flush=True)


def report(line: str = "") -> None:
    print(line, flush=True)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _git_revision() -> str | None:
    git = shutil.which("git")
    if git is None:
        return None
    try:
        out = subprocess.run(
            [git, "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
        dirty = subprocess.run(
            [git, "-C", str(REPO_ROOT), "status", "--porcelain"],
            capture_output=True, text=True, timeout=10, check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    revision = out.stdout.strip() or None
    if revision and dirty.stdout.strip():
        revision += "+dirty"
    return revision


def machine_info() -> dict[str, Any]:
    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        usable_cpus = os.cpu_count()
    info: dict[str, Any] = {
        "nproc": usable_cpus,
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "mem_total_bytes": _mem_total_bytes(),
        "python_version": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
        "git_revision": _git_revision(),
        # Other work on the machine skews every figure; ratios measured side
        # by side in one run are robust to it, absolute numbers are not.
        "loadavg_at_start": list(LOADAVG_AT_START),
        "loadavg_at_end": list(os.getloadavg()),
    }
    try:
        import numpy

        info["numpy_version"] = numpy.__version__
    except ImportError:
        pass
    return info


def write_result(name: str, payload: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    document = {"benchmark": name, "machine": machine_info(), **payload}
    path = RESULTS_DIR / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(document, indent=2, sort_keys=False, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    progress(f"wrote {path.relative_to(REPO_ROOT)}")
    return path


# ---------------------------------------------------------------------------
# Statistics


def percentile(values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile (fraction in [0, 1]); values need not be sorted."""
    if not values:
        raise ValueError("percentile of nothing")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-fraction * len(ordered) // 1))))
    return ordered[rank - 1]


def summarize_latencies(seconds: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/min/max/mean in milliseconds."""
    return {
        "calls": len(seconds),
        "p50_ms": percentile(seconds, 0.50) * 1e3,
        "p90_ms": percentile(seconds, 0.90) * 1e3,
        "p99_ms": percentile(seconds, 0.99) * 1e3,
        "min_ms": min(seconds) * 1e3,
        "max_ms": max(seconds) * 1e3,
        "mean_ms": statistics.fmean(seconds) * 1e3,
    }


def summarize_rates(bytes_per_rep: int, seconds: Sequence[float]) -> dict[str, Any]:
    """Bandwidth in GiB/s over repetitions that each moved `bytes_per_rep`."""
    rates = [bytes_per_rep / s / (1 << 30) for s in seconds]
    return {
        "bytes_per_rep": bytes_per_rep,
        "reps": len(seconds),
        "seconds": list(seconds),
        "gib_s": rates,
        "best_gib_s": max(rates),
        "median_gib_s": statistics.median(rates),
    }


def ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


# ---------------------------------------------------------------------------
# Profiles (printed when a target is missed)


def profile_call(fn: Callable[[], Any], *, top: int = 25, title: str = "") -> str:
    """Run `fn` under cProfile; return (and print) the top functions."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        fn()
    finally:
        profiler.disable()
    buffer = io.StringIO()
    stats = pstats.Stats(profiler, stream=buffer)
    stats.strip_dirs()
    buffer.write(f"==== profile: {title} (sorted by cumulative time) ====\n")
    stats.sort_stats("cumulative").print_stats(top)
    buffer.write(f"==== profile: {title} (sorted by own time) ====\n")
    stats.sort_stats("tottime").print_stats(top)
    text = buffer.getvalue()
    report(text)
    return text


def py_spy_available() -> str | None:
    return shutil.which("py-spy")


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_bytes() -> int:
    """Resident set size of this process from /proc (Linux)."""
    with open("/proc/self/statm", encoding="utf-8") as handle:
        resident_pages = int(handle.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------
# Redis baseline


class RedisServer:
    """A throwaway redis-server on loopback: no persistence, no eviction.

        with RedisServer() as server:
            r = server.client()
    """

    def __init__(self, directory: Path, port: int | None = None) -> None:
        self.directory = Path(directory)
        self.port = port or free_tcp_port()
        self.process: subprocess.Popen | None = None
        self.log_path = self.directory / "redis.log"

    def __enter__(self) -> RedisServer:
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [
            binary,
            "--bind", "127.0.0.1",
            "--port", str(self.port),
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.directory),
            "--protected-mode", "yes",
            "--maxmemory", "0",
            "--logfile", str(self.log_path),
        ]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        import redis

        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}: {self._log_tail()}")
            try:
                redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1).ping()
                break
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {self._log_tail()}") from None
                time.sleep(0.05)
        return self

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-2000:]
        except OSError:
            return "(no log)"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=120)

    def __exit__(self, *exc_info: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def redis_info() -> dict[str, Any]:
    info: dict[str, Any] = {}
    binary = shutil.which("redis-server")
    if binary:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, check=False)
        info["redis_server_version"] = out.stdout.strip()
    try:
        import hiredis
        import redis

        info["redis_py_version"] = redis.__version__
        info["hiredis_version"] = getattr(hiredis, "__version__", "installed")
        from redis.utils import HIREDIS_AVAILABLE

        info["redis_py_uses_hiredis"] = bool(HIREDIS_AVAILABLE)
    except ImportError as error:
        info["redis_py_error"] = str(error)
    return info
