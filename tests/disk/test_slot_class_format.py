"""Slot size classes on disk (format version 2): where a class's slot lies,
what a record's location says, how replay treats slots of different
classes that overlap in one page, and a version 1 directory taken over."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvd.tiers.disk.layout import (
    FORMAT_VERSION,
    IDENTITY,
    Identity,
    drive_of,
    locate,
    locate_many,
    location_of,
    read_identity,
    split_location,
    write_identity,
)
from kvd.tiers.disk.tier import DiskTier
from tests.disk.conftest import (
    BLOCK_BYTES,
    SLOT_BYTES,
    expected_bytes,
    host_bytes,
    make_config,
    open_tier,
    read,
    records_by_slot,
    write,
)

HALF = 1  # class 1: SLOT_BYTES / 2 = 32 KiB slots, two to a page; the test blocks (24 KiB) fit


def test_a_location_names_page_class_and_position_and_the_largest_class_is_the_page(drives):
    config = make_config(drives, min_slot_bytes=SLOT_BYTES // 4)
    assert config.class_bytes == (SLOT_BYTES, SLOT_BYTES // 2, SLOT_BYTES // 4)
    rng = np.random.default_rng(1)
    locations = []
    for _ in range(200):
        page, class_index = int(rng.integers(config.slot_count)), int(rng.integers(3))
        position = int(rng.integers(1 << class_index))
        location = location_of(page, class_index, position)
        assert split_location(location) == (page, class_index, position)
        place = locate(config, location)
        page_place = locate(config, page)  # a version 1 location: the page itself
        assert location_of(page, 0, 0) == page and drive_of(config, location) == page % 2
        assert (place.drive, place.segment) == (page_place.drive, page_place.segment)
        assert place.offset == page_place.offset + position * (SLOT_BYTES >> class_index)
        locations.append(location)
    drives_, files, offsets = locate_many(config, np.array(locations))
    expected = [locate(config, location) for location in locations]
    assert drives_.tolist() == [place.drive for place in expected]
    assert files.tolist() == [place.file_index for place in expected]
    assert offsets.tolist() == [place.offset for place in expected]
    with pytest.raises(Exception, match="out of range"):
        locate(config, location_of(0, 3, 0))  # a class this configuration does not have


def test_blocks_in_small_slots_of_one_page_are_kept_apart_and_survive_a_reopen(drives, arena):
    config = make_config(drives, min_slot_bytes=SLOT_BYTES // 2)
    slots = {location_of(page, HALF, position): 10 * page + position for page in (4, 5) for position in (0, 1)}
    tier, _ = open_tier(config)
    with tier:
        assert all(write(tier, arena, slots))
        assert read(tier, arena, list(slots)).all()
        for index, seed in enumerate(slots.values()):
            assert host_bytes(arena, 32 + index) == expected_bytes(seed)
    tier, recovery = open_tier(config)
    with tier:
        assert recovery.block_count == 4 and set(records_by_slot(tier)) == set(slots)
        assert read(tier, arena, list(slots)).all()
        for index, seed in enumerate(slots.values()):
            assert host_bytes(arena, 32 + index) == expected_bytes(seed)
        tier.verify()


def test_slots_of_two_classes_overlapping_in_a_page_keep_only_the_newer_class(drives, arena):
    """Never after a correct REMOVE: a page is handed to another class only
    once its old blocks' REMOVEs are durable. If they were lost (damage),
    replay keeps the newer class's blocks, whose bytes are the ones there."""
    config = make_config(drives, min_slot_bytes=SLOT_BYTES // 2)
    page = 6
    tier, _ = open_tier(config)
    with tier:
        assert write(tier, arena, {page: 1}) == [True]  # the whole page: older
        assert all(write(tier, arena, {location_of(page, HALF, 0): 2, location_of(page, HALF, 1): 3}))
    tier, recovery = open_tier(config)
    with tier:
        assert recovery.dropped.duplicate_slot == 1 and recovery.block_count == 2
        assert set(records_by_slot(tier)) == {location_of(page, HALF, 0), location_of(page, HALF, 1)}
        assert read(tier, arena, [location_of(page, HALF, 0), location_of(page, HALF, 1)]).all()
        assert [host_bytes(arena, 32), host_bytes(arena, 33)] == [expected_bytes(2), expected_bytes(3)]
        tier.verify()


def test_a_record_of_a_class_no_longer_configured_is_dropped_not_misread(drives, arena):
    tier, _ = open_tier(make_config(drives, min_slot_bytes=SLOT_BYTES // 2))
    with tier:
        assert all(write(tier, arena, {location_of(2, HALF, 1): 7, 3: 8}))
    tier, recovery = open_tier(make_config(drives))  # one slot size now
    with tier:
        assert recovery.dropped.out_of_range == 1 and set(records_by_slot(tier)) == {3}
        assert read(tier, arena, [3]).all() and host_bytes(arena, 32) == expected_bytes(8)


def test_a_version_1_directory_is_taken_over_and_its_identity_rewritten(drives, arena):
    config = make_config(drives)
    tier, _ = open_tier(config)
    with tier:
        assert all(write(tier, arena, {0: 1, 1: 2, 2: 3}))
    for directory in drives:  # as kvd before slot classes wrote it
        old = read_identity(directory)
        write_identity(directory, Identity(old.set_uuid, old.drive_index, old.drive_count, old.slot_bytes,
                                           old.segment_bytes, format_version=1))
        assert json.loads((directory / IDENTITY).read_text())["format_version"] == 1
    reader = DiskTier(config, read_only=True)  # fsck's view changes nothing
    with reader:
        reader.open()
        assert len(reader.live_records()) == 3
    assert all(read_identity(directory).format_version == 1 for directory in drives)
    tier, recovery = open_tier(make_config(drives, min_slot_bytes=SLOT_BYTES // 2))
    with tier:
        assert recovery.migrated_drives == [0, 1] and recovery.block_count == 3
        assert read(tier, arena, [0, 1, 2]).all()
        assert [host_bytes(arena, 32 + i) for i in range(3)] == [expected_bytes(seed) for seed in (1, 2, 3)]
        assert all(write(tier, arena, {location_of(3, HALF, 1): 4}))
    assert all(read_identity(directory).format_version == FORMAT_VERSION for directory in drives)
    assert BLOCK_BYTES <= SLOT_BYTES >> HALF
