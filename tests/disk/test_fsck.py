"""`kvd inspect` and `kvd fsck` on real drive directories, through the CLI."""

from __future__ import annotations

import hashlib

import pytest

from kvd.cli import main
from kvd.tiers.disk.layout import locate, segment_name
from tests.disk.conftest import LAYER_BYTES, NAMESPACE, make_config, open_tier, write


def corrupt(config, slot: int, position: int) -> None:
    place = locate(config, slot)
    path = config.directories[place.drive] / segment_name(place.segment)
    with open(path, "r+b") as handle:
        handle.seek(place.offset + position)
        byte = handle.read(1)
        handle.seek(place.offset + position)
        handle.write(bytes([byte[0] ^ 1]))


def snapshot(directories) -> dict[str, str]:
    """Digest of every file, to prove a command changed nothing."""
    return {
        str(path): hashlib.sha256(path.read_bytes()).hexdigest()
        for directory in directories
        for path in sorted(directory.iterdir())
    }


@pytest.fixture
def written(drives, arena):
    config = make_config(drives)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {slot: slot for slot in range(12)}))
    tier.close()
    return config


def test_inspect_shows_identity_segments_and_namespaces(written, drives, capsys):
    before = snapshot(drives)
    assert main(["inspect", *map(str, drives)]) == 0
    out = capsys.readouterr().out
    assert "drive 0 of 2" in out and "drive 1 of 2" in out
    assert "slot 64 KiB, segment 4 MiB" in out
    assert out.count("segments   2 files, 8 MiB") == 2
    assert out.count("6 live blocks") == 2
    assert f"{NAMESPACE.hex()[:16]}         6 blocks  test-model layers=3 layer_bytes=8192" in out
    assert snapshot(drives) == before


def test_fsck_of_a_clean_set(written, drives, capsys):
    before = snapshot(drives)
    assert main(["fsck", *map(str, drives)]) == 0
    captured = capsys.readouterr()
    assert "good 12  corrupt 0  missing 0  unreadable 0" in captured.out
    assert "12/12 blocks 100.0%" in captured.err  # the progress bar
    assert snapshot(drives) == before


def test_fsck_finds_and_repairs_a_corrupt_block(written, drives, capsys):
    corrupt(written, 7, 2 * LAYER_BYTES + 5)
    # A torn manifest tail too: plain fsck must not cut it off.
    with open(drives[0] / "MANIFEST-000001", "ab") as handle:
        handle.write(b"\x99\x00")
    before = snapshot(drives)
    assert main(["fsck", *map(str, drives)]) == 1
    out = capsys.readouterr().out
    assert "good 11  corrupt 1  missing 0" in out
    assert "corrupt: drive 1 slot 7" in out
    assert "torn tails: 2 bytes" in out
    assert snapshot(drives) == before

    assert main(["fsck", "--repair", *map(str, drives)]) == 1  # it was corrupt
    out = capsys.readouterr().out
    assert "repaired: 1 REMOVE records appended" in out
    assert main(["fsck", *map(str, drives)]) == 0
    assert "good 11  corrupt 0" in capsys.readouterr().out
    tier, recovery = open_tier(written)
    assert sorted(r.location for r in recovery.blocks[NAMESPACE]) == [s for s in range(12) if s != 7]
    tier.close()


def test_fsck_counts_blocks_of_a_missing_segment(written, drives, capsys):
    (drives[1] / segment_name(0)).unlink()
    assert main(["fsck", *map(str, drives)]) == 1  # lost (never lied about, but lost)
    out = capsys.readouterr().out
    assert "good 6  corrupt 0  missing 6" in out and "missing segment:" in out


# Issue 10, item 5: fsck said all was well after each of these.


def test_fsck_reports_blocks_lost_with_every_namespaces_file(written, drives, capsys):
    for drive in drives:
        (drive / "NAMESPACES").unlink()
    before = snapshot(drives)
    assert main(["fsck", *map(str, drives)]) == 1
    out = capsys.readouterr().out
    assert "dropped: 12 blocks: their namespace is in no drive's NAMESPACES" in out
    assert "lost: at least 12 blocks" in out
    assert snapshot(drives) == before


@pytest.mark.parametrize("damage", ["current_deleted", "current_garbage", "manifest_zeroed", "manifest_deleted"])
def test_fsck_reports_a_drive_whose_metadata_cannot_be_read(written, drives, capsys, damage):
    from kvd.testing import damage as damages

    getattr(damages, damage)(drives[0])
    before = snapshot(drives)
    assert main(["fsck", *map(str, drives)]) == 1
    out = capsys.readouterr().out
    assert f"quarantined: drive 0: {drives[0]}/" in out
    assert "good 6  corrupt 0" in out  # the other drive's blocks, read and verified
    if damage.startswith("current_"):
        assert "; 6 blocks lost" in out  # counted from the manifest CURRENT no longer names
    assert snapshot(drives) == before  # read-only
    assert main(["fsck", "--repair", *map(str, drives)]) == 1
    assert "repaired: drive 0: " in capsys.readouterr().out
    assert main(["fsck", *map(str, drives)]) == 0
    out = capsys.readouterr().out
    # A damaged CURRENT costs nothing once repaired: the manifest was intact.
    assert ("good 12" if damage.startswith("current_") else "good 6") in out


def test_fsck_reports_damage_inside_a_manifest_and_the_records_it_cost(written, drives, capsys):
    from kvd.testing.damage import manifest_byte_flipped_in_the_middle

    manifest_byte_flipped_in_the_middle(drives[1])
    assert main(["fsck", *map(str, drives)]) == 1
    out = capsys.readouterr().out
    assert "damaged: drive 1: MANIFEST-" in out and "at least 1 records lost" in out
    assert "good 11" in out
    assert main(["fsck", "--repair", *map(str, drives)]) == 1
    capsys.readouterr()
    assert main(["fsck", *map(str, drives)]) == 0


def test_fsck_refuses_a_drive_set_in_the_wrong_order(written, drives, capsys):
    assert main(["fsck", str(drives[1]), str(drives[0])]) == 2
    assert "'drive_index'" in capsys.readouterr().err
    assert main(["inspect", str(drives[0].parent)]) == 2
    assert "not a kvd disk directory" in capsys.readouterr().err
