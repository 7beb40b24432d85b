"""Slot numbering, configuration checks and IDENTITY validation."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvd.errors import ConfigError
from kvd.tiers.disk.layout import (
    IDENTITY,
    DiskConfig,
    DiskIdentityError,
    Identity,
    locate,
    locate_many,
    read_identity,
    slot_of,
)
from tests.disk.conftest import SEGMENT_BYTES, SLOT_BYTES, make_config, open_tier


def test_slot_numbering_stripes_and_inverts():
    config = DiskConfig(("/a", "/b", "/c"), capacity_bytes=2 * SEGMENT_BYTES, slot_bytes=SLOT_BYTES,
                        segment_bytes=SEGMENT_BYTES)
    assert config.slots_per_segment == 64 and config.slot_count == 3 * 128
    places = [locate(config, slot) for slot in range(config.slot_count)]
    assert [place.drive for place in places[:7]] == [0, 1, 2, 0, 1, 2, 0]
    assert [place.offset for place in places[:7]] == [0, 0, 0, SLOT_BYTES, SLOT_BYTES, SLOT_BYTES, 2 * SLOT_BYTES]
    assert locate(config, 3 * 64).segment == 1 and locate(config, 3 * 64).offset == 0
    # Every (drive, segment, offset) is used exactly once.
    assert len({(p.drive, p.segment, p.offset) for p in places}) == config.slot_count
    for slot, place in enumerate(places):
        assert slot_of(config, place.drive, place.segment, place.offset) == slot
        assert place.file_index == place.drive * config.segments_per_drive + place.segment
    drives, files, offsets = locate_many(config, np.arange(config.slot_count))
    assert drives.tolist() == [p.drive for p in places]
    assert files.tolist() == [p.file_index for p in places]
    assert offsets.tolist() == [p.offset for p in places]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"directories": ()}, "disk.directories"),
        ({"directories": ("/a", "/a")}, "disk.directories"),
        ({"slot_bytes": 1000}, "disk.slot_bytes"),
        ({"segment_bytes": 3 * SLOT_BYTES + 4096}, "disk.segment_bytes"),
        ({"capacity_bytes": SEGMENT_BYTES + 4096}, "disk.capacity_bytes"),
        ({"queue_depth": 0}, "disk.queue_depth"),
    ],
)
def test_config_errors_name_the_field(overrides, field):
    fields = {"directories": ("/a", "/b"), "capacity_bytes": SEGMENT_BYTES, "slot_bytes": SLOT_BYTES,
              "segment_bytes": SEGMENT_BYTES}
    fields.update(overrides)
    with pytest.raises(ConfigError) as raised:
        DiskConfig(**fields)
    assert raised.value.field == field


def listing(directories):
    return {str(d): sorted(os.listdir(d)) for d in directories if d.exists()}


def refused(config, field: str, directory) -> DiskIdentityError:
    before = listing(config.directories)
    with pytest.raises(DiskIdentityError) as raised:
        open_tier(config)
    error = raised.value
    assert error.field == field and error.directory == directory
    assert str(directory) in str(error) and repr(field) in str(error)
    # Refused means untouched: nothing created, replayed or truncated.
    assert listing(config.directories) == before
    return error


def test_identity_is_written_once_and_checked(drives):
    tier, _ = open_tier(make_config(drives))
    tier.close()
    identity = read_identity(drives[0])
    assert (identity.drive_index, identity.drive_count, identity.slot_bytes) == (0, 2, SLOT_BYTES)
    assert read_identity(drives[1]).set_uuid == identity.set_uuid
    assert json.loads((drives[1] / IDENTITY).read_text())["magic"] == "kvd-disk"

    refused(make_config(drives, slot_bytes=2 * SLOT_BYTES), "slot_bytes", drives[0])
    refused(make_config(drives, segment_bytes=2 * SEGMENT_BYTES), "segment_bytes", drives[0])
    refused(make_config(drives[::-1]), "drive_index", drives[1])
    refused(make_config(drives[:1]), "drive_count", drives[0])


def test_a_drive_of_another_set_is_refused(drives, tmp_path):
    others = (tmp_path / "other0", tmp_path / "other1")
    for directories in (drives, others):
        tier, _ = open_tier(make_config(directories))
        tier.close()
    error = refused(make_config((drives[0], others[1])), "set_uuid", others[1])
    assert read_identity(drives[0]).set_uuid in str(error)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda fields: fields.update(format_version=3), "format_version"),
        (lambda fields: fields.update(magic="leveldb"), "magic"),
        (lambda fields: fields.pop("set_uuid"), "set_uuid"),
    ],
)
def test_a_foreign_or_future_identity_is_refused(drives, edit, field):
    """A sound IDENTITY (its checksum matches, or it has none, as files
    written before the checksum existed) of another kind or version."""
    tier, _ = open_tier(make_config(drives))
    tier.close()
    fields = json.loads((drives[1] / IDENTITY).read_text())
    fields.pop("checksum")
    edit(fields)
    (drives[1] / IDENTITY).write_text(json.dumps(fields))
    if field == "set_uuid":  # kvd never writes one without it: that is damage
        tier, recovery = open_tier(make_config(drives))
        assert list(recovery.quarantined) == [1]
        tier.close()
        return
    refused(make_config(drives), field, drives[1])


def test_foreign_files_are_refused(drives):
    for directory in drives:
        directory.mkdir()
    (drives[1] / "postgres.conf").write_text("data")
    refused(make_config(drives), "magic", drives[1])


@pytest.mark.parametrize("damage", ["garbage", "edited", "missing", "empty"])
def test_a_damaged_identity_quarantines_its_drive_alone(drives, damage):
    """IDENTITY no longer what kvd wrote (issue 10): that drive is out of
    service and untouched; the other opens and keeps its blocks."""
    tier, _ = open_tier(make_config(drives))
    tier.close()
    path = drives[0] / IDENTITY
    if damage == "garbage":
        path.write_bytes(b"\x00\xff not json")
    elif damage == "edited":  # a flipped digit: still JSON, the checksum catches it
        path.write_text(path.read_text().replace('"drive_index": 0', '"drive_index": 1'))
    elif damage == "missing":
        path.unlink()
    else:
        path.write_bytes(b"")
    before = listing(drives[:1])
    tier, recovery = open_tier(make_config(drives))
    try:
        assert list(recovery.quarantined) == [0]
        assert recovery.quarantined[0].path == path
        assert 0 in tier.failed_drives and 1 not in tier.failed_drives
    finally:
        tier.close()
    assert listing(drives[:1]) == before  # nothing written to the quarantined drive


def test_an_empty_drive_joins_a_half_created_set(drives):
    """A crash while the set was being created leaves some drives without IDENTITY."""
    for directory in drives:
        directory.mkdir()
    half = Identity("4f1c0c56-0000-4000-8000-000000000000", 0, 2, SLOT_BYTES, SEGMENT_BYTES)
    (drives[0] / IDENTITY).write_bytes(half.to_json())
    tier, recovery = open_tier(make_config(drives))
    assert recovery.created_drives == [1]
    assert read_identity(drives[1]) == Identity(half.set_uuid, 1, 2, SLOT_BYTES, SEGMENT_BYTES)
    tier.close()
