"""The slack table (kvd.planner.slack): windows on and between the grid, budgets by Tutti's formula
worked by hand, the files, tables refused, and the write sizer the disk I/O schedule uses."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvd.planner.slack import SlackTable, WriteSizer

MIB = 1 << 20


def table(**changes) -> SlackTable:
    values = dict(model="m", layers=3, kv_bytes_per_token_layer=1024, inputs=(16, 64), prefixes=(0, 1000),
                  # [input, prefix, layer]: 1 / 2 / 3 ms at (16, 0), everything x2 at prefix 1000, x4 at input 64
                  compute_s=np.array([[[1e-3, 2e-3, 3e-3], [2e-3, 4e-3, 6e-3]],
                                      [[4e-3, 8e-3, 12e-3], [8e-3, 16e-3, 24e-3]]]))
    values.update(changes)
    return SlackTable(**values)


def test_windows_are_the_measurements_on_the_grid_and_linear_between():
    slack = table()
    np.testing.assert_allclose(slack.windows(16, 0), [1e-3, 2e-3, 3e-3])
    np.testing.assert_allclose(slack.windows(64, 1000), [8e-3, 16e-3, 24e-3])
    np.testing.assert_allclose(slack.windows(16, 500), [1.5e-3, 3e-3, 4.5e-3])
    np.testing.assert_allclose(slack.windows(40, 0), [2.5e-3, 5e-3, 7.5e-3])  # halfway from 16 to 64
    np.testing.assert_allclose(slack.windows(40, 500), [3.75e-3, 7.5e-3, 11.25e-3])
    # Held at the edges.
    np.testing.assert_allclose(slack.windows(1, 5000), slack.windows(16, 1000))
    np.testing.assert_allclose(slack.windows(10_000, 0), slack.windows(64, 0))


def test_budgets_follow_the_formula_worked_by_hand():
    slack = table()
    read, write = 1000 * 1024 / 1e-3, 500 * MIB  # 1,000 tokens of a layer read in 1 ms
    # At (16, 1000): windows 2 / 4 / 6 ms; the next layer's read takes 1 ms; the last layer has no next read.
    np.testing.assert_allclose(slack.budgets(16, 1000, read, write), [1e-3 * write, 3e-3 * write, 6e-3 * write])
    # Reads slower than compute: no slack, except behind the last layer.
    slow = 1000 * 1024 / 10e-3
    np.testing.assert_allclose(slack.budgets(16, 1000, slow, write), [0, 0, 6e-3 * write])
    # Another model's blocks, four times the KV per token: the read takes 4 ms.
    np.testing.assert_allclose(slack.budgets(16, 1000, read, write, kv_bytes_per_token_layer=4096),
                               [0, 0, 6e-3 * write])
    # The write job: the least budget at the shortest input.
    assert slack.write_chunk_bytes(1000, read, write) == int(1e-3 * write)


def test_a_table_survives_its_file(tmp_path):
    slack = table(device="somewhere")
    slack.save(tmp_path / "t.json")
    again = SlackTable.load(tmp_path / "t.json")
    assert again.to_json() == slack.to_json()
    np.testing.assert_array_equal(again.compute_s, slack.compute_s)


@pytest.mark.parametrize("change, message", [
    ({"compute_s": np.ones((2, 2, 2))}, "shape"),
    ({"prefixes": (1000, 0)}, "ascending"),
    ({"inputs": (16, 16)}, "ascending"),
    ({"compute_s": np.zeros((2, 2, 3))}, "positive"),
    ({"compute_s": np.full((2, 2, 3), np.nan)}, "positive"),
    ({"kv_bytes_per_token_layer": 0}, "KV size"),
])
def test_bad_tables_are_refused(change, message):
    with pytest.raises(ValueError, match=message):
        table(**change)


def test_files_that_are_not_tables_are_refused(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(ValueError, match="not a slack table"):
        SlackTable.load(path)
    data = table().to_json()
    del data["inputs"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="inputs"):
        SlackTable.load(path)
    with pytest.raises(ValueError, match="cannot read"):
        SlackTable.load(tmp_path / "missing.json")


def test_the_sizer_waits_for_both_bandwidths_then_sizes_jobs_to_the_slack():
    slack = table()
    sizer = WriteSizer(slack, alpha=0.5)
    sizer.restore(1000, 1024)
    assert sizer.chunk_blocks(MIB, default=8, most=64) == 8
    sizer.observe(True, 1000 * 1024, 1e-3)
    assert sizer.chunk_blocks(MIB, default=8, most=64) == 8  # no write seen yet
    sizer.observe(False, 100 * MIB, 0.2)  # 500 MiB/s
    assert sizer.chunk_blocks(MIB, default=8, most=64) == 1  # a 0.5 MiB budget: one block, the least
    assert sizer.chunk_blocks(MIB // 8, default=8, most=64) == 4  # 0.5 MiB of 128 KiB blocks
    assert sizer.chunk_blocks(1024, default=8, most=64) == 64  # never past the batch
    sizer.observe(False, 100 * MIB, 0.05)  # 2,000 MiB/s: averaged to 1,250
    assert sizer.write_bps == pytest.approx(0.5 * 500 * MIB + 0.5 * 2000 * MIB)
    sizer.restore(1000, 16 * 1024)  # reads 16x longer than the windows: no slack anywhere but the last layer
    assert sizer.chunk_blocks(MIB // 8, default=8, most=64) == 1


def test_another_models_layers_get_the_tables_windows_spread_with_the_total_kept():
    slack = table()  # 3 layers: 1 / 2 / 3 ms at (16, 0)
    read, write = 1e12, 1000.0  # reads take no time: every window is slack
    six = slack.budgets(16, 0, read, write, num_layers=6)
    np.testing.assert_allclose(six, [0.5, 0.5, 1.0, 1.0, 1.5, 1.5])  # half of each window, at 1,000 B/s
    assert six.sum() == pytest.approx(slack.budgets(16, 0, read, write).sum())
    # With reads: each of the six layers' next read is the same bytes, against half a window.
    per_layer_read_s = 0.4e-3
    next_read = np.array([per_layer_read_s] * 5 + [0.0])  # none behind the last layer
    np.testing.assert_allclose(slack.budgets(16, 1000, 1000 * 1024 / per_layer_read_s, 1e6, num_layers=6),
                               np.maximum(0, np.array([1, 1, 2, 2, 3, 3]) * 1e-3 - next_read) * 1e6)
    sizer = WriteSizer(slack)
    sizer.observe(True, 1, 1.0)
    sizer.observe(False, 1, 1.0)
    assert sizer.layer_budgets(0, 1024, 6).shape == (6,)
