"""The device plane's settings, [device]: which devices, engines' pools on them, and the
device tier kvd keeps in device memory (docs/GPU.md), with their checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.config.server import LeaseConfig
from kvd.config.storage import HostConfig
from kvd.errors import ConfigError


@dataclass(slots=True)
class DeviceConfig:
    # The device plane (docs/GPU.md): "off", "cpu" (the CPU device: memfd
    # memory and threads, for tests and CPU-only engines) or "cuda".
    kind: str = "off"
    index: int = 0
    # Devices served, from `index` on: one device plane each, and a pool goes to the one its memory
    # is on (TP > 1 engines register one pool per GPU). 0: every GPU the CUDA driver shows.
    count: int = 1
    # Engines' pools registered at once, and how long one lives without use.
    max_pools: int = 64
    pool_lease_ms: int = 300_000
    # How long a SaveLayers waits for the engine's flag of a layer.
    flag_timeout_ms: int = 10_000
    # The device tier: device memory kvd owns above host memory, holding copies of saved blocks
    # for other engines' loads (0: none), in slots of tier_slot_bytes (0: host.slot_bytes).
    tier_bytes: int = 0
    tier_slot_bytes: int = 0
    # A LoadLayers of blocks only on disk reads them through host-arena slots; whether those stay
    # as the blocks' host copies afterwards (false: given back once the engine has its layers,
    # the blocks stay only on disk and host memory keeps what was hot before).
    disk_loads_keep_host_copy: bool = True


def validate_device(device: DeviceConfig, leases: LeaseConfig, host: HostConfig) -> None:
    if device.kind not in ("off", "cpu", "cuda"):
        raise ConfigError("device.kind", f"must be off, cpu or cuda, got {device.kind!r}")
    if not 0 <= device.index < 1024:
        raise ConfigError("device.index", f"must be 0..1023, got {device.index}")
    if not 0 <= device.count <= 64 or (device.count == 0 and device.kind != "cuda"):
        raise ConfigError("device.count", f"must be 1..64 (0: every GPU, kind cuda only), got {device.count}")
    if not 1 <= device.max_pools <= 4096:
        raise ConfigError("device.max_pools", f"must be 1..4096, got {device.max_pools}")
    if not 1_000 <= device.pool_lease_ms <= 86_400_000:
        raise ConfigError("device.pool_lease_ms", f"must be 1000..86400000, got {device.pool_lease_ms}")
    if not 1 <= device.flag_timeout_ms <= 600_000:
        raise ConfigError("device.flag_timeout_ms", f"must be 1..600000, got {device.flag_timeout_ms}")
    if device.kind != "off" and device.flag_timeout_ms >= leases.default_ms:
        # A SaveLayers may wait this long for a layer under a lease of leases.default_ms.
        raise ConfigError("device.flag_timeout_ms", f"{device.flag_timeout_ms} must be below leases.default_ms "
                          f"({leases.default_ms}): a save waiting for the engine's flag would outlive "
                          "its lease")
    if device.tier_bytes < 0 or device.tier_slot_bytes < 0 or device.tier_slot_bytes % 4096:
        raise ConfigError("device.tier_slot_bytes" if device.tier_bytes >= 0 else "device.tier_bytes",
                          "must not be negative, and slots a multiple of 4096 bytes")
    if device.tier_bytes and device.kind == "off":
        raise ConfigError("device.tier_bytes", "a device tier needs the device plane: set device.kind")
    if device.tier_bytes and device.tier_bytes < (device.tier_slot_bytes or host.slot_bytes):
        raise ConfigError("device.tier_bytes", f"{device.tier_bytes} is smaller than one slot")
