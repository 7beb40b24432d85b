"""What the block device saw during a timed section, from /proc/diskstats.

Two snapshots around a section give its requests, their mean size, the
mean number queued at the device (the weighted time in queue over the
section's length) and the mean time one request took. Their product, the
bytes kept in flight, tells a device at its bandwidth from one that is
starved: when readers that keep different amounts in flight see latencies
in the same proportion (Little's law), the device delivers the same bytes
per second to each, and queueing more only lengthens the wait.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path

SECTOR = 512
KIB, MIB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class DiskCounters:
    """The cumulative counters of one device (Documentation/admin-guide/iostats.rst)."""

    reads: int
    read_sectors: int
    read_ms: int
    writes: int
    write_sectors: int
    write_ms: int
    weighted_ms: int

    def __sub__(self, other: DiskCounters) -> DiskCounters:
        return DiskCounters(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))


def device_of(path: str | Path) -> str | None:
    """The name /proc/diskstats lists the device holding `path` under, or None (no such entry)."""
    number = os.stat(path).st_dev
    link = Path(f"/sys/dev/block/{os.major(number)}:{os.minor(number)}")
    name = link.resolve().name if link.exists() else None
    return name if name is not None and snapshot(name) is not None else None


def snapshot(device: str | None) -> DiskCounters | None:
    if device is None:
        return None
    with open("/proc/diskstats") as stats:
        for line in stats:
            parts = line.split()
            if len(parts) >= 14 and parts[2] == device:
                numbers = [int(value) for value in parts[3:14]]
                return DiskCounters(reads=numbers[0], read_sectors=numbers[2], read_ms=numbers[3],
                                    writes=numbers[4], write_sectors=numbers[6], write_ms=numbers[7],
                                    weighted_ms=numbers[10])
    return None


def view(before: DiskCounters | None, after: DiskCounters | None, seconds: float) -> dict[str, float] | None:
    """The device during a section of `seconds` (None without counters, or with no request in it)."""
    if before is None or after is None or seconds <= 0:
        return None
    delta = after - before
    requests = delta.reads + delta.writes
    if requests == 0:
        return None
    moved = (delta.read_sectors + delta.write_sectors) * SECTOR
    queue = delta.weighted_ms / 1000.0 / seconds
    return {
        "read_mib": delta.read_sectors * SECTOR / MIB,
        "write_mib": delta.write_sectors * SECTOR / MIB,
        "read_request_kib": delta.read_sectors * SECTOR / KIB / delta.reads if delta.reads else 0.0,
        "write_request_kib": delta.write_sectors * SECTOR / KIB / delta.writes if delta.writes else 0.0,
        "queue_depth": queue,
        "in_flight_mib": queue * moved / requests / MIB,
        "latency_ms": (delta.read_ms + delta.write_ms) / requests,
    }


def describe(median: dict[str, float]) -> str:
    """One line of a view (or of medians of views)."""
    sizes = []
    if median["read_mib"] >= 1:
        sizes.append(f"reads of {median['read_request_kib']:.0f} KiB")
    if median["write_mib"] >= 1:
        sizes.append(f"writes of {median['write_request_kib']:.0f} KiB")
    return (f"{', '.join(sizes) or 'no bulk I/O'}; {median['queue_depth']:.1f} queued, "
            f"{median['in_flight_mib']:.0f} MiB in flight, {median['latency_ms']:.1f} ms a request")
