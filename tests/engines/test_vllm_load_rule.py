"""Load or recompute (issue 38 item 1) in the vLLM connector's scheduler side, run in vLLM's venv
against a real daemon with a disk tier on real files: with a prefill profile the hit is priced from
the daemon's Lookup(load_times) and only the blocks that load sooner than vLLM computes them are
offered; without one, every matched block is."""

from __future__ import annotations

import json
import subprocess

import numpy as np

from kvd.client import Client
from kvd.core.keys import chain_keys
from kvd.planner.prefill import FORMAT
from kvd.testing.daemon import run_daemon
from kvd.v1 import kvd_pb2
from tests.engines.conftest import ROOT
from tests.engines.load_rule_probe import BLOCKS, PROMPT, SPEC


def config(tmp_path) -> dict:
    return {"host": {"capacity_bytes": 16 << 20, "slot_bytes": 64 << 10},
            "disk": {"directories": [str(tmp_path / "nvme0")], "capacity_bytes": 64 << 20,
                     "segment_bytes": 8 << 20, "slot_bytes": 64 << 10, "write_mode": "through"}}


def profile(path, per_token_s: float):
    """Prefill at per_token_s a token (and a millisecond more per step), whatever the prefix."""
    new = [1, 64, 4096]
    path.write_text(json.dumps({"format": FORMAT, "model": "load-rule-model", "engine": "test", "new_tokens": new,
                                "prefixes": [0], "seconds": [[1e-3 + n * per_token_s] for n in new]}))
    return str(path)


def test_only_the_blocks_that_load_sooner_than_vllm_computes_them_are_offered(tmp_path, engine_python):
    with run_daemon(tmp_path / "kvd", config=config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = chain_keys(SPEC, PROMPT[:BLOCKS * SPEC.block_tokens])
        data = np.random.default_rng(5).standard_normal((BLOCKS, *SPEC.block_shape), dtype=np.float32)
        assert client.put(namespace, keys, data, durable=True) == BLOCKS
        assert client.demote().blocks_demoted >= BLOCKS
        assert len(client.get_numpy(namespace, keys[:3])) == 3  # read from disk: the drives' rate is known
        looked = client.lookup(namespace, keys, load_times=True)
        assert list(looked.tiers) == [kvd_pb2.TIER_HOST] * 3 + [kvd_pb2.TIER_DISK] * 5
        disk_block_s = looked.load_s[-1] / 5
        configs = {  # in this order: a hit that is loaded is prefetched, and then it is in host memory
            # computing a block's 16 tokens takes far less than reading it: only the host blocks are
            # worth loading; vLLM computes the disk ones (and they are not prefetched)
            "fast compute": {"prefill_profile": profile(tmp_path / "fast.json", disk_block_s / 1000)},
            # far longer: load all 8
            "slow compute": {"prefill_profile": profile(tmp_path / "slow.json", 1000 * disk_block_s)},
            "no profile": {},
        }
        probe = subprocess.run([str(engine_python), str(ROOT / "tests/engines/load_rule_probe.py"),
                                daemon.unix_target, json.dumps(configs)], capture_output=True, text=True,
                               timeout=300, cwd=ROOT, check=False)
        assert probe.returncode == 0, probe.stderr[-3000:]
        answers = json.loads(probe.stdout.splitlines()[-1])
        block = SPEC.block_tokens
        assert answers["no profile"][0] == answers["slow compute"][0] == BLOCKS * block
        assert answers["fast compute"] == [3 * block, False]  # host blocks only: a synchronous load
        assert "loading 3 of 8 hit blocks, computing the rest" in probe.stdout + probe.stderr  # and says so
