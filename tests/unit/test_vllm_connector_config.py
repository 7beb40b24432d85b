"""kv_connector_extra_config of the vLLM connector: defaults, environment, and refusals that name the key."""

from __future__ import annotations

import pytest

from kvd.connectors.vllm.config import DEFAULT_TARGET, ConnectorConfig
from kvd.connectors.vllm.placement import PlacementOptions


PLACEMENT = {"budget_bytes": 1 << 30, "layer_s": 2e-4, "bandwidth_bps": 25e9}


def test_defaults_and_the_environment(monkeypatch):
    monkeypatch.delenv("KVD_TARGET", raising=False)
    monkeypatch.delenv("KVD_TOKEN", raising=False)
    config = ConnectorConfig.from_extra({})
    assert (config.target, config.token, config.load, config.save) == (DEFAULT_TARGET, None, "auto", True)
    monkeypatch.setenv("KVD_TARGET", "unix:///tmp/k.sock")
    monkeypatch.setenv("KVD_TOKEN", "secret")
    config = ConnectorConfig.from_extra({})
    assert (config.target, config.token) == ("unix:///tmp/k.sock", "secret")
    assert ConnectorConfig.from_extra({"target": "unix:///x", "load": "layerwise"}).target == "unix:///x"


@pytest.mark.parametrize(("extra", "named"), [
    ({"taget": "unix:///x"}, "taget"),
    ({"load": "eager"}, "load"),
    ({"save": "false"}, "save"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"load_timeout_s": True}, "load_timeout_s"),
    ({"namespace": 7}, "namespace"),
    ({"transfer": "daemon", "placement": 3}, "placement must be a table"),
    ({"transfer": "daemon", "placement": {**PLACEMENT, "budget": 1}}, r"unknown placement keys \['budget'\]"),
    ({"transfer": "daemon", "placement": {"layer_s": 1e-4}}, r"placement needs \['bandwidth_bps', 'budget_bytes'\]"),
    ({"transfer": "daemon", "placement": {**PLACEMENT, "budget_bytes": 1.5}}, "placement.budget_bytes must be"),
    ({"transfer": "daemon", "placement": {**PLACEMENT, "layer_s": 0}}, "placement.layer_s must be a finite positive"),
    ({"transfer": "daemon", "placement": {**PLACEMENT, "per_token_s": -1}}, "placement.per_token_s must be a finite 0"),
    ({"transfer": "daemon", "placement": {**PLACEMENT, "bandwidth_bps": "fast"}}, "placement.bandwidth_bps"),
    ({"transfer": "daemon", "placement": {**PLACEMENT, "slo_s": float("inf")}}, "placement.slo_s must be a finite"),
    ({"transfer": "daemon", "placement": {**PLACEMENT, "budget_bytes": float("nan")}}, "placement.budget_bytes"),
    ({"placement": PLACEMENT}, "placement plans kvd's device tier: it needs transfer"),
    ({"flag_words": 3}, r"flag_words must be an integer in \[4, 1048576\]"),
    ({"flag_words": 1 << 21}, "flag_words"),
    ({"flag_words": 64.0}, "flag_words"),
    ({"flag_words": True}, "flag_words"),
    ({"prefill_profile": 3}, "prefill_profile must be a path"),
    ({"prefill_profile": "/no/such/profile.json"}, "prefill profile /no/such/profile.json: cannot read it"),
    ({"timeline": 3}, "timeline must be a directory path"),
    ({"timeline": "/tmp/t", "transfer": "daemon"}, "timeline records the connector.s own copies"),
])
def test_a_bad_option_is_refused_by_name(extra, named):
    with pytest.raises(ValueError, match=named):
        ConnectorConfig.from_extra(extra)


def test_a_placement_table_is_read_with_its_default():
    config = ConnectorConfig.from_extra({"transfer": "daemon", "placement": PLACEMENT})
    assert config.placement == PlacementOptions(1 << 30, 2e-4, 25e9, 0.0, 1.0)
    config = ConnectorConfig.from_extra({"transfer": "daemon", "placement": {**PLACEMENT, "slo_s": 0.05}})
    assert config.placement.slo_s == 0.05
    assert ConnectorConfig.from_extra({}).placement is None


def test_a_prefill_profile_is_checked_when_the_connector_starts(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text('{"format": "kvd-prefill-profile/1", "new_tokens": [16], "prefixes": [0], "seconds": [[1]]}')
    with pytest.raises(ValueError, match="new_tokens must be 2 or more increasing counts"):
        ConnectorConfig.from_extra({"prefill_profile": str(path)})
    path.write_text('{"format": "kvd-prefill-profile/1", "new_tokens": [16, 32], "prefixes": [0], "seconds": [[1], [2]]}')
    assert ConnectorConfig.from_extra({"prefill_profile": str(path)}).prefill_profile == str(path)
