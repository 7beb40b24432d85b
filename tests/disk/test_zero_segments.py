"""disk.zero_segments: segment files written with zeros when created, so that no write into them
meets an unwritten extent; checked with FIEMAP on the real files (the tests' file system is ext4,
whose posix_fallocate leaves unwritten extents)."""

from __future__ import annotations

import fcntl
import os
import struct

import numpy as np
import pytest

from kvd.tiers.disk.layout import locate, segment_name
from tests.disk.conftest import SEGMENT_BYTES, expected_bytes, host_bytes, make_config, open_tier, read, write

FS_IOC_FIEMAP = 0xC020660B
FIEMAP_FLAG_SYNC = 0x1
FIEMAP_EXTENT_UNWRITTEN = 0x800
HEADER = struct.Struct("=QQLLLL")       # fm_start, fm_length, fm_flags, fm_mapped_extents, fm_extent_count, reserved
EXTENT = struct.Struct("=QQQQQLLLL")    # fe_logical, fe_physical, fe_length, 2 reserved, fe_flags, 3 reserved
MAX_EXTENTS = 512


def extents(path) -> list[tuple[int, int, int]]:
    """(logical offset, length, flags) of every extent of `path`, from the file system."""
    request = bytearray(HEADER.pack(0, 2**64 - 1, FIEMAP_FLAG_SYNC, 0, MAX_EXTENTS, 0)
                        + bytes(EXTENT.size * MAX_EXTENTS))
    with open(path, "rb") as handle:
        fcntl.ioctl(handle.fileno(), FS_IOC_FIEMAP, request)
    mapped = HEADER.unpack_from(request)[3]
    assert mapped < MAX_EXTENTS, "more extents than asked for"
    found = []
    for i in range(mapped):
        logical, _, length, _, _, flags, *_ = EXTENT.unpack_from(request, HEADER.size + i * EXTENT.size)
        found.append((logical, length, flags))
    return found


def unwritten_bytes(path) -> int:
    return sum(length for _, length, flags in extents(path) if flags & FIEMAP_EXTENT_UNWRITTEN)


def segments(config):
    return [directory / segment_name(segment) for directory in config.directories
            for segment in range(config.segments_per_drive)]


def test_without_zeroing_new_segments_are_unwritten_extents(drives):
    """The premise: preallocation alone leaves every byte unwritten here (else the next test shows nothing)."""
    config = make_config(drives)
    tier, _ = open_tier(config)
    tier.close()
    assert all(unwritten_bytes(path) == SEGMENT_BYTES for path in segments(config))


def test_zeroed_segments_are_written_zeros_and_blocks_round_trip_across_a_reopen(drives, arena):
    config = make_config(drives, zero_segments=True)
    tier, recovery = open_tier(config)
    for path in segments(config):
        assert os.path.getsize(path) == SEGMENT_BYTES
        assert unwritten_bytes(path) == 0, extents(path)
        assert not np.fromfile(path, dtype=np.uint8).any()
    assert write(tier, arena, {0: 11, 5: 12}) == [True, True]
    tier.close()
    tier, recovery = open_tier(config)  # zeros hold no record: only the two blocks come back
    assert sorted(record.location for record in tier.live_records()) == [0, 5]
    assert list(read(tier, arena, [0, 5])) == [True, True]
    assert host_bytes(arena, 32) == expected_bytes(11) and host_bytes(arena, 33) == expected_bytes(12)
    tier.close()


def test_a_short_segment_is_zeroed_past_its_old_end_and_keeps_what_it_held(drives, arena):
    config = make_config(drives, zero_segments=True)
    tier, _ = open_tier(config)
    assert write(tier, arena, {0: 21}) == [True]
    tier.close()
    place = locate(config, 0)
    path = config.directories[place.drive] / segment_name(place.segment)
    kept = place.offset + config.slot_bytes
    os.truncate(path, kept)  # the segment lost its tail (slot 0 is intact)
    tier, _ = open_tier(config)
    assert os.path.getsize(path) == SEGMENT_BYTES and unwritten_bytes(path) == 0
    assert not np.fromfile(path, dtype=np.uint8)[kept:].any()
    assert list(read(tier, arena, [0])) == [True] and host_bytes(arena, 32) == expected_bytes(21)
    tier.close()


def test_a_short_write_while_zeroing_stops_the_open_with_a_preallocation_error(drives, monkeypatch):
    """The drive writing less than asked is the drive's failure, reported as such (ResourceExhausted,
    naming the segment), not as a broken invariant of kvd."""
    from kvd.errors import ResourceExhausted
    from kvd.tiers.disk import zeroing

    real_pwrite = os.pwrite
    monkeypatch.setattr(zeroing.os, "pwrite", lambda fd, data, offset: real_pwrite(fd, data[:4096], offset))
    with pytest.raises(ResourceExhausted, match=r"cannot preallocate seg-.*short write zeroing"):
        open_tier(make_config(drives, zero_segments=True))
