"""Demote through a real daemon: host copies the disk also holds are
dropped, the rest stay, and every demoted block reads back bit-exact."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec
from kvd.testing.daemon import run_daemon
from kvd.v1 import kvd_pb2

SPEC = NamespaceSpec(model_id="demote-model", num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16,
                     kv_dtype=DType.FLOAT32)
SLOT = 64 << 10


def config(tmp_path) -> dict:
    return {
        "host": {"capacity_bytes": 32 * SLOT, "slot_bytes": SLOT},
        # Blocks Put once without durable=True are never written (admission
        # wants 3 sightings): their host copy is their only one.
        "disk": {"directories": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")], "capacity_bytes": 8 << 20,
                 "slot_bytes": SLOT, "segment_bytes": 4 << 20, "fsync": "strict", "admission_min_hits": 3},
    }


def blocks_for(count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, *SPEC.block_shape), dtype=np.float32)


def tiers(client: Client, namespace, keys) -> list[int]:
    return list(client.lookup(namespace, keys).tiers)


def test_demote_keeps_pinned_and_unwritten_blocks_and_the_rest_read_back_from_disk(tmp_path):
    with run_daemon(tmp_path / "d", config=config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        durable, durable_blocks = namespace.keys(np.arange(6 * 16)), blocks_for(6, seed=1)
        unwritten, unwritten_blocks = namespace.keys(np.arange(3 * 16) + 10**6), blocks_for(3, seed=2)
        assert client.put(namespace, durable, durable_blocks, durable=True) == 6
        assert client.put(namespace, unwritten, unwritten_blocks) == 3
        HOST, DISK = kvd_pb2.TIER_HOST, kvd_pb2.TIER_DISK
        with client.get_pinned(namespace, durable[:2]) as held:
            assert held.matched == 2
            answer = client.demote()
            # Blocks 5, 4, 3, 2 leave, leaf first; 0 and 1 are held by the lease.
            assert (answer.blocks_demoted, answer.bytes_demoted, answer.blocks_kept) == (4, 4 * SPEC.block_bytes, 5)
            assert tiers(client, namespace, durable) == [HOST] * 2 + [DISK] * 4
            assert tiers(client, namespace, unwritten) == [HOST] * 3
        assert np.array_equal(client.get_numpy(namespace, durable), durable_blocks)
        assert tiers(client, namespace, durable) == [HOST] * 6
        # From the command line, with the lease gone: the whole durable chain.
        shown = subprocess.run([sys.executable, "-m", "kvd", "demote", "--state-dir", str(daemon.state_dir), "--json"],
                               capture_output=True, text=True, check=True)
        assert json.loads(shown.stdout) == {"blocks_demoted": 6, "bytes_demoted": 6 * SPEC.block_bytes,
                                            "blocks_kept": 3}
        assert tiers(client, namespace, durable) == [DISK] * 6
        assert np.array_equal(client.get_numpy(namespace, durable), durable_blocks)
        assert np.array_equal(client.get_numpy(namespace, unwritten), unwritten_blocks)
        samples = daemon.metric_samples("kvd_tier_evicted_blocks_total")
        assert samples['kvd_tier_evicted_blocks_total{reason="demoted_requested",tier="host"}'] == 10
        moves = daemon.metric_samples("kvd_tier_moves_total")
        assert moves['kvd_tier_moves_total{source_tier="disk",target_tier="host"}'] == 10
