"""Every metric kvd exports is in kvd.metrics' table, and every row of the
table is a metric kvd exports, with the type the table says."""

from __future__ import annotations

import re

import kvd.metrics
from kvd.core.engine import Engine
from kvd.core.keys import NamespaceSpec
from kvd.core.quota import TenantQuota
from kvd.metrics import ArenaCollector, ClusterCollector, DeviceCollector, DiskIoMetrics, make_registry

ROW = re.compile(r"^\| (kvd_\w+) \| (\w+) \|\s*([\w, ]*?)\s*\| .+ \|$")


def documented() -> dict[str, tuple[str, tuple[str, ...]]]:
    """metric name -> (type, labels), from the module docstring's table."""
    rows = {}
    for line in kvd.metrics.__doc__.splitlines():
        match = ROW.match(line)
        if match:
            name, kind, labels = match.groups()
            assert name not in rows, f"{name} documented twice"
            rows[name] = (kind, tuple(label.strip() for label in labels.split(",") if label.strip()))
    return rows


def exported() -> dict[str, tuple[str, tuple[str, ...]]]:
    """metric name -> (type, labels) of every family a daemon with a disk tier, a device plane and a
    cluster exports."""
    engine = Engine(host_slot_count=4, host_slot_bytes=64, disk_slot_count=4, disk_slot_bytes=64,
                    tenant_quotas=[TenantQuota("team-a", host_limit_bytes=128)])
    engine.register_namespace(NamespaceSpec(model_id="m", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1))
    registry, rpc = make_registry(engine)
    disk = DiskIoMetrics(registry, lambda: {"restore": 0, "write": 0}, lambda: (0, 0), lambda: ["ok", "quarantined"],
                         lambda: 0, totals=lambda: (0, 0, {b"\x01" * 32: 1}))
    registry.register(ArenaCollector(lambda: 0, lambda: 0))
    registry.register(DeviceCollector(lambda: dict.fromkeys(
        ("pools", "saved_blocks", "loaded_blocks", "tier_blocks", "tier_slots", "tier_hits", "tier_misses",
         "tier_evictions", "tier_used_slots", "tier_host_layers", "disk_loads_landed", "disk_loads_failed",
         "ring_loads_verified", "ring_loads_failed"), 0)))
    registry.register(ClusterCollector(lambda: 2, lambda: True, lambda: 1, lambda: {("b", "nixl"): 3},
                                       lambda: {"b": 1}, lambda: {"b": "nixl-tcp"}, lambda: {("nixl", "read"): 0.5}, lambda: {"nixl": 7}))
    # Labelled metrics of the server export samples once a label is used.
    rpc.duration.labels("Get").observe(0.001)
    rpc.total.labels("Get", "OK").inc()
    rpc.event_resyncs.labels("sequence_too_old").inc()
    rpc.auth_failures.labels("unknown_token").inc()
    disk.observe_job("restore", 0.001, 0.002)
    families = {}
    for family in registry.collect():
        # prometheus_client drops a counter's _total from the family name.
        name = family.name + "_total" if family.type == "counter" else family.name
        labels = {label for sample in family.samples for label in sample.labels if label != "le"}
        families[name] = (family.type, tuple(sorted(labels)))
    return families


def test_every_exported_metric_is_documented_and_every_documented_one_exported():
    table, families = documented(), exported()
    assert len(table) > 40
    assert sorted(set(families) - set(table)) == [], "exported but not in the kvd.metrics table"
    assert sorted(set(table) - set(families)) == [], "in the kvd.metrics table but not exported"
    for name, (kind, labels) in table.items():
        assert families[name][0] == kind, f"{name} is a {families[name][0]}, documented as a {kind}"
        assert families[name][1] == tuple(sorted(labels)), f"{name} has labels {families[name][1]}, documented {labels}"
