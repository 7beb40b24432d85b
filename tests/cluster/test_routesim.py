"""The routing simulation runs end to end, and its policies compare the way their definitions force."""

from __future__ import annotations

import json

from kvd.cluster import routesim


def test_short_routing_simulation(tmp_path, capsys):
    out, plot = tmp_path / "routes.json", tmp_path / "routes.png"
    assert routesim.main(["--nodes", "4,8", "--requests", "600", "--blocks-per-node", "1024",
                          "--json", str(out), "--plot", str(plot)]) == 0
    rows = {(r["nodes"], r["policy"]): r for r in json.loads(out.read_text())["rows"]}
    assert len(rows) == 6
    for nodes in (4, 8):
        plain, fetch, aware = (rows[(nodes, policy)] for policy in routesim.POLICIES)
        for row in (plain, fetch, aware):
            assert abs(row["local"] + row["remote"] + row["recomputed"] - 1) < 1e-9
        # Same random choices: the same local hits; fetching only turns recomputation into remote reads.
        assert plain["remote"] == 0 and fetch["local"] == plain["local"]
        assert fetch["recomputed"] < plain["recomputed"] and fetch["cost_vs_recompute"] < plain["cost_vs_recompute"]
        # Routing by the directory serves more locally than chance, within the load bound.
        assert aware["local"] > plain["local"] and aware["load_max_over_mean"] <= routesim.LOAD_BOUND + 0.1
    assert plot.stat().st_size > 10_000
    assert "| 8 | kv-aware+fetch |" in capsys.readouterr().out


def test_a_node_cache_stays_prefix_closed():
    node = routesim.Node(capacity=5)
    node.store([("a", i) for i in range(4)])
    node.store([("b", i) for i in range(3)])
    # Two of chain a's blocks went, and they were its deepest.
    assert node.match([("a", i) for i in range(4)]) == 2
    assert node.match([("b", i) for i in range(3)]) == 3
