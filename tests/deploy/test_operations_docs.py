"""docs/operations.md and the Grafana dashboard stay true to the code.

The guide's configuration reference and metrics table are generated
(tools/gen_operations_docs.py) from kvd/config/, kvd/default.toml and the
table in kvd/metrics.py; the dashboard is checked query by query against
that table: every metric it names is one kvd exports, every label it
selects or groups by is one of that metric's labels.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvd.config import setting_names
from tools import gen_operations_docs as generator

ROOT = Path(__file__).parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvd-dashboard.json"
# Labels Prometheus adds to every scraped series, and histogram buckets' own.
TARGET_LABELS = {"instance", "job", "namespace", "pod", "container", "node"}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def documented_metrics() -> dict[str, tuple[str, set[str]]]:
    return {name: (kind, {label.strip() for label in labels.split(",") if label.strip()})
            for name, kind, labels, _meaning in generator.metrics()}


def test_generated_sections_are_current():
    text = generator.DOCS.read_text()
    assert generator.update(text) == text, "docs/operations.md is stale: run tools/gen_operations_docs.py"


def test_every_setting_is_in_the_reference_with_a_meaning():
    rows = {row.name: row for row in generator.settings()}
    assert sorted(rows) == sorted(setting_names())
    assert [name for name, row in rows.items() if not row.comment] == [], (
        "settings without a comment in kvd/config/ or kvd/default.toml"
    )
    text = generator.DOCS.read_text()
    for name, row in rows.items():
        assert f"| `{name}` | {row.kind} | " in text and f"`{row.env}`" in text, name
    assert rows["host.capacity_bytes"].default == '"1GiB"'
    assert rows["disk.directories"].env == "KVD_DISK_DIRECTORIES"


def test_every_metric_is_in_the_guide():
    metrics = documented_metrics()
    assert len(metrics) > 40
    text = generator.DOCS.read_text()
    for name, (kind, _labels) in metrics.items():
        assert f"| `{name}` | {kind} |" in text, name


def test_the_generator_notices_a_stale_or_broken_guide():
    text = generator.DOCS.read_text()
    stale = text.replace("| `host.slot_bytes` |", "| `host.slot_size` |")
    assert stale != text and generator.update(stale) == text
    with pytest.raises(ValueError, match="config-reference"):
        generator.update(text.replace(generator.end_marker("config-reference"), ""))


def test_links_in_the_guide_lead_somewhere():
    text = generator.DOCS.read_text()
    links = re.findall(r"\]\((\.\./[^)#]+)(?:#[^)]*)?\)", text)
    assert len(links) >= 5
    for link in links:
        assert (generator.DOCS.parent / link).resolve().exists(), link
    anchors = {re.sub(r"[^\w\- ]", "", heading).strip().lower().replace(" ", "-")
               for heading in re.findall(r"^#+ (.+)$", text, re.MULTILINE)}
    for anchor in re.findall(r"\]\(#([^)]+)\)", text):
        assert anchor in anchors, anchor


def query_problems(expr: str, metrics: dict[str, tuple[str, set[str]]]) -> list[str]:
    """What in a PromQL expression names a metric or label kvd does not export."""
    problems = []
    used: dict[str, set[str]] = {}
    for token in re.findall(r"\bkvd_\w+", expr):
        base = token
        for suffix in HISTOGRAM_SUFFIXES:
            if token.endswith(suffix) and metrics.get(token.removesuffix(suffix), ("",))[0] == "histogram":
                base = token.removesuffix(suffix)
        if base not in metrics:
            problems.append(f"unknown metric {token}")
            continue
        extra = {"le"} if token.endswith("_bucket") else set()
        used[token] = metrics[base][1] | extra
    if not re.search(r"\bkvd_\w+", expr):
        problems.append("no kvd metric")
    for token, selector in re.findall(r"\b(kvd_\w+)\{([^}]*)\}", expr):
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector):
            if label not in used.get(token, set()) | TARGET_LABELS:
                problems.append(f"{token} has no label {label}")
    every_label = set().union(*used.values()) if used else set()
    for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        for label in (item.strip() for item in grouping.split(",") if item.strip()):
            if label not in every_label | TARGET_LABELS:
                problems.append(f"no metric in the query has label {label}")
    return problems


def test_dashboard_queries_use_only_what_kvd_exports():
    dashboard = json.loads(DASHBOARD.read_text())
    metrics = documented_metrics()
    panels = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len(panels) >= 20
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    queried = set()
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert 0 <= panel["gridPos"]["x"] and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert query_problems(target["expr"], metrics) == [], (panel["title"], target["expr"])
            queried |= {token for token in re.findall(r"\bkvd_\w+", target["expr"])}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            assert query_problems(variable["definition"], metrics) == [], variable["name"]
    # The dashboard shows every tier and disk metric, at least.
    for name in metrics:
        if name.startswith(("kvd_tier_", "kvd_disk_")):
            assert any(token.startswith(name) for token in queried), f"{name} is on no panel"


def test_query_check_rejects_unknown_metrics_and_labels():
    metrics = documented_metrics()
    assert query_problems('sum by (tier) (rate(kvd_tier_hits_total[5m]))', metrics) == []
    assert query_problems("histogram_quantile(0.99, sum by (class, le) (rate(kvd_disk_job_run_seconds_bucket[5m])))",
                          metrics) == []
    assert query_problems("rate(kvd_tier_hitz_total[5m])", metrics) == ["unknown metric kvd_tier_hitz_total"]
    assert query_problems('kvd_tier_blocks{tiers="host"}', metrics) == ["kvd_tier_blocks has no label tiers"]
    assert query_problems("sum by (method) (kvd_tier_blocks)", metrics) == [
        "no metric in the query has label method"]
    assert query_problems("kvd_leases_bucket", metrics) == ["unknown metric kvd_leases_bucket"]
    assert query_problems("up", metrics) == ["no kvd metric"]
