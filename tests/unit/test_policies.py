"""Choosing policies: the config's names agree with the registries in
kvd.core.policy, bad settings name their field, the engine builds what it
is given, and the admission counter reaches /metrics."""

from __future__ import annotations

import pytest

from kvd import config
from kvd.core.engine import Engine
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.policy import DiskPolicies, make_policy, make_promotion, make_slot_policy
from kvd.core.policy.s3fifo import S3FifoPolicy
from kvd.errors import ConfigError
from kvd.metrics import make_registry
from kvd.core.requests import CommitRequest, KeysRequest


@pytest.mark.parametrize(
    ("names", "make"),
    [
        (config.HOST_POLICIES, make_policy),
        (config.DISK_POLICIES, lambda name: make_slot_policy(name, 8)),
        (config.PROMOTION_POLICIES, make_promotion),
    ],
    ids=["host", "disk", "promotion"],
)
def test_the_config_knows_exactly_the_registered_policies(names, make):
    for name in names:
        assert make(name).name == name
    with pytest.raises(ValueError) as raised:
        make("nope")
    assert str(raised.value).endswith(f"'nope' (known: {', '.join(sorted(names))})")


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("host.policy", "arc", r"unknown policy 'arc' \(known: lru, s3fifo\)"),
        ("disk.policy", "lru", r"unknown policy 'lru' \(known: clock\)"),
        ("disk.promotion", "never", r"unknown policy 'never' \(known: always\)"),
        ("disk.admission_min_hits", 0, r"must be 1\.\.255"),
        ("disk.admission_min_hits", 256, r"must be 1\.\.255"),
    ],
)
def test_bad_policy_settings_name_their_field(setting, value, message):
    with pytest.raises(ConfigError, match=message) as raised:
        config.load(env={}, overrides={setting: value})
    assert f"'{setting}'" in str(raised.value)


def test_policy_settings_defaults_and_overrides(tmp_path):
    defaults = config.load(env={})
    assert (defaults.host.policy, defaults.disk.policy) == ("lru", "clock")
    assert (defaults.disk.admission_min_hits, defaults.disk.promotion) == (1, "always")
    path = tmp_path / "kvd.toml"
    path.write_text('[host]\npolicy = "s3fifo"\n[disk]\nadmission_min_hits = 2\n')
    assert config.load(path, env={}).host.policy == "s3fifo"
    loaded = config.load(path, env={"KVD_DISK_ADMISSION_MIN_HITS": "3"})
    assert (loaded.host.policy, loaded.disk.admission_min_hits) == ("s3fifo", 3)


def test_the_engine_builds_the_policies_it_is_given(engine_factory):
    engine = engine_factory(
        10, 64, policy="s3fifo", disk_slot_count=8, disk_slot_bytes=64, disk_policies=DiskPolicies(admission_min_hits=3)
    )
    assert isinstance(engine.host.policy, S3FifoPolicy) and engine.host.policy.ghost_limit == 9
    assert engine.disk.eviction.name == "clock" and engine.disk.promotion.name == "always"
    assert engine.disk.admission.min_hits == 3 and engine.disk.admission.active
    with pytest.raises(ValueError, match=r"unknown disk eviction policy 'lru' \(known: clock\)"):
        Engine(host_slot_count=4, host_slot_bytes=64, disk_slot_count=8, disk_slot_bytes=64,
               disk_policies=DiskPolicies(eviction="lru"))


def test_blocks_turned_away_are_a_metric(engine_factory):
    spec = NamespaceSpec(model_id="metric", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
    engine = engine_factory(2, 64, disk_slot_count=8, disk_slot_bytes=64, disk_policies=DiskPolicies(admission_min_hits=2))
    ns = engine.register_namespace(spec).namespace_id
    engine.enable_disk(ns)
    registry, _ = make_registry(engine)
    assert registry.get_sample_value("kvd_disk_admission_rejected_total") == 0
    for token in range(3):  # two slots: the third Put evicts the first block, unwritten
        result = engine.reserve(KeysRequest(ns, "w", chain_keys(spec, [token]), 1000, 0))
        engine.commit(CommitRequest(ns, "w", result.lease.lease_id, 0))
    assert registry.get_sample_value("kvd_disk_admission_rejected_total") == 1
