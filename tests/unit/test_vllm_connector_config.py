"""kv_connector_extra_config of the vLLM connector: defaults, environment, and refusals that name the key."""

from __future__ import annotations

import pytest

from kvd.connectors.vllm.config import DEFAULT_TARGET, ConnectorConfig


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
])
def test_a_bad_option_is_refused_by_name(extra, named):
    with pytest.raises(ValueError, match=named):
        ConnectorConfig.from_extra(extra)
