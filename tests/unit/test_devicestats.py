"""bench/devicestats.py: what a block device saw, from two /proc/diskstats snapshots."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from kvd.io.engine import aligned_empty

_SPEC = importlib.util.spec_from_file_location(
    "devicestats", Path(__file__).resolve().parents[2] / "bench" / "devicestats.py")
devicestats = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("devicestats", devicestats)  # its dataclass looks its module up
_SPEC.loader.exec_module(devicestats)
DiskCounters = devicestats.DiskCounters


def test_a_section_is_described_by_its_request_size_queue_and_bytes_in_flight():
    before = DiskCounters(reads=100, read_sectors=8_000, read_ms=50, writes=7, write_sectors=56, write_ms=3,
                          weighted_ms=900)
    # 40 reads of 1 MiB and 20 writes of 64 KiB in 0.5 s; 4,000 ms of request time queued over the section.
    after = DiskCounters(reads=140, read_sectors=8_000 + 40 * 2048, read_ms=50 + 3_600, writes=27,
                         write_sectors=56 + 20 * 128, write_ms=3 + 400, weighted_ms=900 + 4_000)
    seen = devicestats.view(before, after, 0.5)
    assert seen["read_mib"] == 40 and seen["write_mib"] == 20 * 64 / 1024
    assert seen["read_request_kib"] == 1024 and seen["write_request_kib"] == 64
    assert seen["queue_depth"] == pytest.approx(8.0)  # 4 s of queued requests in 0.5 s
    mean_request_mib = (40 + 20 * 64 / 1024) / 60
    assert seen["in_flight_mib"] == pytest.approx(8.0 * mean_request_mib)
    assert seen["latency_ms"] == pytest.approx(4_000 / 60)
    line = devicestats.describe(seen)
    assert "reads of 1024 KiB" in line and "writes of 64 KiB" in line and "8.0 queued" in line


def test_no_counters_or_no_request_is_no_view():
    counters = DiskCounters(1, 8, 1, 0, 0, 0, 1)
    assert devicestats.view(None, counters, 1.0) is None
    assert devicestats.view(counters, counters, 1.0) is None


def test_an_o_direct_read_is_seen_on_the_device_under_its_file(tmp_path):
    """On a file system over a block device /proc/diskstats lists, a 1 MiB O_DIRECT read shows there."""
    path = tmp_path / "data.bin"
    path.write_bytes(os.urandom(1 << 20))
    os.sync()
    device = devicestats.device_of(tmp_path)
    if device is None:  # tmpfs or overlay without a listed device: nothing to bracket
        assert devicestats.snapshot(None) is None
        return
    buffer = aligned_empty(1 << 20)
    before = devicestats.snapshot(device)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.preadv(fd, [buffer], 0) == 1 << 20
    finally:
        os.close(fd)
    seen = devicestats.view(before, devicestats.snapshot(device), 0.1)
    assert seen is not None and seen["read_mib"] >= 1.0
