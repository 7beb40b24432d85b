"""How a setting's value is read: byte sizes, addresses, and the conversion of a TOML,
environment or flag value to its field's type, with the checks the sections share.

Every failure is a ConfigError naming the setting, so a typo never runs the daemon with a default.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any

from kvd.errors import ConfigError

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


def one_of(name: str, value: str, known: tuple[str, ...]) -> None:
    """ConfigError unless `value` is one of the `known` policies (or modes)."""
    if value not in known:
        raise ConfigError(name, f"unknown policy {value!r} (known: {', '.join(known)})")


def positive(name: str, value: int | float) -> None:
    """ConfigError unless `value` is above zero."""
    if value <= 0:
        raise ConfigError(name, f"must be positive, got {value}")


def parse_address(name: str, address: str) -> tuple[str, int]:
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(name, f"must be host:port, got {address!r}")
    return host.strip("[]"), int(port_text)


def parse_size(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(name, "must be a byte size, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    raise ConfigError(name, f"must be a byte size like 1073741824 or '1GiB', got {value!r}")


def coerce(name: str, kind: type, value: Any) -> Any:
    """Convert a TOML/env/flag value to the field's type, or name the field."""
    if name.endswith("_bytes"):
        return parse_size(name, value)
    if getattr(kind, "__origin__", None) is list:
        return _coerce_list(name, value)
    converter = _COERCERS.get(kind)
    if converter is None:
        raise ConfigError(name, f"unsupported type {kind!r}")
    return converter(name, value)


def _coerce_list(name: str, value: Any) -> list[str]:
    # TOML gives a list; env and flags give "a,b" or a TOML array '["a", "b"]'.
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = tomllib.loads(f"value = {value}")["value"]
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(name, f"{value!r} is not a TOML array of strings ({error}); "
                              'write ["/a", "/b"] or /a,/b') from None
    elif isinstance(value, str):
        value = [item.strip() for item in value.split(",") if item.strip()]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(name, f"must be a list of strings, got {value!r}")
    return list(value)


def _coerce_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ConfigError(name, f"must be true or false, got {value!r}")


def _coerce_int(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        return int(value)
    raise ConfigError(name, f"must be an integer, got {value!r}")


def _coerce_float(name: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(name, f"must be a number, got {value!r}")


def _coerce_str(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ConfigError(name, f"must be a string, got {value!r}")


_COERCERS = {bool: _coerce_bool, int: _coerce_int, float: _coerce_float, str: _coerce_str}
