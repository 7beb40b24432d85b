"""Where a disk slot's bytes live, and which drives belong together.

This module owns the arithmetic of the disk tier and the IDENTITY file of
each drive directory; it does no data I/O.

Slots are numbered globally and dealt out to the drives like cards, so a
caller that allocates slot numbers in order stripes round-robin:

    global slot s  ->  drive s % D,  local slot s // D
    local slot l   ->  segment l // slots_per_segment,
                       offset (l % slots_per_segment) * slot_bytes

    drive 0: seg-000000.kvd [ s0 | s2 | s4 | ... ]  seg-000001.kvd [ ... ]
    drive 1: seg-000000.kvd [ s1 | s3 | s5 | ... ]  seg-000001.kvd [ ... ]

A block occupies the first num_layers * layer_bytes of its slot, layer i at
slot offset i * layer_bytes. The tier takes a namespace only when layer_bytes
is a multiple of 4096, so every layer is one aligned O_DIRECT extent that
goes straight between the drive and the host arena, with no bounce buffer.

IDENTITY (JSON, written once: temp file, fsync, rename, fsync the directory)
names the format, the geometry and the drive set. A directory whose IDENTITY
disagrees with the configuration is refused, never read as something it is
not: a wrong slot size or drive order would pair records with the wrong bytes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np

from kvd.core.keys import LAYER_ALIGN_BYTES
from kvd.core.slot_pool import class_sizes
from kvd.errors import ConfigError, FailedPrecondition
from kvd.invariants import check
from kvd.tiers.disk.journal import FsyncPolicy

FORMAT_MAGIC = "kvd-disk"
# 2: slot size classes (a record's location names its class). A version 1
# directory is a version 2 one whose blocks are all of the largest class,
# so it is taken as it is and its IDENTITY rewritten (Identity.migrated).
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
IDENTITY = "IDENTITY"
NAMESPACES = "NAMESPACES"
SEGMENT_PREFIX = "seg-"
SEGMENT_SUFFIX = ".kvd"
ALIGN_BYTES = LAYER_ALIGN_BYTES  # every layer, slot and segment offset is aligned to it

# Locations (format 2): the slot's class in the top byte.
LOCATION_CLASS_SHIFT = 56
_LOCATION_NUMBER_MASK = (1 << LOCATION_CLASS_SHIFT) - 1

# Limits: each bounds a table the tier allocates at open.
MAX_DRIVES = 64
MAX_SEGMENTS_PER_DRIVE = 1 << 16
MAX_QUEUE_DEPTH = 4096
MAX_SLOT_BYTES = 1 << 30  # a block is written as one I/O entry, which kvd.io caps at 1 GiB


class IdentityDamaged(Exception):
    """A drive's IDENTITY that cannot be read (damage, not another set or
    layout): that drive is quarantined, the others go on."""

    def __init__(self, directory: Path, problem: str) -> None:
        super().__init__(f"{Path(directory) / IDENTITY}: {problem}")
        self.path = Path(directory) / IDENTITY
        self.problem = problem


# Files only kvd writes in a drive directory: one of them without IDENTITY
# is a kvd drive whose IDENTITY was lost, not a directory of someone else's.
KVD_FILE_PREFIXES = ("CURRENT", "MANIFEST-", "NAMESPACES", "seg-")


class DiskIdentityError(FailedPrecondition):
    """A drive directory that must not be read: its IDENTITY disagrees."""

    def __init__(self, directory: Path, field: str, message: str, file: str = IDENTITY) -> None:
        where = f"{file} field" if file else "field"
        super().__init__(f"disk directory {directory}: {where} {field!r}: {message}")
        self.directory = Path(directory)
        self.field = field
        self.file = file


@dataclass(frozen=True, slots=True)
class Admission:
    """Whether a namespace's blocks may go to disk, and if not, why."""

    accepted: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.accepted


@dataclass(frozen=True, slots=True)
class DiskConfig:
    """The disk tier's settings; `validate()` names the first wrong field."""

    directories: tuple[Path, ...]
    capacity_bytes: int  # per drive, a whole number of segments
    slot_bytes: int = 1 << 20
    segment_bytes: int = 1 << 30
    fsync_policy: FsyncPolicy = FsyncPolicy.STRICT
    queue_depth: int = 128
    io_engine: str = "auto"  # kvd.io.engine.open_engine kind
    # A restore reads each block in extents of whole layers, about this
    # long (at least one layer): bigger extents are closer to the drive's
    # sequential bandwidth, smaller ones hand the first layers over sooner.
    read_extent_bytes: int = 512 << 10
    # Slot size classes: slot_bytes (a page) halved down to this; 0: one size.
    min_slot_bytes: int = 0
    # Segment files created are written with zeros, not only preallocated (written extents).
    zero_segments: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "directories", tuple(Path(d) for d in self.directories))
        self.validate()

    def validate(self) -> None:
        if not 1 <= len(self.directories) <= MAX_DRIVES:
            raise ConfigError("disk.directories", f"needs 1 to {MAX_DRIVES} directories, got {len(self.directories)}")
        resolved = [os.path.realpath(d) for d in self.directories]
        if len(set(resolved)) != len(resolved):
            raise ConfigError("disk.directories", "the same directory is listed twice")
        self._validate_slots()
        if (
            not isinstance(self.capacity_bytes, int)
            or self.capacity_bytes <= 0
            or self.capacity_bytes % self.segment_bytes
        ):
            raise ConfigError(
                "disk.capacity_bytes", f"must be a positive multiple of segment_bytes ({self.segment_bytes})"
            )
        if self.capacity_bytes // self.segment_bytes > MAX_SEGMENTS_PER_DRIVE:
            raise ConfigError("disk.capacity_bytes", f"more than {MAX_SEGMENTS_PER_DRIVE} segments per drive")
        if not isinstance(self.fsync_policy, FsyncPolicy):
            raise ConfigError("disk.fsync_policy", f"must be one of {[p.value for p in FsyncPolicy]}")
        if not 1 <= self.queue_depth <= MAX_QUEUE_DEPTH:
            raise ConfigError("disk.queue_depth", f"must be in [1, {MAX_QUEUE_DEPTH}]")
        if not isinstance(self.read_extent_bytes, int) or not 0 < self.read_extent_bytes <= MAX_SLOT_BYTES:
            raise ConfigError("disk.read_extent_bytes", f"must be in [1, {MAX_SLOT_BYTES}]")

    def _validate_slots(self) -> None:
        for name, value in (("slot_bytes", self.slot_bytes), ("segment_bytes", self.segment_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % ALIGN_BYTES:
                raise ConfigError(f"disk.{name}", f"must be a positive multiple of {ALIGN_BYTES}, got {value!r}")
        if not isinstance(self.min_slot_bytes, int) or self.min_slot_bytes < 0 or self.min_slot_bytes % ALIGN_BYTES:
            raise ConfigError("disk.min_slot_bytes", f"must be a multiple of {ALIGN_BYTES}, got {self.min_slot_bytes!r}")
        if self.slot_bytes > MAX_SLOT_BYTES:
            raise ConfigError("disk.slot_bytes", f"must be at most {MAX_SLOT_BYTES}")
        if self.segment_bytes % self.slot_bytes:
            raise ConfigError("disk.segment_bytes", f"must be a multiple of slot_bytes ({self.slot_bytes})")

    @property
    def drive_count(self) -> int:
        return len(self.directories)

    @property
    def class_bytes(self) -> tuple[int, ...]:
        """Slot sizes, largest (slot_bytes, a page) first; class k is slot_bytes >> k."""
        return class_sizes(self.slot_bytes, min(self.min_slot_bytes or self.slot_bytes, self.slot_bytes))

    @property
    def segments_per_drive(self) -> int:
        return self.capacity_bytes // self.segment_bytes

    @property
    def slots_per_segment(self) -> int:
        return self.segment_bytes // self.slot_bytes

    @property
    def slots_per_drive(self) -> int:
        return self.segments_per_drive * self.slots_per_segment

    @property
    def slot_count(self) -> int:
        return self.slots_per_drive * self.drive_count

    @property
    def file_count(self) -> int:
        return self.segments_per_drive * self.drive_count

    def admit(self, layer_bytes: int, num_layers: int) -> Admission:
        if layer_bytes <= 0 or layer_bytes % ALIGN_BYTES:
            return Admission(False, f"layer_bytes {layer_bytes} is not a multiple of {ALIGN_BYTES}")
        if num_layers <= 0 or num_layers * layer_bytes > self.slot_bytes:
            return Admission(
                False, f"block of {num_layers} x {layer_bytes} bytes does not fit a {self.slot_bytes}-byte disk slot"
            )
        return Admission(True)


# ----------------------------------------------------------------------
# Slot numbering


@dataclass(frozen=True, slots=True)
class SlotPlace:
    drive: int
    segment: int
    offset: int  # byte offset of the slot inside its segment file
    file_index: int  # position of the segment file in the I/O engine's table


def file_index(config: DiskConfig, drive: int, segment: int) -> int:
    """Segment files are registered drive-major: drive 0's segments first."""
    return drive * config.segments_per_drive + segment


def location_of(page: int, class_index: int, position: int) -> int:
    """A slot's location, as records hold it: class k (slot_bytes >> k bytes)
    in the top byte, then the slot's number among that class's slots
    (page * 2**k + position). The largest class's location is its page."""
    check(0 <= position < 1 << class_index and 0 <= page, "no slot {} of class {}", position, class_index)
    return (class_index << LOCATION_CLASS_SHIFT) | (page << class_index) | position


def split_location(location: int) -> tuple[int, int, int]:
    """(page, class index, position in the page) of a location."""
    class_index = location >> LOCATION_CLASS_SHIFT
    number = location & _LOCATION_NUMBER_MASK
    return number >> class_index, class_index, number & ((1 << class_index) - 1)


def drive_of(config: DiskConfig, location: int) -> int:
    return split_location(location)[0] % config.drive_count


def valid_location(config: DiskConfig, location: int) -> bool:
    page, class_index, _ = split_location(location)
    return 0 <= location and class_index < len(config.class_bytes) and page < config.slot_count


def locate(config: DiskConfig, slot: int) -> SlotPlace:
    """Where the slot at location `slot` is."""
    check(valid_location(config, slot), f"disk slot {slot} out of range ({config.slot_count} pages)")
    page, class_index, position = split_location(slot)
    drive = page % config.drive_count
    segment, index = divmod(page // config.drive_count, config.slots_per_segment)
    offset = index * config.slot_bytes + position * (config.slot_bytes >> class_index)
    return SlotPlace(drive, segment, offset, file_index(config, drive, segment))


def locate_many(config: DiskConfig, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(drive, file index, offset) of each slot location, as arrays; one call per batch."""
    slots = np.asarray(slots, dtype=np.int64)
    classes = slots >> LOCATION_CLASS_SHIFT
    numbers = slots & _LOCATION_NUMBER_MASK
    pages = numbers >> classes
    if slots.size:
        check(int(slots.min()) >= 0 and int(classes.max()) < len(config.class_bytes)
              and int(pages.max()) < config.slot_count, "disk slot out of range")
    positions = numbers & ((1 << classes) - 1)
    drives = pages % config.drive_count
    local = pages // config.drive_count
    segments = local // config.slots_per_segment
    offsets = (local % config.slots_per_segment) * config.slot_bytes + positions * (config.slot_bytes >> classes)
    return drives, drives * config.segments_per_drive + segments, offsets


def slot_of(config: DiskConfig, drive: int, segment: int, offset: int) -> int:
    """Inverse of locate (tests and fsck messages)."""
    local = segment * config.slots_per_segment + offset // config.slot_bytes
    return local * config.drive_count + drive


def segment_name(segment: int) -> str:
    return f"{SEGMENT_PREFIX}{segment:06d}{SEGMENT_SUFFIX}"


def segment_number(name: str) -> int | None:
    if not (name.startswith(SEGMENT_PREFIX) and name.endswith(SEGMENT_SUFFIX)):
        return None
    digits = name[len(SEGMENT_PREFIX) : -len(SEGMENT_SUFFIX)]
    return int(digits) if digits.isdigit() else None


# ----------------------------------------------------------------------
# IDENTITY


@dataclass(frozen=True, slots=True)
class Identity:
    set_uuid: str
    drive_index: int
    drive_count: int
    slot_bytes: int
    segment_bytes: int
    magic: str = FORMAT_MAGIC
    format_version: int = FORMAT_VERSION

    def fields(self) -> dict:
        return {
            "magic": self.magic,
            "format_version": self.format_version,
            "set_uuid": self.set_uuid,
            "drive_index": self.drive_index,
            "drive_count": self.drive_count,
            "slot_bytes": self.slot_bytes,
            "segment_bytes": self.segment_bytes,
        }

    def to_json(self) -> bytes:
        fields = self.fields()
        fields["checksum"] = _identity_checksum(fields)
        return (json.dumps(fields, indent=2, sort_keys=True) + "\n").encode()

    @staticmethod
    def from_json(directory: Path, data: bytes) -> Identity:
        """Parse. IdentityDamaged for bytes that are no longer what kvd wrote
        (not JSON, fields missing, a checksum that does not match);
        DiskIdentityError for a sound IDENTITY of another format version."""
        try:
            fields = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise IdentityDamaged(directory, f"not readable JSON ({error})") from None
        if not isinstance(fields, dict):
            raise IdentityDamaged(directory, f"not a JSON object but {type(fields).__name__}")
        checksum = fields.pop("checksum", None)  # IDENTITY files written before it existed have none
        if checksum is not None and checksum != _identity_checksum(fields):
            raise IdentityDamaged(directory, "its checksum does not match its fields (a damaged file)")
        if fields.get("magic") != FORMAT_MAGIC:
            raise DiskIdentityError(directory, "magic", f"expected {FORMAT_MAGIC!r}, found {fields.get('magic')!r}")
        version = fields.get("format_version")
        if version not in READABLE_VERSIONS:
            raise DiskIdentityError(
                directory,
                "format_version",
                f"this kvd reads versions {', '.join(map(str, READABLE_VERSIONS))} (and writes {FORMAT_VERSION}), "
                f"the directory has {version!r}",
            )
        values = {}
        for name, kind in (
            ("set_uuid", str),
            ("drive_index", int),
            ("drive_count", int),
            ("slot_bytes", int),
            ("segment_bytes", int),
        ):
            value = fields.get(name)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise IdentityDamaged(directory, f"field {name!r} is missing or not a {kind.__name__}: {value!r}")
            values[name] = value
        return Identity(**values, format_version=version)

    @property
    def migrated(self) -> Identity:
        """This identity in the format this kvd writes (what an older one becomes)."""
        return dataclasses.replace(self, format_version=FORMAT_VERSION)

    def expect(self, directory: Path, expected: Identity) -> None:
        """Raise naming the first field in which this identity differs."""
        for name, meaning in (
            ("slot_bytes", "the configured disk.slot_bytes"),
            ("segment_bytes", "the configured disk.segment_bytes"),
            ("drive_count", "the number of configured disk.directories"),
            ("drive_index", "this directory's position in disk.directories (drives reordered?)"),
            ("set_uuid", "the drive set of the other directories"),
        ):
            found, wanted = getattr(self, name), getattr(expected, name)
            if found != wanted:
                raise DiskIdentityError(directory, name, f"directory has {found!r}, but {meaning} is {wanted!r}")


def _identity_checksum(fields: dict) -> str:
    """crc32c of the fields in canonical JSON, as 8 hex digits."""
    return f"{crc32c.crc32c(json.dumps(fields, sort_keys=True).encode()):08x}"


def read_identity(directory: Path) -> Identity | None:
    """The drive's IDENTITY, None if it has none; IdentityDamaged if it cannot be read."""
    path = Path(directory) / IDENTITY
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as error:
        raise IdentityDamaged(Path(directory), f"cannot be read ({error.strerror or error})") from None
    return Identity.from_json(Path(directory), data)


def holds_kvd_files(directory: Path) -> bool:
    return any(name.startswith(KVD_FILE_PREFIXES) for name in os.listdir(directory))


def write_identity(directory: Path, identity: Identity) -> None:
    """Publish IDENTITY atomically: a crash leaves no file or the whole file."""
    directory = Path(directory)
    temporary = directory / (IDENTITY + ".tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, identity.to_json())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temporary, directory / IDENTITY)
    fsync_directory(directory)


def fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def new_set_uuid() -> str:
    return str(uuid.uuid4())


def identities_for(
    config: DiskConfig, found: list[Identity | None], damaged: set[int] = frozenset()
) -> tuple[list[Identity], list[int]]:
    """The identity every drive must have, and which drives still need one.

    Either no drive has an IDENTITY (a new set: a fresh uuid), or the ones
    that do agree on one set and each sits at its own position. A drive
    without IDENTITY joins that set only when its directory is empty (a
    replaced drive, or a crash while the set was being created): anything
    already in it was written by something else. Drives in `damaged` (an
    IDENTITY that cannot be read, or kvd's files without one) are left out:
    they are quarantined, neither checked nor given an IDENTITY.
    """
    existing = [identity for drive, identity in enumerate(found) if identity is not None and drive not in damaged]
    set_uuid = existing[0].set_uuid if existing else new_set_uuid()
    expected = [
        Identity(set_uuid, index, config.drive_count, config.slot_bytes, config.segment_bytes)
        for index in range(config.drive_count)
    ]
    missing = []
    for index, (directory, identity) in enumerate(zip(config.directories, found, strict=True)):
        if index in damaged:
            continue
        if identity is None:
            leftovers = [name for name in os.listdir(directory) if name != IDENTITY + ".tmp"]
            if leftovers:
                raise DiskIdentityError(
                    directory,
                    "magic",
                    f"no IDENTITY, but the directory is not empty (it holds {sorted(leftovers)[:3]}); "
                    "refusing to put a drive of the disk tier among files kvd did not write",
                )
            missing.append(index)
        else:
            identity.expect(directory, expected[index])
    return expected, missing
