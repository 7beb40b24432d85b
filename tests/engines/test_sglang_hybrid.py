"""kvd's SGLang backend with hybrid models' extra pools, through SGLang's real hybrid cache controller on
the CPU (tests/engines/sglang_hybrid_harness.py in .venv-sglang; writes and reads in separate processes).

SGLang 0.5.23 serves every model through its hybrid cache controller. A model with sliding-window
layers ("swa") or Mamba layers ("mamba") beside full attention stores, with each radix node's KV pages,
the state those layers resume from at the node's end: the window's last pages, or the Mamba state.
A prefix is restorable only where that state is stored. kvd keeps each extra pool in a namespace of
its own (kvd.connectors.sglang_pools). Checked here, for both kinds:
  - a prompt written with its state is found whole and loads bit-exact, KV and state;
  - another prompt, or the same one asked with another window, is a miss;
  - a prompt whose KV is stored to 6 pages but whose state only for 4 pages is restorable to 4 pages
    (and loads those bit-exact), never to 6;
  - a daemon restart keeps both on the disk tier.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from kvd.testing.daemon import run_daemon
from tests.engines.test_sglang_backend import ROOT, SGLANG_PYTHON, disk_config, require_sglang_venv

HARNESS = ROOT / "tests" / "engines" / "sglang_hybrid_harness.py"
PAGE = 16
WINDOWS = {"swa": 2, "mamba": 1}  # pages of state per prefix end


def harness(steps: list[dict]) -> list[dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    completed = subprocess.run([str(SGLANG_PYTHON), str(HARNESS), json.dumps(steps)], capture_output=True, text=True,
                               timeout=240, env=env, cwd=ROOT)
    lines = [line for line in completed.stdout.splitlines() if line.startswith("HARNESS-RESULT ")]
    if completed.returncode != 0 or not lines:
        pytest.fail(f"harness failed ({completed.returncode}):\n{completed.stdout[-3000:]}\n{completed.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("HARNESS-RESULT "))


@pytest.mark.parametrize("kind", sorted(WINDOWS))
def test_a_hybrid_models_state_is_stored_beside_its_kv_and_bounds_the_hit(tmp_path, kind):
    require_sglang_venv()
    base = {"kind": kind, "window": WINDOWS[kind]}
    with run_daemon(tmp_path / "kvd", config=disk_config(tmp_path)) as daemon:
        step = {**base, "target": daemon.unix_target}
        written = harness([{"op": "write", **step},
                           {"op": "write", **step, "seed": 2, "pages": 4},
                           {"op": "write", **step, "seed": 2, "pages": 6, "no_state": True}])
        assert [result["completed_tokens"] for result in written] == [6 * PAGE, 4 * PAGE, 6 * PAGE]
        whole, other, wider, state_at_4 = harness([
            {"op": "read", **step}, {"op": "read", **step, "seed": 3},
            {"op": "read", **step, "window": WINDOWS[kind] + 1}, {"op": "read", **step, "seed": 2, "pages": 6}])
    assert whole["hit_tokens"] == whole["loaded_tokens"] == 6 * PAGE
    assert whole["kv_exact"] and whole["extra_exact"]
    assert other["hit_tokens"] == 0 and wider["hit_tokens"] == 0
    # KV to 6 pages, state only at 4: restorable at 4, whose state and KV load exactly.
    assert state_at_4["hit_tokens"] == state_at_4["loaded_tokens"] == 4 * PAGE
    assert state_at_4["kv_exact"] and state_at_4["extra_exact"]
    with run_daemon(tmp_path / "kvd", config=disk_config(tmp_path)) as daemon:  # the disk tier keeps both
        (after,) = harness([{"op": "read", **base, "target": daemon.unix_target}])
    assert after["loaded_tokens"] == 6 * PAGE and after["kv_exact"] and after["extra_exact"]
