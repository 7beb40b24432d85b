"""The device check's step b (tools/device_check/engine_pair.py) on kvd's CPU device.

On a GPU host the same script runs with --kind cuda; running it here keeps the script in step with
the connector's API (a GPU visit that finds it broken is a visit lost).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvd.connectors.vllm.metadata import LoadOrder, SaveOrder

ROOT = Path(__file__).resolve().parents[2]


def test_two_engines_pass_every_layer_through_the_daemon_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "pair.json"
    run = subprocess.run([sys.executable, "-m", "tools.device_check.engine_pair", "--kind", "cpu",
                          "--dir", str(tmp_path / "daemon"), "--json", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["kind"] == "cpu"
    assert result["load"]["exact_layers"] == result["layers"]
    assert result["save"]["saved_blocks"] == result["load"]["loaded_blocks"] == result["blocks"]


@pytest.mark.parametrize("make", [lambda ids: SaveOrder("r", [[b"k"]], ids),
                                  lambda ids: LoadOrder("r", [[b"k"]], 0, ids, False)])
def test_an_order_with_a_flat_block_list_is_refused_where_it_is_made(make) -> None:
    with pytest.raises(TypeError, match="one list of block ids per KV cache group"):
        make([3, 4])
    assert make([[3, 4]]).block_ids == [[3, 4]]
