"""bench_peers' rows for vLLM's own storage paths (issue 38 item 4), driven small and fast.

Each vLLM driver runs in vLLM's venv as bench_peers runs it: a few blocks stored (unsynced and
with a syncfs), restored and checked against the pattern by the driver itself. The object-store
tier of the tiering connector cannot be built here; its row must say so with vLLM's own
exception and where vLLM raised it, never with a figure. The ratios and the printed table are
checked on figures made up for the purpose.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "peers"))

import bench_peers  # noqa: E402
import protocol  # noqa: E402
from _peer_process import start_all  # noqa: E402

VLLM_ROWS = ("vllm-fs", "vllm-tiering-fs", "vllm-tiering-obj", "vllm-simple-disk")


@pytest.fixture
def peers_dir():
    """A directory on the repository's file system (O_DIRECT works there, as the benchmark needs)."""
    directory = Path(tempfile.mkdtemp(prefix="kvd-peers-test-", dir=ROOT))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def small_workload(root: Path, spec) -> protocol.Workload:
    directory = root / spec.name
    directory.mkdir()
    return protocol.Workload(dir=str(directory), layers=4, layer_bytes=64 << 10, blocks=6)


def test_every_vllm_storage_path_stores_and_restores_or_says_why_not(engine_python, peers_dir):
    specs = [spec for spec in bench_peers.DISK_CONTENDERS if spec.name in VLLM_ROWS]
    assert sorted(spec.name for spec in specs) == sorted(VLLM_ROWS)
    refused: dict[str, dict] = {}
    contenders = start_all(specs, lambda spec: small_workload(peers_dir, spec), peers_dir, refused)
    try:
        assert sorted(contenders) == ["vllm-fs", "vllm-simple-disk", "vllm-tiering-fs"]
        for name, contender in contenders.items():
            for label, fields in contender.spec.store_variants:
                contender.ask("clear")
                stored = contender.ask("store", **fields)
                assert stored["ok"] and stored["seconds"] > 0, (name, label)
            contender.ask("cold")
            assert contender.ask("restore")["ok"], name  # the driver checked every byte
        init_error = contenders["vllm-simple-disk"].notes["init_error"]
        assert "CUDA" in init_error["error"]
        assert init_error["raised_at"].startswith("vllm/v1/simple_kv_offload/")
    finally:
        bench_peers.close_all(contenders)
    row = refused["vllm-tiering-obj"]
    assert row["status"] == "could not run"
    assert row["error"] == "TypeError: 'NoneType' object is not callable"  # NIXL is not installed
    assert row["raised_at"].startswith("vllm/v1/kv_offload/tiering/obj/manager.py:")


def test_ratios_and_table_name_each_vllm_path(capsys):
    def entry(rate: float) -> dict:
        return {"median_gib_s": rate, "best_gib_s": rate, "gib_s": [rate]}

    results = {"kvd-pinned restore": entry(2.0), "kvd-pinned store none": entry(1.5),
               "kvd-pinned store strict": entry(1.2), "vllm-fs restore": entry(1.0),
               "vllm-fs store": entry(3.0), "vllm-fs store+sync": entry(2.4),
               "vllm-simple-disk restore": entry(0.5), "vllm-simple-disk store": entry(0.75),
               "vllm-simple-disk store+sync": entry(0.6)}
    ratios = bench_peers.disk_ratios(results)
    assert ratios["kvd-pinned restore / vllm-fs restore"] == pytest.approx(2.0)
    assert ratios["kvd-pinned store none / vllm-fs store"] == pytest.approx(0.5)
    assert ratios["kvd-pinned store strict / vllm-simple-disk store+sync"] == pytest.approx(2.0)
    assert not any("vllm-tiering" in key for key in ratios)  # rows that did not run give no ratio
    assert ratios["restore_pinned"]["vs"] == "vllm-fs restore"  # the best peer's restore
    refused = {"vllm-tiering-obj": {"status": "could not run", "error": "TypeError: x", "raised_at": "vllm/a.py:1"}}
    bench_peers.print_phase("disk", {"total_bytes": 1 << 20, "layer_bytes": 1 << 16, "results": results,
                                     "ratios": ratios, "could_not_run": refused})
    printed = capsys.readouterr().out
    assert "vllm-tiering-obj" in printed and "could not run: TypeError: x (vllm/a.py:1)" in printed
    assert "kvd-pinned restore / vllm-simple-disk restore" in printed
