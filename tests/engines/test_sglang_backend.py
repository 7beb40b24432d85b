"""kvd's SGLang HiCache backend against SGLang's real classes, on the CPU.

The daemons run from kvd's venv; SGLang runs in its own (.venv-sglang, built
by `make sglang-venv`) through tests/engines/sglang_harness.py, which builds
SGLang's real device pool, host pool and HiCacheController, lets the
controller attach kvd through SGLang's StorageBackendFactory ("dynamic"),
and drives the controller's write-back (write_storage -> batch_set_v1) and
prefetch (prefetch -> batch_exists -> batch_get_v1) paths. Writes and reads
run in different processes, so a read gets only what kvd holds.

One module-scoped scenario (the imports cost about 10 s a process):
  1. write: prompt A (layer_first, prefix keys passed), prompt B
     (page_first, no prefix keys) and prompt D (page_head, SGLang's legacy
     non-zero-copy interface) to a daemon with a disk tier, and prompt C to
     a daemon without one;
  2. read, in a new process: A and B back bit-exact; other head_dim,
     another host layout and another namespace string see nothing; a page
     deleted with Client.delete (before the prefetch, or between its
     batch_exists and batch_get_v1) ends the hit there, the pages before
     it still exact and the host pages after it untouched;
  3. both daemons restarted: A comes back from the disk tier bit-exact,
     C (no disk tier) is a miss.
MLA pools (E, F, G: one latent per token) are written and read in the same
phases, E by TP rank 0 of 2 and read by rank 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from kvd.planner.prefill import FORMAT
from kvd.testing.daemon import run_daemon
from kvd.testing.etcd import EtcdServer
from tests.cluster.test_daemon_cluster import cluster_config, wait_metric
from tests.cluster.test_remote_fetch import fetched

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = ROOT / ".venv-sglang" / "bin" / "python"
HARNESS = Path(__file__).with_name("sglang_harness.py")
HARNESS_TIMEOUT_S = 240
PAGE_TOKENS = 16
PAGES = 12
# The first write-back operation covers pages [0, SPLIT); the second, the rest.
SPLIT = 5
HOST = {"capacity_bytes": 64 << 20, "slot_bytes": 64 << 10}


def disk_config(tmp_path: Path) -> dict:
    return {"host": HOST, "disk": {"directories": [str(tmp_path / "nvme0")], "capacity_bytes": 32 << 20,
                                   "slot_bytes": 64 << 10, "segment_bytes": 4 << 20, "fsync": "none"}}


def require_sglang_venv() -> None:
    if not SGLANG_PYTHON.exists():
        pytest.fail(f"{SGLANG_PYTHON} is missing: run `make sglang-venv` (mk/sglang.mk) to build SGLang's venv")


def harness(steps: list[dict]) -> list[dict]:
    """Run the steps in one .venv-sglang process; their results."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    completed = subprocess.run([str(SGLANG_PYTHON), str(HARNESS), json.dumps(steps)], capture_output=True, text=True,
                               timeout=HARNESS_TIMEOUT_S, env=env, cwd=ROOT)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("HARNESS-RESULT ")]
    if completed.returncode != 0 or not lines:
        pytest.fail(f"harness failed ({completed.returncode}):\n{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("HARNESS-RESULT "))


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    """Run the three phases; their results by name."""
    require_sglang_venv()
    base = tmp_path_factory.mktemp("sglang")
    results: dict[str, dict] = {}
    started = time.monotonic()
    with run_daemon(base / "disk", config=disk_config(base)) as disk_daemon, \
            run_daemon(base / "memory", config={"host": HOST}) as memory_daemon:
        a = {"target": disk_daemon.unix_target, "seed": 1, "layout": "layer_first"}
        b = {"target": disk_daemon.unix_target, "seed": 2, "layout": "page_first", "prefix_keys": False}
        c = {"target": memory_daemon.unix_target, "seed": 3}
        # SGLang without interface_v1: the legacy per-page batch_get/batch_set.
        d = {"target": disk_daemon.unix_target, "seed": 4, "layout": "page_head", "interface_v1": 0,
             "prefix_keys": False}
        # An MLA model's pools (one latent per token), TP rank 0 of 2, which SGLang lets write; rank 1
        # does not write (SGLang skips it) and must read rank 0's pages. Then two more host layouts.
        e = {"target": disk_daemon.unix_target, "seed": 5, "mla": True, "tp_rank": 0}
        f = {"target": disk_daemon.unix_target, "seed": 6, "mla": True, "layout": "page_first", "interface_v1": 0,
             "prefix_keys": False}
        g = {"target": disk_daemon.unix_target, "seed": 7, "mla": True, "layout": "page_first_direct"}
        # --kv-cache-dtype fp8_e4m3: SGLang keeps the float8 values in uint8 pools.
        h = {"target": disk_daemon.unix_target, "seed": 9, "dtype": "float8_e4m3fn", "kv_cache_dtype": "fp8_e4m3"}
        # h before e's rank 1: the harness publishes TP rank 1 of 2 for the rest of its process.
        names = ["write_a", "write_b", "write_c", "write_d", "write_h", "write_e", "write_e_rank1", "write_f", "write_g"]
        written = harness([{"op": "write", "try_device_write": True, **a}, {"op": "write", **b}, {"op": "write", **c},
                           {"op": "write", **d}, {"op": "write", **h}, {"op": "write", **e},
                           {"op": "write", **e, "tp_rank": 1, "seed": 8}, {"op": "write", **f}, {"op": "write", **g}])
        results.update(zip(names, written))
        reads = {
            "read_a": {**a},
            "read_b": {**b},
            "read_d": {**d},
            "other_head_dim": {**a, "head_dim": 32},
            "other_layout": {**a, "layout": "page_first"},
            "other_namespace": {**a, "namespace": "another-model"},
            "delete_before": {**b, "delete_page": 3},
            "delete_between": {**a, "delete_after_exists": 9},
            "read_e_rank1": {**e, "tp_rank": 1},
            "read_e_rank1_own": {**e, "tp_rank": 1, "seed": 8},
            "read_f": {**f},
            "read_g": {**g},
            "mla_other_layout": {**e, "layout": "page_first"},
            "fp8_as_e5m2": {**h, "kv_cache_dtype": "fp8_e5m2"},
        }
        results.update(zip(reads, harness([{"op": "read", **step} for step in reads.values()])))
    # Both daemons stopped (SIGTERM: the disk daemon writes its blocks back); start them again.
    with run_daemon(base / "disk", config=disk_config(base)) as disk_daemon, \
            run_daemon(base / "memory", config={"host": HOST}) as memory_daemon:
        # After the restart every page is on disk only. Reading a's measures the drive's rate; then d's
        # pages are priced at it, with a prefill profile that computes a page far faster than the drive
        # serves it, and one far slower.
        d = {**d, "target": disk_daemon.unix_target}
        after = harness([{"op": "read", **a, "target": disk_daemon.unix_target},
                         {"op": "read", **c, "target": memory_daemon.unix_target},
                         {"op": "read", **d, "prefill_profile": profile(base / "fast.json", per_token_s=1e-12)},
                         {"op": "read", **d, "prefill_profile": profile(base / "slow.json", per_token_s=1.0)},
                         {"op": "read", **h, "target": disk_daemon.unix_target}])
        (results["restart_disk"], results["restart_memory"], results["rule_fast"], results["rule_slow"],
         results["restart_fp8"]) = after
    results["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps({name: value for name, value in results.items() if name != "seconds"}, indent=1))
    return results


def profile(path: Path, per_token_s: float) -> str:
    new = [1, 4096]
    path.write_text(json.dumps({"format": FORMAT, "new_tokens": new, "prefixes": [0],
                                "seconds": [[1e-9 + n * per_token_s] for n in new]}))
    return str(path)


def test_an_mla_pools_latent_written_by_one_rank_is_read_bit_exact_by_another(scenario):
    """Stored under kv_order LATENT, one namespace for every TP rank: what rank 0 wrote, rank 1 reads."""
    tokens = PAGES * PAGE_TOKENS
    assert scenario["write_e"]["completed_tokens"] == [SPLIT * PAGE_TOKENS, (PAGES - SPLIT) * PAGE_TOKENS]
    assert scenario["write_e_rank1"]["completed_tokens"] == [0, 0]  # SGLang lets rank 0 write only
    read = scenario["read_e_rank1"]
    assert read["hit_tokens"] == read["loaded_tokens"] == tokens and read["bit_exact"]
    assert read["bytes_compared"] == 4 * tokens * 96 * 2  # layers x tokens x latent width x bfloat16
    assert scenario["read_e_rank1_own"]["hit_tokens"] == 0
    assert scenario["read_g"]["loaded_tokens"] == tokens and scenario["read_g"]["bit_exact"]
    # The legacy interface passes no prefix keys: the first write-back's pages, a chain from the root.
    assert scenario["read_f"]["loaded_tokens"] == SPLIT * PAGE_TOKENS and scenario["read_f"]["bit_exact"]
    assert scenario["mla_other_layout"]["hit_tokens"] == 0


def test_an_fp8_pool_is_stored_as_float8_and_read_back_bit_exact_after_a_restart(scenario):
    """SGLang's fp8 pools hold float8 in uint8 tensors: kvd stores them as float8 e4m3 (what
    --kv-cache-dtype names), on disk across a restart; the same pool served as e5m2 is another
    namespace. Before, registering the pool raised (dtype torch.uint8 has no kvd equivalent)."""
    tokens = PAGES * PAGE_TOKENS
    assert scenario["write_h"]["completed_tokens"] == [SPLIT * PAGE_TOKENS, (PAGES - SPLIT) * PAGE_TOKENS]
    read = scenario["restart_fp8"]
    assert read["hit_tokens"] == read["loaded_tokens"] == tokens and read["bit_exact"]
    assert read["bytes_compared"] == 4 * 2 * tokens * 2 * 64  # layers x K,V x tokens x heads x head_dim, 1 byte
    assert scenario["fp8_as_e5m2"]["hit_tokens"] == 0


def test_with_a_prefill_profile_only_pages_that_load_sooner_than_sglang_computes_them_are_reported(scenario):
    """SGLang computing a page far faster than kvd's drive serves it: batch_exists reports none of d's
    pages, all on disk, and nothing is loaded; far slower: all it reaches without a profile (its first
    write-back's pages, a chain from the root: see below), loaded bit-exact."""
    assert scenario["rule_fast"]["hit_tokens"] == 0
    slow = scenario["rule_slow"]
    assert slow["hit_tokens"] == slow["loaded_tokens"] == SPLIT * PAGE_TOKENS and slow["bit_exact"]


def test_write_back_through_the_controller_stores_every_page(scenario):
    for name in ("write_a", "write_b", "write_c", "write_d"):
        assert scenario[name]["completed_tokens"] == [SPLIT * PAGE_TOKENS, (PAGES - SPLIT) * PAGE_TOKENS], name
        assert scenario[name]["shared_memory"] is True, name  # Reserve/Commit/Get through the arena
    assert scenario["write_a"]["page_get"] == "_page_get_zero_copy"
    assert scenario["write_d"]["page_get"] == "_generic_page_get"
    # batch_exists: the longest stored prefix. With prefix keys the two
    # operations are one chain in kvd; without them the second operation
    # began a chain of its own, which a lookup from the root cannot reach.
    assert scenario["write_a"]["exists_after"] == PAGES
    assert scenario["write_b"]["exists_after"] == SPLIT
    assert scenario["write_d"]["exists_after"] == SPLIT


def test_prefetch_in_another_process_is_bit_exact(scenario):
    read_a = scenario["read_a"]
    assert read_a["hit_tokens"] == read_a["loaded_tokens"] == PAGES * PAGE_TOKENS
    assert read_a["bit_exact"] is True
    assert read_a["bytes_compared"] == PAGES * PAGE_TOKENS * 4 * 2 * 2 * 64 * 2
    # Without prefix keys (page_first pool): the first operation's pages, exact.
    read_b = scenario["read_b"]
    assert read_b["hit_tokens"] == read_b["loaded_tokens"] == SPLIT * PAGE_TOKENS
    assert read_b["bit_exact"] is True
    # The legacy interface (page_head pool): the same, one flat page per key.
    read_d = scenario["read_d"]
    assert read_d["hit_tokens"] == read_d["loaded_tokens"] == SPLIT * PAGE_TOKENS
    assert read_d["bit_exact"] is True


def test_another_layout_never_sees_the_pages(scenario):
    for name in ("other_head_dim", "other_layout", "other_namespace"):
        assert scenario[name]["hit_tokens"] == 0, name
        assert "loaded_tokens" not in scenario[name], name


def test_a_deleted_page_is_a_miss_and_never_wrong_bytes(scenario):
    before = scenario["delete_before"]  # deleted before the prefetch: batch_exists stops there
    assert before["deleted"] >= 1
    assert before["hit_tokens"] == before["loaded_tokens"] == 3 * PAGE_TOKENS
    assert before["bit_exact"] is True
    between = scenario["delete_between"]  # deleted after batch_exists said 12: batch_get_v1 stops there
    assert between["hit_tokens"] == PAGES * PAGE_TOKENS
    assert between["deleted"] == PAGES - 9  # the page and its descendants
    assert between["loaded_tokens"] == 9 * PAGE_TOKENS
    assert between["bit_exact"] is True
    assert between["rest_untouched"] is True


def test_a_restart_keeps_disk_pages_exact_and_loses_memory_pages(scenario):
    disk = scenario["restart_disk"]  # chain A after the delete of pages 9..11
    assert disk["hit_tokens"] == disk["loaded_tokens"] == 9 * PAGE_TOKENS
    assert disk["bit_exact"] is True
    assert scenario["restart_memory"]["hit_tokens"] == 0


def test_sglang_own_device_write_path_on_the_cpu_is_recorded(scenario):
    # SGLang's device->host copy (controller.write) has no CPU implementation;
    # the harness copies with torch instead and records what SGLang said.
    assert scenario["write_a"]["device_write"] is not None
    print("controller.write on the CPU:", scenario["write_a"]["device_write"])


def test_runs_within_budget(scenario):
    assert scenario["seconds"] < 150, scenario["seconds"]


def test_pages_another_node_stored_are_found_and_fetched(tmp_path):
    """Two daemons in a cluster (etcd; blocks between them over NIXL, or gRPC): SGLang's write-back
    stores a prompt's pages beside node x; SGLang beside node y counts them in batch_exists (the
    peer's pages, TIER_REMOTE) and batch_get_v1 has y fetch them from x: bit-exact (issue 37)."""
    require_sglang_venv()
    with EtcdServer() as etcd:
        configs = {name: {**cluster_config(etcd, name, "/kvd-sglang-cluster/"), "host": HOST} for name in "xy"}
        with run_daemon(tmp_path / "x", configs["x"]) as x, run_daemon(tmp_path / "y", configs["y"]) as y:
            for daemon in (x, y):
                wait_metric(daemon, "kvd_cluster_members", 2)
            chain = {"seed": 5, "layout": "layer_first"}
            written, = harness([{"op": "write", "target": x.unix_target, **chain}])
            assert written["exists_after"] == PAGES
            read, = harness([{"op": "read", "target": y.unix_target, **chain}])
            assert read["hit_tokens"] == read["loaded_tokens"] == PAGES * PAGE_TOKENS
            assert read["bit_exact"] is True
            assert sum(fetched(y, transport, peer="x") for transport in ("nixl", "grpc")) == PAGES
            assert x.metric("kvd_lease_pinned_blocks") == 0
