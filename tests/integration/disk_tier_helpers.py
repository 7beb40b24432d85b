"""Shared pieces of the tests of the disk tier through a real daemon
(tests/integration/test_disk_tier*.py, and others that run a daemon with a
disk tier): its namespace and configuration, blocks, a corrupt block on the
drives, and readers of the daemon's log and metrics."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import numpy as np

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec
from kvd.testing.daemon import run_daemon

# 4 layers x 16 KiB: every layer is one 4 KiB-aligned extent on disk.
SPEC = NamespaceSpec(model_id="disk-model", num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16,
                     kv_dtype=DType.FLOAT32)
HOST_SLOTS = 16


def disk_config(tmp_path: Path, **disk) -> dict:
    settings = {
        "directories": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")],
        "capacity_bytes": 8 << 20,
        "slot_bytes": 64 << 10,
        "segment_bytes": 4 << 20,
        "fsync": "strict",
        "write_batch_blocks": 4,
    }
    settings.update(disk)
    return {"host": {"capacity_bytes": HOST_SLOTS * (64 << 10), "slot_bytes": 64 << 10}, "disk": settings}


def blocks_for(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, *SPEC.block_shape), dtype=np.float32)


def flip_first_layer_byte(tmp_path: Path, block: np.ndarray) -> int:
    """Flip a byte of `block`'s first layer wherever the drives under
    tmp_path hold it (found by content, as a failing drive would scramble
    it); returns how many copies were flipped."""
    needle = block.reshape(-1).view(np.uint8)[:4096].tobytes()
    flipped = 0
    for segment in sorted(set(tmp_path.glob("nvme*/**/seg-*"))):
        data = bytearray(segment.read_bytes())
        position = data.find(needle)
        if position >= 0:
            data[position + 100] ^= 0xFF
            segment.write_bytes(bytes(data))
            flipped += 1
    return flipped


def stored_with_a_corrupt_block(tmp_path: Path, seed: int) -> tuple[Path, dict, list[bytes], np.ndarray]:
    """Six blocks made durable by one daemon run, then block 3 corrupted on
    the drives while no daemon runs: (daemon directory, config, keys, blocks
    as they were Put)."""
    directory = tmp_path / "d"
    config = disk_config(tmp_path)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(6 * 16))
        blocks = blocks_for(6, seed=seed)
        client.put(namespace, keys, blocks, durable=True)
    # Flip bytes everywhere on the drives where block 3's first layer sits.
    assert flip_first_layer_byte(tmp_path, blocks[3]) == 1
    return directory, config, keys, blocks


def log_records(daemon) -> list[dict]:
    """The daemon's JSON log lines, parsed (other lines skipped)."""
    records = []
    for line in daemon.log().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def wait_until(condition, timeout_s: float = 120.0) -> None:
    """Poll a condition of the daemon (its metrics) until it holds; the
    timeout only turns a hang into a failure."""
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the daemon never reached the awaited state"
        time.sleep(0.02)


def metric_samples(url: str) -> dict[str, float]:
    samples = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
