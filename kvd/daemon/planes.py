"""The daemon's tiers and planes, built from its configuration: the host arena and its slot sizes,
the device plane over the arena ([device]), the disk plane ([disk]) opened and recovered, and the
engine over them all.

kvd.daemon.lifecycle builds them in that order at start and closes them in reverse.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvd.config import Config, HostConfig, TenantSettings
from kvd.core.engine import Engine, EngineLimits
from kvd.core.events import EventLog
from kvd.core.policy import DiskPolicies
from kvd.core.quota import TenantQuota
from kvd.core.slot_pool import class_sizes
from kvd.daemon.systemd import sd_notify
from kvd.errors import ConfigError, StartupFailed
from kvd.tiers.host import ArenaLayout, HostArena

if TYPE_CHECKING:
    from kvd.planes.device import DevicePlane
    from kvd.planes.disk import DiskPlane
    from kvd.tiers.disk.tier import DiskRecovery

log = logging.getLogger("kvd.daemon")

# Memory mappings of the interpreter, the libraries and the I/O engine, beside the arena's.
MAP_COUNT_HEADROOM = 4096


def open_arena(config: Config, layout: ArenaLayout) -> tuple[HostArena, tuple[int, ...]]:
    """The host arena and its slot sizes, largest first. With tenants, every tenant's slots are in
    memory of its own (kvd.tiers.host)."""
    per_tenant = config.auth.mode == "token"
    host_classes = host_slot_classes(config.host, layout, per_tenant)
    arena = HostArena(layout, prefault=config.host.prefault, huge_pages=config.host.huge_pages,
                      per_tenant=per_tenant, granule_bytes=host_classes[-1])
    return arena, host_classes


def host_slot_classes(host: HostConfig, layout: ArenaLayout, per_tenant: bool) -> tuple[int, ...]:
    """The host tier's slot sizes, largest (the arena's slot, a page) first.

    With tenants the arena can take one memory mapping per smallest slot
    (kvd.tiers.host.HostArena.claim_range), so the smallest classes are
    dropped, with a warning, until the kernel's vm.max_map_count holds
    that many; if even one slot size does not fit, the start is refused."""
    sizes = class_sizes(layout.slot_bytes, min(host.min_slot_bytes, layout.slot_bytes))
    if not per_tenant:
        return sizes
    limit = _max_map_count()
    kept = sizes
    while len(kept) > 1 and layout.arena_bytes // kept[-1] + MAP_COUNT_HEADROOM > limit:
        kept = kept[:-1]
    if kept != sizes:
        log.warning("with tenants, the smallest host slots would need more memory mappings than "
                    "vm.max_map_count allows; using larger ones", extra={
                        "min_slot_bytes": kept[-1], "configured_min_slot_bytes": sizes[-1], "max_map_count": limit})
    slot_count = layout.slot_count
    if slot_count + MAP_COUNT_HEADROOM > limit:
        raise ConfigError(
            "host.slot_bytes",
            f"with tenants (auth.mode = \"token\") the arena can need one memory mapping per slot: "
            f"{slot_count} slots and the kernel allows {limit} mappings (vm.max_map_count); "
            f"use larger slots or raise vm.max_map_count above {slot_count + MAP_COUNT_HEADROOM}",
        )
    return kept


def _max_map_count() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 1 << 62


def open_device_plane(config: Config, arena: HostArena) -> DevicePlane | None:
    """The device plane over the arena ([device] kind), or None when it is off."""
    if config.device.kind == "off":
        return None
    from kvd.device import DeviceError, open_device
    from kvd.planes.device import DevicePlane
    from kvd.planes.device_tier import DeviceTier

    settings = config.device
    try:
        devices = _open_devices(settings.kind, settings.index, settings.count, open_device)
        tier = DeviceTier(devices[0], settings.tier_bytes, settings.tier_slot_bytes or config.host.slot_bytes) \
            if settings.tier_bytes else None
        plane = DevicePlane(devices, arena.address_at(0), arena.layout.arena_bytes, settings.max_pools,
                            settings.pool_lease_ms, settings.flag_timeout_ms, tier=tier)
    except DeviceError as error:
        raise StartupFailed(f"[device] kind = {settings.kind!r}, index {settings.index}, count {settings.count}: "
                            f"{error}") from None
    for device in devices:
        log.info("device plane on", extra={"device": f"{device.kind}:{device.index}", "device_uuid": device.uuid,
                                           "tier_slots": tier.slot_count if tier and device is devices[0] else 0})
    return plane


def _open_devices(kind: str, index: int, count: int, open_device) -> list:
    """Devices index .. index + count - 1 of `kind`; count 0: from index to the last the driver shows."""
    from kvd.device import NoDevice

    devices = []
    while count == 0 or len(devices) < count:
        try:
            devices.append(open_device(kind, index + len(devices)))
        except NoDevice:
            if count or not devices:  # (count 0: the first index past the last GPU ends the list)
                raise
            break
    return devices


def new_disk_plane(config: Config, arena: HostArena) -> DiskPlane | None:
    """The disk plane over the arena ([disk] directories), not yet open (systemd's status says its
    recovery begins); None without a disk tier."""
    if not config.disk.directories:
        return None
    from kvd.planes.disk import DiskPlane

    sd_notify("STATUS=recovering the disk tier")
    return DiskPlane(config.disk, arena)


async def open_disk_plane(plane: DiskPlane) -> DiskRecovery:
    """Open the disk tier: its manifest replayed, what it holds to index next (`recover_disk`)."""
    started = time.monotonic()
    recovery = await plane.open()
    log.info(
        "disk tier opened",
        extra={"records": recovery.records, "blocks": recovery.block_count,
               "truncated_bytes": recovery.truncated_bytes, "dropped": recovery.dropped.total,
               "open_s": round(time.monotonic() - started, 3)},
    )
    return recovery


def build_engine(config: Config, layout: ArenaLayout, host_classes: tuple[int, ...], disk_plane: DiskPlane | None,
                 tenants: list[TenantSettings]) -> Engine:
    return Engine(
        host_slot_count=layout.slot_count,
        host_slot_bytes=layout.slot_bytes,
        host_min_slot_bytes=host_classes[-1],
        policy=config.host.policy,
        high_watermark=config.host.high_watermark,
        low_watermark=config.host.low_watermark,
        limits=EngineLimits(
            lease_ms_default=config.leases.default_ms,
            lease_ms_max=config.leases.max_ms,
            max_leases=config.leases.max_leases,
            max_pins_per_client=config.leases.max_pins_per_client,
        ),
        disk_slot_count=disk_plane.slot_count if disk_plane else 0,
        disk_slot_bytes=config.disk.slot_bytes,
        disk_min_slot_bytes=disk_plane.config.class_bytes[-1] if disk_plane else 0,
        events=EventLog(config.events.ring_events, config.events.ring_keys),
        disk_policies=DiskPolicies(
            eviction=config.disk.policy,
            admission_min_hits=config.disk.admission_min_hits,
            promotion=config.disk.promotion,
        ),
        tenant_quotas=[TenantQuota(tenant.name, tenant.host_bytes, tenant.disk_bytes) for tenant in tenants],
    )


def claim_slots_for_tenants(engine: Engine, arena: HostArena) -> None:
    """With memory of its own per tenant: a host slot the engine gives a tenant is mapped from its memory."""
    pool = engine.host.pool
    engine.claim_host_slot = lambda slot, tenant: arena.claim_range(
        pool.offset_of(slot), pool.slot_bytes_of(slot), tenant)


async def recover_disk(plane: DiskPlane, engine: Engine, recovery: DiskRecovery) -> None:
    """Index in the engine what the disk tier holds."""
    indexed = await plane.recover(engine, recovery)
    log.info("disk tier recovered", extra={"indexed_blocks": indexed})
