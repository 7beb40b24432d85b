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
