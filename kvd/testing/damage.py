"""Ways to damage a drive directory of the disk tier, for the damage matrix.

Each damage is a function of one drive directory, named after what it does
to which file, and says what kvd must make of it:

  QUARANTINE  the drive's metadata cannot be read: kvd quarantines that
              drive alone, its blocks are lost, the others serve;
  SERVE       the drive stays in service; only the blocks the damage hit
              (and chains below them) may be lost;
  NONE        nothing is lost (another drive holds a copy of what was hit).

Every damage is deterministic given its drive's files (random bytes come
from a generator seeded by the damage's name), so a failing scenario
replays exactly.
"""

from __future__ import annotations

import enum
import os
import random
from collections.abc import Callable
from pathlib import Path


class Expect(enum.Enum):
    QUARANTINE = "quarantine"
    SERVE = "serve"
    NONE = "none"


def _live_manifest(drive: Path) -> Path:
    return drive / (drive / "CURRENT").read_text().strip()


def _flip(path: Path, position: int, mask: int = 0x5A) -> None:
    data = bytearray(path.read_bytes())
    data[position % len(data)] ^= mask
    path.write_bytes(bytes(data))


def _segments(drive: Path) -> list[Path]:
    return sorted(drive.glob("seg-*.kvd"))


def current_garbage(drive: Path) -> None:
    (drive / "CURRENT").write_bytes(b"\x00\xffgarbage\n")


def current_empty(drive: Path) -> None:
    (drive / "CURRENT").write_bytes(b"")


def current_deleted(drive: Path) -> None:
    (drive / "CURRENT").unlink()


def current_names_a_missing_manifest(drive: Path) -> None:
    (drive / "CURRENT").write_text("MANIFEST-999999\n")


def current_and_manifests_deleted(drive: Path) -> None:
    """Every manifest file and CURRENT gone: only the segments tell it is no new drive."""
    for path in [drive / "CURRENT", *drive.glob("MANIFEST-*")]:
        path.unlink()


def manifest_deleted(drive: Path) -> None:
    _live_manifest(drive).unlink()


def manifest_zeroed(drive: Path) -> None:
    path = _live_manifest(drive)
    path.write_bytes(bytes(path.stat().st_size))


def manifest_emptied(drive: Path) -> None:
    _live_manifest(drive).write_bytes(b"")


def manifest_byte_flipped_in_the_middle(drive: Path) -> None:
    path = _live_manifest(drive)
    _flip(path, path.stat().st_size // 2)


def manifest_first_byte_flipped(drive: Path) -> None:
    _flip(_live_manifest(drive), 0)


def manifest_garbage_inserted(drive: Path) -> None:
    path = _live_manifest(drive)
    data = path.read_bytes()
    middle = len(data) // 3
    garbage = random.Random("manifest_garbage_inserted").randbytes(300)
    path.write_bytes(data[:middle] + garbage + data[middle:])


def namespaces_deleted(drive: Path) -> None:
    (drive / "NAMESPACES").unlink()


def namespaces_zeroed(drive: Path) -> None:
    path = drive / "NAMESPACES"
    path.write_bytes(bytes(path.stat().st_size))


def namespaces_byte_flipped(drive: Path) -> None:
    path = drive / "NAMESPACES"
    _flip(path, path.stat().st_size // 2)


def identity_deleted(drive: Path) -> None:
    (drive / "IDENTITY").unlink()


def identity_garbage(drive: Path) -> None:
    (drive / "IDENTITY").write_bytes(b"{\"magic\": \"kvd-disk\", \x00\x01")


def identity_field_edited(drive: Path) -> None:
    path = drive / "IDENTITY"
    text = path.read_text()
    index = text.index('"segment_bytes": ') + len('"segment_bytes": ')
    path.write_text(text[:index] + "9" + text[index + 1:])  # still JSON: only the checksum tells


def segment_deleted(drive: Path) -> None:
    _segments(drive)[0].unlink()


def segment_truncated(drive: Path) -> None:
    """Cut inside the first slot: every block of the segment is short."""
    os.truncate(_segments(drive)[0], 4096)


def segment_bytes_flipped(drive: Path) -> None:
    """A byte flipped in the first page of every slot of the first segment
    (every block's layer 0 there no longer matches its checksum)."""
    path = _segments(drive)[0]
    slot_bytes = 8 << 10  # the matrix's slots
    with open(path, "r+b") as handle:
        for offset in range(0, path.stat().st_size, slot_bytes):
            handle.seek(offset + 100)
            byte = handle.read(1)
            handle.seek(offset + 100)
            handle.write(bytes([byte[0] ^ 0xA5]))


DAMAGES: dict[str, tuple[Callable[[Path], None], Expect]] = {
    function.__name__: (function, expect)
    for function, expect in [
        (current_garbage, Expect.QUARANTINE),
        (current_empty, Expect.QUARANTINE),
        (current_deleted, Expect.QUARANTINE),
        (current_names_a_missing_manifest, Expect.QUARANTINE),
        (current_and_manifests_deleted, Expect.QUARANTINE),
        (manifest_deleted, Expect.QUARANTINE),
        (manifest_zeroed, Expect.QUARANTINE),
        (manifest_emptied, Expect.QUARANTINE),
        (manifest_byte_flipped_in_the_middle, Expect.SERVE),
        (manifest_first_byte_flipped, Expect.SERVE),
        (manifest_garbage_inserted, Expect.SERVE),
        (namespaces_deleted, Expect.NONE),
        (namespaces_zeroed, Expect.NONE),
        (namespaces_byte_flipped, Expect.NONE),
        (identity_deleted, Expect.QUARANTINE),
        (identity_garbage, Expect.QUARANTINE),
        (identity_field_edited, Expect.QUARANTINE),
        (segment_deleted, Expect.SERVE),
        (segment_truncated, Expect.SERVE),
        (segment_bytes_flipped, Expect.SERVE),
    ]
}
