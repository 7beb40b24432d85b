"""The disk tier's manifest: a framed, checksummed log of block edits.

See FORMAT.md beside this module for the byte layout and the write order.
This module owns the manifest files of one drive directory:

  * framing (frames.py), the records (records.py) and the file system seam
    (fs.py) are their own modules;
  * `Manifest`: replay at start (torn tail truncated), appends with an
    fsync policy, and compaction into a snapshot published by switching
    CURRENT atomically (temp file, fsync, rename, fsync the directory).

File operations go through a small `FileSystem` interface so that crash
tests can run the same code on a file system that forgets unsynced writes
(kvd.testing.crashfs).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path


from kvd.tiers.disk.frames import (SEQUENCE, SNAPSHOT_END, FrameScan,
                                   RecordType, decode_frames, encode_frame)
from kvd.tiers.disk.fs import FileSystem, OsFileSystem
from kvd.tiers.disk.records import PutRecord, Record, RemoveRecord


CURRENT = "CURRENT"
MANIFEST_PREFIX = "MANIFEST-"


class FsyncPolicy(enum.Enum):
    STRICT = "strict"  # fsync after every append
    GROUP = "group"  # the caller syncs at most every group_commit_ms
    NONE = "none"  # never fsync the manifest (a cache you can afford to lose)


# ----------------------------------------------------------------------
# The manifest


@dataclass(slots=True)
class ReplayReport:
    """What recovery found; every number ends up in a metric or a log line."""

    manifest: str = ""
    records: int = 0
    truncated_bytes: int = 0  # a torn tail: an append a crash cut short (cut off)
    malformed_records: int = 0
    live_blocks: int = 0
    removed_manifests: list[str] = field(default_factory=list)
    # Damage inside the log (not a torn tail): the byte ranges skipped, and
    # how many records they held, at least (from the sequence numbers of
    # the records around them and the snapshot's record count).
    damaged_regions: int = 0
    damaged_bytes: int = 0
    lost_records: int = 0

    @property
    def damaged(self) -> bool:
        return self.damaged_regions > 0 or self.lost_records > 0


class MetadataDamage(Exception):
    """A drive's metadata file that cannot be read, so none of the drive's
    blocks can be trusted: the file, what is wrong, and how many blocks it
    held as far as can be told (None: unknown)."""

    def __init__(self, path: Path, problem: str, blocks: int | None = None) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = Path(path)
        self.problem = problem
        self.blocks = blocks

    @property
    def in_current(self) -> bool:
        """Whether CURRENT is what is wrong (not the manifest it names)."""
        return self.path.name == CURRENT


# Sequence numbers above this are not taken from snapshot markers: a marker
# found by resynchronisation inside damage could carry anything.
_MAX_SEQUENCE = 1 << 62


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

    def open(self, *, create: bool = True, in_use: bool = False) -> ReplayReport:
        """Replay the live manifest (or, if `create`, start an empty one on a new drive).

        in_use: the drive holds what only follows a published CURRENT (the
        tier's segment files), so it is no new drive whatever its manifests.

        MetadataDamage when the drive's blocks cannot be found: CURRENT
        unreadable, naming no manifest or a missing one, or missing while a
        manifest with blocks exists; the live manifest missing or holding
        no valid record. Damage inside the manifest only costs the records
        it hit: replay resynchronises after it (decode_frames), and the
        report counts the damage and the records lost.
        """
        current_path = self.directory / CURRENT
        current = self._read(current_path)
        if current is None:
            return self._start_new(current_path, create, in_use)
        name = current.decode(errors="replace").strip()
        number = _manifest_number(name)
        if number is None or "/" in name:
            raise MetadataDamage(current_path, f"does not name a manifest (it holds {current[:48]!r})",
                                 self._blocks_in_newest())
        self.number = number
        data = self._read(self.path)
        if data is None:
            raise MetadataDamage(self.path, "is missing, and CURRENT names it as the live manifest",
                                 self._blocks_in_newest())
        scan = decode_frames(data)
        if not scan.frames:
            raise MetadataDamage(self.path, f"holds no valid record in its {len(data)} bytes (every manifest "
                                 "begins with a snapshot)")
        report = ReplayReport(manifest=name)
        if scan.valid_end < len(data):
            # A torn tail: cut it off so new appends follow valid frames.
            report.truncated_bytes = len(data) - scan.valid_end
            self.fs.truncate(self.path, scan.valid_end)
            self.fs.fsync(self.path)
        self.size_bytes = scan.valid_end
        # What a killed run appended may be in the page cache only: unsynced until the next sync.
        self.unsynced_bytes = self.size_bytes
        self._replay(scan, report)
        report.live_blocks = len(self.live)
        report.removed_manifests = self._remove_stale_manifests()
        return report

    def repair(self, *, in_use: bool = False) -> str:
        """Make this drive's manifest readable again (`kvd fsck --repair`);
        what was done, in words ("" when nothing needed doing).

        CURRENT unreadable, missing or naming a missing manifest: it is
        pointed at the newest manifest whose snapshot is complete (one a
        compaction left half written is not), else the newest holding any
        valid record. With neither, or when the live manifest holds no
        valid record, a new empty manifest is started and the drive's
        blocks are lost. A manifest set aside is renamed *.damaged, never
        deleted.
        """
        try:
            self.open(in_use=in_use)
            return ""
        except MetadataDamage as damage:
            problem = damage
        if not problem.in_current and problem.path.exists():
            self.fs.rename(problem.path, problem.path.with_name(problem.path.name + ".damaged"))
        newest = self._newest_with_records()
        if newest is not None:
            self.number = newest
            temporary = self.directory / (CURRENT + ".tmp")
            self.fs.write_new(temporary, f"{self.path.name}\n".encode())
            self.fs.fsync(temporary)
            self.fs.rename(temporary, self.directory / CURRENT)
            self.fs.fsync_directory(self.directory)
            action = f"CURRENT now names {self.path.name}"
        else:
            numbers = [n for n in map(_manifest_number, self.fs.list(self.directory)) if n is not None]
            self._publish(max(numbers, default=self.number) + 1, self._snapshot_bytes())
            action = f"a new empty manifest {self.path.name} was started (the drive's blocks are lost)"
        self.live.clear()
        self.next_sequence = 1
        self.open()
        return f"{problem.path.name}: {problem.problem}; {action}"

    def _newest_with_records(self) -> int | None:
        """The newest manifest with a complete snapshot, else the newest with any valid record."""
        numbers = sorted((n for n in map(_manifest_number, self.fs.list(self.directory)) if n is not None),
                         reverse=True)
        with_records = []
        for number in numbers:
            try:
                data = self.fs.read(self._path_of(number))
            except OSError:
                continue
            kinds = [kind for kind, _ in decode_frames(data or b"").frames]
            if RecordType.SNAPSHOT_END in kinds:
                return number
            if kinds:
                with_records.append(number)
        return with_records[0] if with_records else None

    def _read(self, path: Path) -> bytes | None:
        try:
            return self.fs.read(path)
        except OSError as error:
            raise MetadataDamage(path, f"cannot be read ({error.strerror or error})") from None

    def _start_new(self, current_path: Path, create: bool, in_use: bool) -> ReplayReport:
        """No CURRENT: a new drive, or one whose first open was cut short
        before it published CURRENT (its manifest is then the empty snapshot
        of a new drive, and nothing else is there yet). Anything else is
        damage, never a new drive: a manifest of blocks, one that is not an
        empty snapshot, one that cannot be read, or a drive in use."""
        blocks = self._blocks_in_newest()
        if blocks:
            raise MetadataDamage(current_path, f"is missing, but {self._newest_name()} holds {blocks} blocks",
                                 blocks)
        if blocks is None or in_use or not self._only_empty_snapshots():
            raise MetadataDamage(current_path, "is missing, but the drive is not new (its manifest or segment "
                                 "files are there)", blocks)
        if not create:
            return ReplayReport()  # nothing written yet; nothing to replay
        for name in self.fs.list(self.directory):
            if _manifest_number(name) is not None:
                self.fs.remove(self.directory / name)  # an empty snapshot an interrupted first open left
        self._publish(1, self._snapshot_bytes())
        return ReplayReport(manifest=self.path.name)

    def _only_empty_snapshots(self) -> bool:
        """Whether every manifest file here is the empty snapshot a new drive starts with."""
        for name in self.fs.list(self.directory):
            if _manifest_number(name) is None:
                continue
            frames = decode_frames(self.fs.read(self.directory / name) or b"").frames
            if [kind for kind, _ in frames] != [RecordType.SNAPSHOT_BEGIN, RecordType.SNAPSHOT_END]:
                return False
            if SNAPSHOT_END.unpack(frames[1][1])[1] != 0:
                return False
        return True

    def _newest_name(self) -> str | None:
        numbers = [number for number in map(_manifest_number, self.fs.list(self.directory)) if number is not None]
        return self._path_of(max(numbers)).name if numbers else None

    def _blocks_in_newest(self) -> int | None:
        """Blocks the newest manifest file describes (for reports of damage
        only, never to serve them); 0 if there is none, None if unreadable."""
        name = self._newest_name()
        if name is None:
            return 0
        try:
            data = self.fs.read(self.directory / name)
        except OSError:
            return None
        live: set[tuple[bytes, bytes]] = set()
        for record_type, payload in decode_frames(data or b"").frames:
            if record_type == RecordType.PUT and (record := PutRecord.decode(payload)) is not None:
                live.add((record.namespace_id, record.key))
            elif record_type == RecordType.REMOVE and (removal := RemoveRecord.decode(payload)) is not None:
                live.discard((removal.namespace_id, removal.key))
        return len(live)

    def _replay(self, scan: FrameScan, report: ReplayReport) -> None:
        """Apply the frames; check the snapshot; count what damage cost.

        A manifest is a snapshot (SNAPSHOT_BEGIN at offset 0, the PUTs of
        every live block, SNAPSHOT_END with their count) followed by edits
        whose sequence numbers run on from the snapshot's one by one. So a
        snapshot short of its count, and gaps in the edits' sequence
        numbers, are records that damage destroyed.
        """
        snapshot_sequence = None
        snapshot_puts = 0
        snapshot_count = None
        edits: list[int] = []  # sequence numbers of the edits after the snapshot
        for position, (record_type, payload) in zip(scan.positions, scan.frames, strict=True):
            report.records += 1
            if record_type in (RecordType.SNAPSHOT_BEGIN, RecordType.SNAPSHOT_END):
                marker = SEQUENCE.unpack_from(payload)[0]
                if record_type == RecordType.SNAPSHOT_BEGIN and position == 0:
                    snapshot_sequence = marker
                elif (record_type == RecordType.SNAPSHOT_END and snapshot_count is None and not edits
                      and marker < _MAX_SEQUENCE):
                    snapshot_sequence = marker if snapshot_sequence is None else snapshot_sequence
                    snapshot_count = SNAPSHOT_END.unpack(payload)[1]
                else:
                    report.malformed_records += 1  # a marker out of place (never written so)
                    continue
                if marker < _MAX_SEQUENCE:
                    self.next_sequence = max(self.next_sequence, marker + 1)
                continue
            record = self._apply_frame(record_type, payload, report)
            if record is None:
                continue
            if snapshot_count is None and isinstance(record, PutRecord) and (
                    snapshot_sequence is None or record.sequence < snapshot_sequence):
                snapshot_puts += 1
            else:
                edits.append(record.sequence)
        report.damaged_regions = len(scan.damaged)
        report.damaged_bytes = scan.damaged_bytes
        report.lost_records = _lost_records(scan, snapshot_sequence, snapshot_count, snapshot_puts, edits)

    def _apply_frame(self, record_type: RecordType, payload: bytes, report: ReplayReport) -> Record | None:
        if record_type == RecordType.PUT:
            record = PutRecord.decode(payload)
            if record is not None:
                self.live[(record.namespace_id, record.key)] = record
        elif record_type == RecordType.REMOVE:
            record = RemoveRecord.decode(payload)
            if record is not None:
                self.live.pop((record.namespace_id, record.key), None)
        else:
            record = None  # a NAMESPACE record has no place in a manifest
        if record is None:
            report.malformed_records += 1
            return None
        self.next_sequence = max(self.next_sequence, record.sequence + 1)
        return record

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

    def sync(self, *, force: bool = False) -> None:
        """Make every appended edit durable (GROUP calls this on a timer).

        Under NONE nothing is synced, unless `force`: a Delete's REMOVE
        records are made durable whatever the policy, because a deleted
        block that comes back after a crash breaks a promise, where a lost
        one only costs a recompute.
        """
        if self.unsynced_bytes and (force or self.policy != FsyncPolicy.NONE):
            self.fs.fsync(self.path)
            self.unsynced_bytes = 0

    def _snapshot_bytes(self) -> bytes:
        sequence = self.sequence()
        parts = [encode_frame(RecordType.SNAPSHOT_BEGIN, SEQUENCE.pack(sequence))]
        parts.extend(record.encode() for record in self.live.values())
        parts.append(encode_frame(RecordType.SNAPSHOT_END, SNAPSHOT_END.pack(sequence, len(self.live))))
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


def _lost_records(scan: FrameScan, snapshot_sequence: int | None, snapshot_count: int | None,
                  snapshot_puts: int, edits: list[int]) -> int:
    """Records damage destroyed, at least: the snapshot's shortfall against
    its count, the gaps in the edits' sequence numbers (which run on one by
    one from the snapshot's), and one for any damaged region neither tells."""
    if not scan.damaged:
        return 0
    lost = 0
    if snapshot_count is not None:
        lost += max(0, snapshot_count - snapshot_puts)
    if snapshot_sequence is not None and edits:
        lost += max(0, (max(edits) - snapshot_sequence) - len(set(edits)))
    return max(lost, len(scan.damaged) if snapshot_count is None else 0, 1)
