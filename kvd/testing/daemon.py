"""Run a real kvd daemon in a subprocess, for tests and benchmarks.

    with run_daemon(tmp_path, config={"host": {"capacity_bytes": 64 << 20}}) as daemon:
        client = Client(daemon.unix_target)

The daemon listens on a unix socket in its state directory and on loopback
TCP and metrics ports chosen by the kernel; `run_daemon` waits until the
gRPC health service says SERVING, and on exit sends SIGTERM and checks that
the daemon drained and exited cleanly.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0


def to_toml(values: dict[str, Any], prefix: str = "") -> str:
    """A minimal TOML writer for config dicts (scalars and one level of tables)."""
    scalars = []
    tables = []
    for key, value in values.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, bool):
            scalars.append(f"{key} = {'true' if value else 'false'}")
        elif isinstance(value, (int, float)):
            scalars.append(f"{key} = {value}")
        elif isinstance(value, (list, tuple)):
            scalars.append(f"{key} = {json.dumps([str(item) for item in value])}")
        else:
            scalars.append(f"{key} = {json.dumps(str(value))}")
    text = "\n".join(scalars) + "\n"
    for key, table in tables:
        name = f"{prefix}{key}"
        text += f"\n[{name}]\n" + to_toml(table, f"{name}.")
    return text


def log_problems(log: str) -> list[str]:
    """Lines of a daemon log at level error or critical, or with a traceback."""
    problems = []
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            if "Traceback" in line:
                problems.append(line)
            continue
        if record.get("level", "").lower() in ("error", "critical") or "traceback" in json.dumps(record).lower():
            problems.append(line)
    return problems


@dataclass
class DaemonProcess:
    process: subprocess.Popen
    state_dir: Path
    log_path: Path
    endpoints: dict[str, Any]
    # The address its TCP and metrics listeners are bound to (a network
    # namespace's, kvd.testing.netns, or loopback).
    host: str = "127.0.0.1"

    @property
    def unix_target(self) -> str:
        return f"unix://{self.endpoints['unix_socket']}"

    @property
    def tcp_target(self) -> str:
        return f"{self.host}:{self.endpoints['tcp_port']}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.endpoints['metrics_port']}/metrics"

    @property
    def arena_socket(self) -> str:
        return self.endpoints["arena_socket"]

    @property
    def pid(self) -> int:
        return self.process.pid

    def metric(self, name: str) -> float | None:
        """Current value of an unlabelled metric from the daemon's /metrics."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return None

    def metric_samples(self, name: str) -> dict[str, float]:
        """Every sample of metric `name`, keyed by its line up to the value
        (`kvd_rpc_total{code="OK",method="Get"}`), from the daemon's /metrics."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as response:
            text = response.read().decode()
        samples = {}
        for line in text.splitlines():
            if line.startswith((name + "{", name + " ")):
                key, value = line.rsplit(" ", 1)
                samples[key] = float(value)
        return samples

    def rss_bytes(self) -> int:
        """The daemon's resident set (VmRSS), the shared-memory arena included."""
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmRSS for pid {self.pid}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Signal the daemon and wait; returns its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise RuntimeError(f"kvd did not stop within {timeout_s}s after {sig!r}:\n{self.log()[-4000:]}")
        return self.process.returncode


def _wait_ready(process: subprocess.Popen, state_dir: Path, log_path: Path) -> dict[str, Any]:
    endpoints_path = state_dir / "endpoints.json"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"kvd exited with {process.returncode} during start:\n{log_path.read_text()[-4000:]}")
        if endpoints_path.exists():
            endpoints = json.loads(endpoints_path.read_text())
            if endpoints.get("pid") == process.pid and _serving(f"unix://{endpoints['unix_socket']}"):
                return endpoints
        time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"kvd not ready within {START_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}")


def _serving(target: str) -> bool:
    with grpc.insecure_channel(target) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError:
            return False
    return response.status == health_pb2.HealthCheckResponse.SERVING


def start_daemon(
    directory: Path, config: dict[str, Any] | None = None, env: dict[str, str] | None = None,
    netns_host=None,
) -> DaemonProcess:
    """Start kvd on a config built from test defaults and `config`; `netns_host` (a
    kvd.testing.netns.Host) runs it inside that namespace, listening on its address."""
    host = netns_host.address if netns_host is not None else "127.0.0.1"
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state_dir = directory / "state"
    config_path = directory / "kvd.toml"
    values: dict[str, Any] = {
        "state_dir": str(state_dir),
        "server": {"tcp_address": f"{host}:0", "grace_period_s": 5.0},
        "metrics": {"address": f"{host}:0"},
        "host": {"capacity_bytes": 64 << 20, "slot_bytes": 1 << 20},
        "log": {"level": "info", "format": "json"},
    }
    for section, settings in (config or {}).items():
        if isinstance(settings, dict):
            values.setdefault(section, {}).update(settings)
        else:
            values[section] = settings
    config_path.write_text(to_toml(values))
    log_path = directory / "kvd.log"
    child_env = dict(os.environ)
    child_env.update(env or {})
    with open(log_path, "wb") as log_file:
        command = [sys.executable, "-m", "kvd", "serve", "--config", str(config_path)]
        process = subprocess.Popen(
            netns_host.wrap(command) if netns_host is not None else command,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=child_env,
        )
    try:
        endpoints = _wait_ready(process, state_dir, log_path)
    except BaseException:
        if process.poll() is None:
            process.kill()
            process.wait()
        raise
    return DaemonProcess(process, state_dir, log_path, endpoints, host)


@contextlib.contextmanager
def run_daemon(
    directory: Path,
    config: dict[str, Any] | None = None,
    env: dict[str, str] | None = None,
    check_clean_exit: bool = True,
    netns_host=None,
) -> Iterator[DaemonProcess]:
    daemon = start_daemon(directory, config, env, netns_host)
    leaked = None
    try:
        yield daemon
    finally:
        killed_by_test = daemon.process.poll() is not None
        if not killed_by_test and daemon.endpoints.get("metrics_port"):
            # Every test that runs a daemon also checks it leaked no handle.
            leaked = daemon.metric("kvd_leaked_handles_total")
        code = daemon.stop()
    if check_clean_exit and not killed_by_test and code != 0:
        raise RuntimeError(f"kvd exited with {code} after SIGTERM:\n{daemon.log()[-4000:]}")
    if check_clean_exit and leaked:
        raise RuntimeError(f"kvd leaked {leaked:.0f} block handles:\n{daemon.log()[-4000:]}")
