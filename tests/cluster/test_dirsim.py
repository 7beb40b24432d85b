"""The directory simulation runs end to end and its numbers hold together."""

from __future__ import annotations

import json

from kvd.cluster import dirsim


def test_short_simulation_writes_consistent_rows(tmp_path, capsys):
    out, plot = tmp_path / "dirsim.json", tmp_path / "dirsim.png"
    assert dirsim.main(["--nodes", "10,40", "--segments", "16,0", "--blocks-per-node", "512", "--lookups", "200",
                        "--json", str(out), "--plot", str(plot)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["nodes"], r["segment"]) for r in rows] == [
        (10, "16 blocks"), (10, "whole chain"), (40, "16 blocks"), (40, "whole chain")]
    by = {(r["nodes"], r["segment"]): r for r in rows}
    for nodes in (10, 40):
        seg, whole = by[(nodes, "16 blocks")], by[(nodes, "whole chain")]
        # Same cluster contents (same seed), only cut differently.
        assert abs(seg["entries_mean"] - whole["entries_mean"]) < 1e-6
        assert whole["lookup_msgs_mean"] == 1.0 and whole["update_msgs_mean"] == 1.0
        assert 1.0 < seg["lookup_msgs_mean"] <= nodes
        assert seg["entries_max"] <= whole["entries_max"]
        assert 0 <= seg["moved_on_join"] < 0.5 and 0 <= seg["moved_on_leave"] < 0.5
    # Finer segments spread the busiest owner's lookups wider than whole chains.
    assert by[(40, "16 blocks")]["lookup_load_max_over_mean"] < by[(40, "whole chain")]["lookup_load_max_over_mean"]
    assert plot.stat().st_size > 10_000
    assert "| 40 | 16 blocks |" in capsys.readouterr().out


def test_replicas_multiply_entries_and_spread_the_busiest_owner(tmp_path):
    out = tmp_path / "replicas.json"
    assert dirsim.main(["--nodes", "200", "--segments", "64", "--replicas", "1,3", "--blocks-per-node", "512",
                        "--lookups", "400", "--json", str(out)]) == 0
    one, three = json.loads(out.read_text())["rows"]
    assert (one["replicas"], three["replicas"]) == (1, 3)
    # The same contents, each entry kept three times.
    assert abs(three["entries_mean"] - 3 * one["entries_mean"]) < 1e-6
    assert one["update_msgs_mean"] < three["update_msgs_mean"] <= 3 * one["update_msgs_mean"]
    # A lookup still asks one node per segment; the hottest segments' lookups spread over three.
    assert abs(three["lookup_msgs_mean"] - one["lookup_msgs_mean"]) < 1.0
    assert three["lookup_load_max_over_mean"] < 0.8 * one["lookup_load_max_over_mean"]
