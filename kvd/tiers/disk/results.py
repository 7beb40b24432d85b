"""What the disk tier reports: what an open found, its counters, why a read failed.

Plain data, shared by every part of the tier (kvd/tiers/disk/tier.py lists
them) and by its callers: the disk plane, fsck, the tests.
"""

from __future__ import annotations

import enum
import errno
from dataclasses import dataclass, field
from pathlib import Path

from kvd.tiers.disk.journal import ReplayReport
from kvd.tiers.disk.records import PutRecord
from kvd.tiers.disk.registry import NamespaceEntry, RegistryReport


@dataclass(slots=True)
class DroppedCounts:
    """PUT records found at open that were not kept, by reason."""

    out_of_range: int = 0  # slot beyond the configured capacity, or on another drive
    missing_segment: int = 0  # its segment file is missing, or too short to hold it
    unknown_namespace: int = 0  # no registry on any drive knows its namespace
    malformed: int = 0  # layer count does not match its namespace, or the shape no longer fits a slot
    duplicate_slot: int = 0  # an older record for a slot a newer one also claims

    @property
    def total(self) -> int:
        return self.out_of_range + self.missing_segment + self.unknown_namespace + self.malformed + self.duplicate_slot


@dataclass(frozen=True, slots=True)
class DriveDamage:
    """Why a drive is quarantined: the file that cannot be read, what is
    wrong with it, and the blocks lost with it (None: unknown)."""

    drive: int
    path: Path
    problem: str
    blocks: int | None


@dataclass(slots=True)
class DiskRecovery:
    """What open() found; no block data was read to find it."""

    # namespace id -> its live PUT records; record.location is the global slot.
    blocks: dict[bytes, list[PutRecord]] = field(default_factory=dict)
    namespaces: dict[bytes, NamespaceEntry] = field(default_factory=dict)
    records: int = 0  # manifest frames replayed, all drives
    truncated_bytes: int = 0  # torn manifest/registry tails cut off, all drives
    dropped: DroppedCounts = field(default_factory=DroppedCounts)
    created_drives: list[int] = field(default_factory=list)  # got a new IDENTITY now
    migrated_drives: list[int] = field(default_factory=list)  # IDENTITY rewritten from an older format
    missing_segments: list[Path] = field(default_factory=list)
    short_segments: list[Path] = field(default_factory=list)
    manifests: list[ReplayReport] = field(default_factory=list)
    registries: list[RegistryReport] = field(default_factory=list)
    # Damage inside manifests and registries (not torn tails), and the
    # manifest records it destroyed (at least; see ReplayReport).
    damaged_bytes: int = 0
    lost_records: int = 0
    # Drives whose metadata cannot be read: out of service, blocks lost.
    quarantined: dict[int, DriveDamage] = field(default_factory=dict)

    @property
    def block_count(self) -> int:
        return sum(len(records) for records in self.blocks.values())


@dataclass(slots=True)
class DiskStats:
    bytes_written: int = 0
    bytes_read: int = 0
    submissions: int = 0  # batches handed to the I/O engine
    fsyncs: int = 0  # segment fdatasyncs
    blocks_written: int = 0  # reported durable
    blocks_read: int = 0  # every layer read and verified
    write_failures: int = 0  # blocks
    read_failures: int = 0  # blocks
    checksum_failures: int = 0  # layers read in full whose crc32c did not match
    shredded: int = 0  # deleted blocks whose first page was overwritten with a tombstone
    errors: dict[str, int] = field(default_factory=dict)  # by kind: EIO, ENOSPC, short_read, fsync_EIO, manifest, ...
    corrupt_blocks: dict[bytes, int] = field(default_factory=dict)  # by namespace: blocks that failed a checksum

    def count_error(self, kind: str, amount: int = 1) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + amount


class ReadFailure(enum.IntEnum):
    """Why read_blocks said False for a block (its first failure)."""

    NONE = 0
    IO_ERROR = 1  # the engine returned -errno for a layer
    SHORT_READ = 2  # fewer bytes than a layer (e.g. the segment was truncated)
    CHECKSUM = 3  # read in full, but a layer's crc32c differs from its record
    MISSING_SEGMENT = 4  # the segment file was missing at open (read-only tiers)


def error_kind(result: int, short: str) -> str:
    """The name an engine result counts under in DiskStats.errors: its errno's
    name when negative, else `short` (fewer bytes than asked)."""
    if result >= 0:
        return short
    return errno.errorcode.get(-result, f"errno_{-result}")
