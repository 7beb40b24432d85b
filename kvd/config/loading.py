"""Building the configuration: the embedded defaults (kvd/default.toml), then the TOML file,
the environment (`KVD_HOST_CAPACITY_BYTES`) and the flags (`--set host.capacity_bytes=...`),
each over the one before, then every check (kvd/config/__init__.py has the rules)."""

from __future__ import annotations

import dataclasses
import os
import tomllib
from importlib import resources
from pathlib import Path
from typing import Any, get_type_hints

from kvd.config.settings import Config
from kvd.config.values import coerce
from kvd.errors import ConfigError

ENV_PREFIX = "KVD_"


def _apply(target: Any, values: dict[str, Any], prefix: str = "") -> None:
    """Set `values` (a table, nested like the TOML) on the dataclass `target`, naming any unknown or wrong field."""
    hints = get_type_hints(type(target))
    known = {f.name for f in dataclasses.fields(target)}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(name, f"unknown setting (known here: {', '.join(sorted(known))})")
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigError(name, "must be a table")
            _apply(getattr(target, key), value, f"{name}.")
        else:
            setattr(target, key, coerce(name, kind, value))


def setting_names(config: Config | None = None) -> list[str]:
    """Every dotted setting name, e.g. ['host.capacity_bytes', ...]."""
    config = config or Config()
    names = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            names.extend(f"{f.name}.{inner.name}" for inner in dataclasses.fields(value))
        else:
            names.append(f.name)
    return names


def _dotted_to_nested(name: str, value: Any) -> dict[str, Any]:
    parts = name.split(".")
    nested: dict[str, Any] = {parts[-1]: value}
    for part in reversed(parts[:-1]):
        nested = {part: nested}
    return nested


def default_toml() -> str:
    """The embedded defaults: kvd/default.toml, shipped inside the package."""
    return resources.files("kvd").joinpath("default.toml").read_text()


def load(
    path: str | Path | None = None,
    *,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """Build the configuration: defaults, then file, then env, then flags."""
    config = Config()
    _apply(config, tomllib.loads(default_toml()))
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ConfigError("--config", f"cannot read {path}: {error.strerror}") from None
        try:
            _apply(config, tomllib.loads(text))
        except tomllib.TOMLDecodeError as error:
            raise ConfigError("--config", f"{path} is not valid TOML: {error}") from None
    env = os.environ if env is None else env
    names = setting_names(config)
    for name in names:
        variable = ENV_PREFIX + name.replace(".", "_").upper()
        if variable in env:
            _apply(config, _dotted_to_nested(name, env[variable]))
    for name, value in (overrides or {}).items():
        if name not in names:
            raise ConfigError(name, "unknown setting")
        _apply(config, _dotted_to_nested(name, value))
    config.validate()
    return config


def to_dict(config: Config) -> dict[str, Any]:
    """The configuration as nested dicts (what `kvd config` prints)."""
    return dataclasses.asdict(config)
