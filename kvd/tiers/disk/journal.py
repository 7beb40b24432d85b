"""The disk tier's manifest: a framed, checksummed log of block edits.

See FORMAT.md beside this module for the byte layout and the write order.
This module owns the manifest files of one drive directory:

  * framing: `encode_frame` / `decode_frames` (the first bad frame ends a log);
  * `Manifest`: replay at start (torn tail truncated), appends with an
    fsync policy, and compaction into a snapshot published by switching
    CURRENT atomically (temp file, fsync, rename, fsync the directory).

File operations go through a small `FileSystem` interface so that crash
tests can run the same code on a file system that forgets unsynced writes
(kvd.testing.crashfs).
"""

from __future__ import annotations

import enum
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import crc32c

from kvd.invariants import check

FRAME_HEADER = struct.Struct("<IIB")  # length of payload, crc32c(type+payload), type
MAX_PAYLOAD_BYTES = 1 << 20
CURRENT = "CURRENT"
MANIFEST_PREFIX = "MANIFEST-"
KEY_BYTES = 32
ROOT_PARENT = bytes(KEY_BYTES)


class RecordType(enum.IntEnum):
    SNAPSHOT_BEGIN = 1
    PUT = 2
    REMOVE = 3
    SNAPSHOT_END = 4
    NAMESPACE = 5  # only in a drive's NAMESPACES registry (registry.py), never in a manifest


class FsyncPolicy(enum.Enum):
    STRICT = "strict"  # fsync after every append
    GROUP = "group"  # the caller syncs at most every group_commit_ms
    NONE = "none"  # never fsync the manifest (a cache you can afford to lose)


def _checksum(record_type: int, payload: bytes) -> int:
    return crc32c.crc32c(payload, crc32c.crc32c(bytes((record_type,))))


def encode_frame(record_type: RecordType, payload: bytes) -> bytes:
    check(len(payload) <= MAX_PAYLOAD_BYTES, "manifest payload too large")
    return FRAME_HEADER.pack(len(payload), _checksum(record_type, payload), record_type) + payload


def decode_frames(data: bytes) -> tuple[list[tuple[RecordType, bytes]], int]:
    """Every valid frame from the start of `data`, and where validity ends.

    Stops at the first frame that is short, too long, of unknown type or
    whose checksum does not match: everything after it is a torn or
    corrupt tail and must not be trusted, even if it happens to parse.
    """
    frames: list[tuple[RecordType, bytes]] = []
    position = 0
    size = len(data)
    while position + FRAME_HEADER.size <= size:
        length, checksum, record_type = FRAME_HEADER.unpack_from(data, position)
        start = position + FRAME_HEADER.size
        end = start + length
        if length > MAX_PAYLOAD_BYTES or end > size or record_type not in RecordType._value2member_map_:
            break
        payload = bytes(data[start:end])
        if _checksum(record_type, payload) != checksum:
            break
        frames.append((RecordType(record_type), payload))
        position = end
    return frames, position


# ----------------------------------------------------------------------
# Records

_PUT_HEAD = struct.Struct("<Q32s32s32sQH")
_REMOVE = struct.Struct("<Q32s32s")
_SEQUENCE = struct.Struct("<Q")
_SNAPSHOT_END = struct.Struct("<QQ")


@dataclass(frozen=True, slots=True)
class PutRecord:
    sequence: int
    namespace_id: bytes
    key: bytes
    parent_key: bytes  # ROOT_PARENT for a root block
    location: int
    # crc32c of each layer, packed as u32 little-endian: 4 bytes a layer,
    # which is how the frame stores them and far smaller in memory than a
    # tuple of ints (the tier keeps one record per block on disk).
    layer_checksums: bytes

    @property
    def layer_count(self) -> int:
        return len(self.layer_checksums) // 4

    def checksum_values(self) -> tuple[int, ...]:
        return struct.unpack(f"<{self.layer_count}I", self.layer_checksums)

    def encode(self) -> bytes:
        check(len(self.layer_checksums) % 4 == 0, "layer checksums are packed u32s")
        head = _PUT_HEAD.pack(
            self.sequence, self.namespace_id, self.key, self.parent_key, self.location, self.layer_count
        )
        return encode_frame(RecordType.PUT, head + self.layer_checksums)

    @staticmethod
    def decode(payload: bytes) -> PutRecord | None:
        if len(payload) < _PUT_HEAD.size:
            return None
        sequence, namespace_id, key, parent_key, location, layers = _PUT_HEAD.unpack_from(payload)
        if len(payload) != _PUT_HEAD.size + 4 * layers:
            return None
        return PutRecord(sequence, namespace_id, key, parent_key, location, payload[_PUT_HEAD.size:])


@dataclass(frozen=True, slots=True)
class RemoveRecord:
    sequence: int
    namespace_id: bytes
    key: bytes

    def encode(self) -> bytes:
        return encode_frame(RecordType.REMOVE, _REMOVE.pack(self.sequence, self.namespace_id, self.key))

    @staticmethod
    def decode(payload: bytes) -> RemoveRecord | None:
        if len(payload) != _REMOVE.size:
            return None
        return RemoveRecord(*_REMOVE.unpack(payload))


Record = PutRecord | RemoveRecord


# ----------------------------------------------------------------------
# File system seam


class FileSystem(Protocol):
    """The file operations the manifest needs, and nothing more."""

    def read(self, path: Path) -> bytes | None: ...

    def write_new(self, path: Path, data: bytes) -> None:
        """Create (or replace) `path` with `data`, not yet synced."""
        ...

    def append(self, path: Path, data: bytes) -> None: ...

    def truncate(self, path: Path, size: int) -> None: ...

    def fsync(self, path: Path) -> None: ...

    def fsync_directory(self, path: Path) -> None: ...

    def rename(self, source: Path, target: Path) -> None: ...

    def remove(self, path: Path) -> None: ...

    def list(self, directory: Path) -> list[str]: ...


class OsFileSystem:
    """The real one."""

    def read(self, path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def write_new(self, path: Path, data: bytes) -> None:
        with open(path, "wb") as handle:
            handle.write(data)

    def append(self, path: Path, data: bytes) -> None:
        with open(path, "ab") as handle:
            handle.write(data)

    def truncate(self, path: Path, size: int) -> None:
        os.truncate(path, size)

    def fsync(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_directory(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, source: Path, target: Path) -> None:
        os.rename(source, target)

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def list(self, directory: Path) -> list[str]:
        return sorted(entry.name for entry in directory.iterdir())


# ----------------------------------------------------------------------
# The manifest


@dataclass(slots=True)
class ReplayReport:
    """What recovery found; every number ends up in a metric or a log line."""

    manifest: str = ""
    records: int = 0
    truncated_bytes: int = 0
    malformed_records: int = 0
    live_blocks: int = 0
    removed_manifests: list[str] = field(default_factory=list)


def _manifest_number(name: str) -> int | None:
    if not name.startswith(MANIFEST_PREFIX):
        return None
    digits = name[len(MANIFEST_PREFIX) :]
    return int(digits) if digits.isdigit() else None


class Manifest:
    """The live manifest of one drive directory."""

    def __init__(self, directory: Path, policy: FsyncPolicy = FsyncPolicy.STRICT, fs: FileSystem | None = None) -> None:
        self.directory = Path(directory)
        self.policy = policy
        self.fs = fs or OsFileSystem()
        self.number = 0
        self.size_bytes = 0
        self.next_sequence = 1
        self.unsynced_bytes = 0
        # Live blocks after replay and every edit since: (namespace, key) -> PUT.
        self.live: dict[tuple[bytes, bytes], PutRecord] = {}

    @property
    def path(self) -> Path:
        return self._path_of(self.number)

    def _path_of(self, number: int) -> Path:
        return self.directory / f"{MANIFEST_PREFIX}{number:06d}"

    def open(self) -> ReplayReport:
        """Replay the live manifest (or start an empty one)."""
        report = ReplayReport()
        current = self.fs.read(self.directory / CURRENT)
        if current is None:
            self._publish(1, self._snapshot_bytes())
            report.manifest = self.path.name
            return report
        name = current.decode(errors="replace").strip()
        number = _manifest_number(name)
        if number is None or "/" in name:
            raise ValueError(f"{self.directory / CURRENT} names {name!r}, which is not a manifest")
        self.number = number
        data = self.fs.read(self.path)
        if data is None:
            raise FileNotFoundError(f"{self.directory / CURRENT} names {name}, which does not exist")
        frames, valid_bytes = decode_frames(data)
        if valid_bytes < len(data):
            # A torn or corrupt tail: cut it off so new appends follow valid frames.
            report.truncated_bytes = len(data) - valid_bytes
            self.fs.truncate(self.path, valid_bytes)
            self.fs.fsync(self.path)
        self.size_bytes = valid_bytes
        for record_type, payload in frames:
            report.records += 1
            self._apply_frame(record_type, payload, report)
        report.manifest = name
        report.live_blocks = len(self.live)
        report.removed_manifests = self._remove_stale_manifests()
        return report

    def _apply_frame(self, record_type: RecordType, payload: bytes, report: ReplayReport) -> None:
        if record_type == RecordType.PUT:
            record = PutRecord.decode(payload)
            if record is None:
                report.malformed_records += 1
                return
            self.live[(record.namespace_id, record.key)] = record
        elif record_type == RecordType.REMOVE:
            removal = RemoveRecord.decode(payload)
            if removal is None:
                report.malformed_records += 1
                return
            self.live.pop((removal.namespace_id, removal.key), None)
            record = removal
        else:
            if len(payload) < _SEQUENCE.size:
                report.malformed_records += 1
                return
            (sequence,) = _SEQUENCE.unpack_from(payload)
            self.next_sequence = max(self.next_sequence, sequence + 1)
            return
        self.next_sequence = max(self.next_sequence, record.sequence + 1)

    def _remove_stale_manifests(self) -> list[str]:
        removed = []
        for name in self.fs.list(self.directory):
            number = _manifest_number(name)
            if number is not None and number != self.number:
                self.fs.remove(self.directory / name)
                removed.append(name)
        return removed

    def sequence(self) -> int:
        value = self.next_sequence
        self.next_sequence += 1
        return value

    def append(self, records: Iterable[Record]) -> None:
        """Append edits; under STRICT they are durable when this returns.

        `live` changes only once the write (and, under STRICT, the sync)
        succeeded. On failure the file is cut back to its last good end, so
        a half-written frame never sits in front of later appends.
        """
        records = list(records)
        data = b"".join(record.encode() for record in records)
        if not data:
            return
        try:
            self.fs.append(self.path, data)
            if self.policy == FsyncPolicy.STRICT:
                self.fs.fsync(self.path)
        except OSError:
            self.fs.truncate(self.path, self.size_bytes)
            raise
        self.size_bytes += len(data)
        if self.policy != FsyncPolicy.STRICT:
            self.unsynced_bytes += len(data)
        for record in records:
            if isinstance(record, PutRecord):
                self.live[(record.namespace_id, record.key)] = record
            else:
                self.live.pop((record.namespace_id, record.key), None)

    def sync(self) -> None:
        """Make every appended edit durable (GROUP calls this on a timer)."""
        if self.unsynced_bytes and self.policy != FsyncPolicy.NONE:
            self.fs.fsync(self.path)
        self.unsynced_bytes = 0

    def _snapshot_bytes(self) -> bytes:
        sequence = self.sequence()
        parts = [encode_frame(RecordType.SNAPSHOT_BEGIN, _SEQUENCE.pack(sequence))]
        parts.extend(record.encode() for record in self.live.values())
        parts.append(encode_frame(RecordType.SNAPSHOT_END, _SNAPSHOT_END.pack(sequence, len(self.live))))
        return b"".join(parts)

    def compact(self) -> None:
        """Rewrite the live blocks into a new manifest and switch CURRENT to it."""
        old_path = self.path
        self._publish(self.number + 1, self._snapshot_bytes())
        self.fs.remove(old_path)

    def _publish(self, number: int, snapshot: bytes) -> None:
        """Write manifest `number`, make it durable, then point CURRENT at it.

        Only then does this object switch to it: if any step fails, appends
        keep going to the manifest CURRENT still names.
        """
        path = self._path_of(number)
        self.fs.write_new(path, snapshot)
        self.fs.fsync(path)
        temporary = self.directory / (CURRENT + ".tmp")
        self.fs.write_new(temporary, f"{path.name}\n".encode())
        self.fs.fsync(temporary)
        self.fs.rename(temporary, self.directory / CURRENT)
        self.fs.fsync_directory(self.directory)
        self.number = number
        self.size_bytes = len(snapshot)
        self.unsynced_bytes = 0

    def records(self) -> Iterator[PutRecord]:
        return iter(self.live.values())
