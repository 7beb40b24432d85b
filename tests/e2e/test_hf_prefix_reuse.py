"""Real-model prefix reuse through a real daemon, across two processes.

A store process prefills a >= 1024-token prompt with a small seeded Llama and
PUTs the full blocks; it exits.  A separate restore process GETs them,
rebuilds the transformers cache and runs only what follows the stored
blocks.  Every claim is checked on data the processes wrote out:

  * the restored logits are bit-identical to those of the same model
    continuing from its own in-memory cache of the same prefix;
  * they agree with a full recompute of prompt+suffix to 1e-5;
  * exactly prompt_tokens // block_tokens blocks came back, and their bytes
    are the bytes the store process computed (digest comparison).

Run once with block bytes through the shared-memory arena and once inline
over gRPC.

Then the same across a daemon restart: the store process puts durably into
a daemon with a disk tier, the daemon is stopped with SIGTERM (or killed
with SIGKILL) and started again on the same drives, and the restore process
finds the prefix on disk only (Lookup says TIER_DISK for every block) and
must meet the same three claims.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvd.testing.daemon import run_daemon, start_daemon

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hf_prefix_reuse.py"
BLOCK_TOKENS = 16
SUFFIX_TOKENS = 24
# Geometry of the example model: 4 layers, K and V, 2 KV heads, head_dim 64, float32.
BLOCK_BYTES = 4 * 2 * 2 * BLOCK_TOKENS * 64 * 4


def _run_role(
    role: str, target: str, prompt_tokens: int, seed: int, shared_memory: str, out: Path, durable: bool = False
) -> dict:
    cmd = [
        sys.executable,
        str(EXAMPLE),
        "--role", role,
        "--target", target,
        "--prompt-tokens", str(prompt_tokens),
        "--suffix-tokens", str(SUFFIX_TOKENS),
        "--block-tokens", str(BLOCK_TOKENS),
        "--seed", str(seed),
        "--shared-memory", shared_memory,
        "--json", str(out / f"{role}.json"),
    ]  # fmt: skip
    if role == "restore":
        cmd += ["--save-logits", str(out / "logits.pt")]
    if durable:
        cmd += ["--durable"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{role} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads((out / f"{role}.json").read_text())[role]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("shared_memory", "prompt_tokens"),
    [
        # A prompt of whole blocks: the restored run computes only the suffix.
        pytest.param("on", 1024, id="shared-memory"),
        # A prompt with a partial last block: its 6 tail tokens are recomputed.
        pytest.param("off", 1030, id="inline-grpc"),
    ],
)
def test_restored_prefix_matches_in_memory_cache(tmp_path: Path, shared_memory: str, prompt_tokens: int) -> None:
    config = {"host": {"capacity_bytes": 256 << 20, "slot_bytes": 1 << 20}}
    seed = 11
    with run_daemon(tmp_path / "daemon", config=config) as daemon:
        store = _run_role("store", daemon.unix_target, prompt_tokens, seed, shared_memory, tmp_path)
        restore = _run_role("restore", daemon.unix_target, prompt_tokens, seed, shared_memory, tmp_path)

    _check_restore(store, restore, tmp_path, shared_memory, prompt_tokens)
    # No disk tier: the prefix was in host memory when the restore began.
    assert restore["lookup_tiers"] == ["host"] * (prompt_tokens // BLOCK_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop", "shared_memory", "prompt_tokens"),
    [
        # A drained restart: whole blocks through the shared-memory arena.
        pytest.param(signal.SIGTERM, "on", 1024, id="sigterm-shared-memory"),
        # A kill right after the durable Put returned, with a partial last
        # block, inline over gRPC (PutInline and inline Get from disk).
        pytest.param(signal.SIGKILL, "off", 1030, id="sigkill-inline-grpc"),
    ],
)
def test_durable_prefix_is_restored_from_disk_after_a_restart(
    tmp_path: Path, stop: signal.Signals, shared_memory: str, prompt_tokens: int
) -> None:
    """The store run puts durably; the daemon stops (SIGTERM) or dies (SIGKILL)
    and starts again on the same drives with an empty host tier; the restore
    run then finds the whole prefix on disk only and restores it exactly."""
    config = {
        "host": {"capacity_bytes": 16 << 20, "slot_bytes": BLOCK_BYTES},
        "disk": {
            "directories": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")],
            "capacity_bytes": 16 << 20,
            "slot_bytes": BLOCK_BYTES,
            "segment_bytes": 4 << 20,
            "fsync": "strict",
        },
    }
    seed = 12
    directory = tmp_path / "daemon"
    daemon = start_daemon(directory, config=config)
    try:
        store = _run_role("store", daemon.unix_target, prompt_tokens, seed, shared_memory, tmp_path, durable=True)
    finally:
        code = daemon.stop(stop)
    assert code == (0 if stop == signal.SIGTERM else -signal.SIGKILL), daemon.log()[-4000:]
    with run_daemon(directory, config=config) as daemon:
        restore = _run_role("restore", daemon.unix_target, prompt_tokens, seed, shared_memory, tmp_path)

    n_blocks = prompt_tokens // BLOCK_TOKENS
    assert store["durable"] is True
    # Every block of the prefix was on disk, and only there, before the Get.
    assert restore["lookup_matched"] == n_blocks
    assert restore["lookup_tiers"] == ["disk"] * n_blocks
    _check_restore(store, restore, tmp_path, shared_memory, prompt_tokens)


def _check_restore(store: dict, restore: dict, out: Path, shared_memory: str, prompt_tokens: int) -> None:
    n_blocks = prompt_tokens // BLOCK_TOKENS
    restored_tokens = n_blocks * BLOCK_TOKENS
    # Both processes built the same model from the seed (otherwise nothing
    # below would mean anything).
    assert store["weights_digest"] == restore["weights_digest"]
    # The blocks really took the path this case is about.
    assert store["shared_memory"] is restore["shared_memory"] is (shared_memory == "on")

    # (c) block count and bytes.
    assert store["blocks"] == store["blocks_written"] == n_blocks
    assert store["block_bytes"] == BLOCK_BYTES
    assert restore["requested_blocks"] == (prompt_tokens + SUFFIX_TOKENS) // BLOCK_TOKENS
    assert restore["restored_blocks"] == n_blocks
    assert restore["restored_tokens"] == restored_tokens
    assert restore["fetched_bytes"] == n_blocks * BLOCK_BYTES
    assert restore["fetched_digest"] == store["blocks_digest"]
    # The restore process recomputing the prefix gets the very same bytes, so
    # its in-memory reference below starts from the stored state exactly.
    assert restore["own_blocks_digest"] == store["blocks_digest"]

    logits = torch.load(out / "logits.pt")
    restored, own, full = logits["restored"], logits["own_cache"], logits["full"]
    rest = prompt_tokens + SUFFIX_TOKENS - restored_tokens
    assert restored.dtype == own.dtype == full.dtype == torch.float32
    assert restored.shape == own.shape == full.shape == (rest, 1000)
    # Guard against a vacuous comparison (e.g. all-zero logits).
    assert restored.std() > 1e-3 and torch.isfinite(restored).all()

    # (a) bit-exact against continuing from the in-memory cache.
    assert torch.equal(restored, own)
    assert restore["restored_equals_own_cache"] is True
    # (b) close to a full recompute of the whole prompt + suffix.
    assert (restored - full).abs().max().item() <= 1e-5

    assert restore["ttft_restore_s"] > 0 and restore["ttft_full_s"] > 0
