"""disk.slack_profile through a real daemon: write-back jobs sized to the slack a measured table leaves
in the latest restore's layers (kvd.planner.slack), a table that is not one refused at start, and the
table measured from a real Hugging Face model (bench/slack_profile.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec, chain_keys
from kvd.planner.slack import SlackTable
from kvd.testing.daemon import start_daemon

ROOT = Path(__file__).resolve().parents[2]
SPEC = NamespaceSpec(model_id="slack-model", num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16,
                     kv_dtype=DType.FLOAT32)
HOST_SLOTS = 8
CHAIN = 8


def config(tmp_path: Path, **disk) -> dict:
    settings = {"directories": [str(tmp_path / "nvme0")], "capacity_bytes": 8 << 20, "slot_bytes": 64 << 10,
                "segment_bytes": 4 << 20, "fsync": "none", "write_batch_blocks": 64, "write_chunk_blocks": 8,
                "read_extent_bytes": SPEC.layer_bytes}  # restores in one group per layer: writes may go between
    settings.update(disk)
    return {"host": {"capacity_bytes": HOST_SLOTS * (64 << 10), "slot_bytes": 64 << 10}, "disk": settings}


def write_chunks(daemon) -> float:
    return daemon.metric("kvd_disk_write_chunks_total")


def chain(seed: int) -> tuple[list[bytes], np.ndarray]:
    data = np.random.default_rng(seed).standard_normal((CHAIN, *SPEC.block_shape), dtype=np.float32)
    return chain_keys(SPEC, np.arange(CHAIN * SPEC.block_tokens) + seed * 10_000), data


def chunks_for_a_durable_chain(tmp_path: Path, disk: dict) -> float:
    """Write chunks one durable Put of CHAIN blocks takes, after the daemon has seen a write and a restore."""
    daemon = start_daemon(tmp_path / "kvd", config(tmp_path, **disk))
    try:
        with Client(daemon.unix_target) as client:
            namespace = client.register_namespace(SPEC)
            (a_keys, a), (b_keys, b), (c_keys, c) = chain(1), chain(2), chain(3)
            client.put(namespace, a_keys, a, durable=True)  # written: a write job seen
            client.put(namespace, b_keys, b, durable=True)  # host memory full: a's blocks leave it
            np.testing.assert_array_equal(client.get_numpy(namespace, a_keys), a)  # a restore from disk
            before = write_chunks(daemon)
            client.put(namespace, c_keys, c, durable=True)
            return write_chunks(daemon) - before
    finally:
        daemon.stop()


def test_write_chunks_shrink_to_the_slack_of_the_latest_restore(tmp_path):
    tight = SlackTable("tiny-windows", SPEC.num_layers, SPEC.layer_bytes // SPEC.block_tokens, (1,), (0,),
                       np.full((1, 1, SPEC.num_layers), 1e-9))
    tight.save(tmp_path / "tight.json")
    roomy = SlackTable("long-windows", SPEC.num_layers, SPEC.layer_bytes // SPEC.block_tokens, (1,), (0,),
                       np.full((1, 1, SPEC.num_layers), 10.0))
    roomy.save(tmp_path / "roomy.json")
    assert chunks_for_a_durable_chain(tmp_path / "fixed", {}) == 1  # write_chunk_blocks = 8: one chunk
    # No slack anywhere: one block per chunk, so a restore never waits for more than two.
    assert chunks_for_a_durable_chain(tmp_path / "tight", {"slack_profile": str(tmp_path / "tight.json")}) == CHAIN
    assert chunks_for_a_durable_chain(tmp_path / "roomy", {"slack_profile": str(tmp_path / "roomy.json"),
                                                           "write_chunk_blocks": 2}) == 1


def test_write_chunks_are_capped_in_bytes_whatever_the_block_size(tmp_path):
    """disk.write_chunk_bytes: 8 blocks of 64 KiB a chunk by default, 2 under a 128 KiB cap, and
    one block at least when a block is larger than the cap."""
    assert SPEC.block_bytes == 64 << 10
    assert chunks_for_a_durable_chain(tmp_path / "capped", {"write_chunk_bytes": 128 << 10}) == CHAIN / 2
    assert chunks_for_a_durable_chain(tmp_path / "tiny", {"write_chunk_bytes": 4096}) == CHAIN


def test_a_slack_profile_that_is_not_a_table_stops_the_start_naming_the_field(tmp_path):
    (tmp_path / "bad.json").write_text('{"format": "kvd-slack-table/1", "model": "m"}')
    with pytest.raises(Exception) as failed:
        start_daemon(tmp_path / "kvd", config(tmp_path, slack_profile=str(tmp_path / "bad.json")))
    assert "disk.slack_profile" in str(failed.value)


def test_the_table_is_measured_from_a_real_model(tmp_path):
    out = tmp_path / "table.json"
    subprocess.run([sys.executable, str(ROOT / "bench/slack_profile.py"), "--out", str(out), "--inputs", "8", "512",
                    "--prefixes", "0", "256", "--repeats", "1"], check=True, capture_output=True, timeout=300)
    table = SlackTable.load(out)
    assert table.layers == 4 and table.kv_bytes_per_token_layer == 2 * 2 * 64 * 4  # the tiny Llama, float32
    # 64 times the new tokens take longer in every layer, whatever the noise.
    assert np.all(table.windows(512, 0) > table.windows(8, 0))
