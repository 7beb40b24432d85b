"""[device] count: how many devices one daemon serves, checked where the setting is read."""

from __future__ import annotations

import pytest

from kvd.config import Config
from kvd.errors import ConfigError


def _config(kind: str, count: int) -> Config:
    config = Config()
    config.device.kind, config.device.count = kind, count
    return config


@pytest.mark.parametrize("kind, count", [("cpu", 1), ("cpu", 8), ("cuda", 0), ("cuda", 8), ("off", 1)])
def test_counts_that_name_devices_are_accepted(kind, count):
    _config(kind, count).validate()


@pytest.mark.parametrize("kind, count", [("cpu", 0), ("cpu", -1), ("cuda", 65), ("off", 0)])
def test_other_counts_are_refused_naming_the_field(kind, count):
    with pytest.raises(ConfigError, match="device.count"):
        _config(kind, count).validate()


def test_a_flag_wait_longer_than_the_default_lease_is_refused():
    """A SaveLayers waits up to flag_timeout_ms for a layer under a lease of
    leases.default_ms: a wait that can outlive the lease is a config error."""
    config = _config("cpu", 1)
    config.device.flag_timeout_ms = config.leases.default_ms
    with pytest.raises(ConfigError, match="device.flag_timeout_ms.*leases.default_ms"):
        config.validate()
    config.device.flag_timeout_ms = config.leases.default_ms - 1
    config.validate()
    config.device.kind, config.device.flag_timeout_ms = "off", config.leases.default_ms
    config.validate()  # no device plane: nothing waits for a flag
