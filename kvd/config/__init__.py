"""The daemon's configuration: embedded defaults < TOML file < environment < flags.

Every setting has a dotted name (`host.capacity_bytes`), a TOML location
(`[host] capacity_bytes = ...`), an environment variable
(`KVD_HOST_CAPACITY_BYTES`) and a flag (`--set host.capacity_bytes=...`).
Byte sizes accept integers or strings with a unit ("512MiB", "2GiB").
A bad value raises ConfigError naming the field; unknown fields are errors,
not silently ignored, so a typo never runs the daemon with a default.

| module | holds |
|---|---|
| `settings.py` | `Config`, one section per TOML table; `validate()` runs the sections' checks |
| `server.py` | [server], [metrics], [auth], [leases], [events], [log] and their checks |
| `storage.py` | [host] and [disk], the tiers' policy names, and their checks |
| `cluster.py` | [cluster] and its checks |
| `device.py` | [device] and its checks |
| `values.py` | byte sizes, addresses, a value's conversion to its field's type |
| `loading.py` | `load`: the defaults (kvd/default.toml), file, environment and flags in turn |
| `tenants.py` | the tenants file of auth.mode = "token" |

This module is the package's public surface: callers import from `kvd.config`.
"""

from kvd.config.cluster import NODE_NAME_RE, ClusterConfig
from kvd.config.device import DeviceConfig
from kvd.config.loading import ENV_PREFIX, default_toml, load, setting_names, to_dict
from kvd.config.server import AuthConfig, EventsConfig, LeaseConfig, LogConfig, MetricsConfig, ServerConfig
from kvd.config.settings import Config
from kvd.config.storage import DISK_POLICIES, HOST_POLICIES, PROMOTION_POLICIES, WRITE_MODES, DiskSettings, HostConfig
from kvd.config.tenants import TenantSettings, load_tenants
from kvd.config.values import parse_address, parse_size

__all__ = [
    "DISK_POLICIES", "ENV_PREFIX", "HOST_POLICIES", "NODE_NAME_RE", "PROMOTION_POLICIES", "WRITE_MODES",
    "AuthConfig", "ClusterConfig", "Config", "DeviceConfig", "DiskSettings", "EventsConfig", "HostConfig",
    "LeaseConfig", "LogConfig", "MetricsConfig", "ServerConfig", "TenantSettings",
    "default_toml", "load", "load_tenants", "parse_address", "parse_size", "setting_names", "to_dict",
]
