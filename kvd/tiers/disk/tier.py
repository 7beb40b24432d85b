"""The disk tier's bytes: segment files on one or more drives.

This module owns everything that touches the drives: IDENTITY, segment
files, O_DIRECT reads and writes through the batched I/O engine (kvd.io),
layer checksums, the per-drive manifests (journal.Manifest) and namespace
registries. Which block sits in which slot, eviction and promotion are the
engine's (kvd.core); this tier only moves the bytes and keeps the records
that let a restart find them again. See FORMAT.md for the layout.

Threading: every method is synchronous and blocks on I/O. A DiskTier is
meant to be owned by ONE dedicated I/O thread of the daemon and called from
that thread only (the native ring refuses concurrent callers); the event
loop hands it work and takes results back. No asyncio here.

The rule everything serves: the tier may lose a block, but it never reports
a wrong one as good.

  * write: checksum each layer from the source memory, write, then append
    the PUT records; the segment files are fdatasynced before the manifest
    is synced (per batch under strict, at the group commit under group,
    under none only when forced: a client waiting for durability, a
    Delete). A block is reported written only if every step succeeded;
    durable once synced (the daemon's commits: kvd.core.durable).
  * read: verify every layer's crc32c against the record before the block
    counts as read; a block with any bad layer is a miss.
  * reuse: a slot's REMOVE is synced before new bytes go into that slot;
  * delete: a client's Delete is synced whatever the policy, and the
    block's first page overwritten (`shred`);
  * damage: a drive whose IDENTITY, CURRENT or live manifest cannot be
    read is quarantined alone (read and written no more, its blocks lost);
    damage inside a manifest costs only the records it hit.
"""

from __future__ import annotations

import collections
import enum
import errno
import logging
import os
import resource
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import numpy as np

from kvd.core.keys import KEY_BYTES, NamespaceSpec
from kvd.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvd.invariants import check
from kvd.io.checksum import crc32c_chunks
from kvd.io.engine import address_of, aligned_empty
from kvd.logbudget import LogBudget
from kvd.tiers.disk.journal import (
    ROOT_PARENT,
    FileSystem,
    FsyncPolicy,
    Manifest,
    MetadataDamage,
    OsFileSystem,
    PutRecord,
    RemoveRecord,
    ReplayReport,
)
from kvd.tiers.disk.layout import (
    ALIGN_BYTES,
    FORMAT_VERSION,
    IDENTITY,
    Admission,
    DiskConfig,
    DiskIdentityError,
    Identity,
    IdentityDamaged,
    drive_of,
    file_index,
    fsync_directory,
    holds_kvd_files,
    identities_for,
    locate,
    locate_many,
    read_identity,
    segment_name,
    split_location,
    valid_location,
    write_identity,
)
from kvd.tiers.disk.registry import NamespaceEntry, NamespaceRegistry, RegistryReport, decode_spec
from kvd.tiers.disk.zeroing import zero_range

log = logging.getLogger(__name__)

# The first bytes of the page `shred` writes over a deleted block (random bytes follow).
TOMBSTONE_MAGIC = b"kvd-deleted-block\0"
# How read_blocks hands progress to its caller: (layer, ok mask of all blocks).
LayerCallback = Callable[[int, np.ndarray], None]
# ... or, for whole blocks: (stop, ok mask of all blocks): blocks [0, stop) are done.
BlocksCallback = Callable[[int, np.ndarray], None]


def _report_layers(on_layer: LayerCallback, first: int, stop: int, ok: np.ndarray, good_through) -> None:
    """on_layer for layers [first, stop): `ok` before the group, with the group's verdicts per
    layer (good_through: (positions read, [blocks, layers] good)) where it was read."""
    for layer in range(first, stop):
        mask = ok.copy()
        if good_through is not None:
            mask[good_through[0]] = good_through[1][:, layer - first]
        on_layer(layer, mask)
WriteItem = tuple[bytes, bytes, int, int]  # key, parent key (b"" for a root), slot, source address
# key, slot, destination address, layer checksums (packed u32le, as in PutRecord)
ReadItem = tuple[bytes, int, int, bytes]
# read_blocks keeps layer groups in flight up to this many bytes (two groups
# at least). With 2 groups a restore of 32 MiB blocks in 1 MiB layers (one
# layer per group) read 1.69 GiB/s here; with up to 8 in flight, 2.68.
READ_AHEAD_BYTES = 256 << 20
READ_AHEAD_GROUPS = 8  # and at most this many (an engine takes 64 batches at a time)
# read_blocks(on_blocks=...) splits the blocks into up to this many batches,
# all submitted at once (the drive sees one deep queue, as for one batch),
# and reports each as it is verified, in order; a block's entries are at
# most this long where its layers allow (a whole number of layers each).
BLOCK_PARTS = 16
BLOCK_ENTRY_MAX_BYTES = 4 << 20


def _entry_layers(layer_bytes: int, num_layers: int) -> int:
    """Layers per entry of a block read in runs: the most that divide num_layers and
    fit BLOCK_ENTRY_MAX_BYTES (one layer if even that does not fit)."""
    fitting = [width for width in range(1, num_layers + 1)
               if num_layers % width == 0 and width * layer_bytes <= BLOCK_ENTRY_MAX_BYTES]
    return max(fitting, default=1)


def _block_results(results: np.ndarray, pieces: int, piece_bytes: int) -> np.ndarray:
    """Per-block results from per-entry ones (`pieces` entries a block): the whole block's
    length if every entry read in full, else the first entry's result that did not."""
    per_block = results.reshape(-1, pieces)
    full = per_block == piece_bytes
    first_bad = per_block[np.arange(per_block.shape[0]), np.argmin(full, axis=1)]
    return np.where(full.all(axis=1), pieces * piece_bytes, first_bad)


# ----------------------------------------------------------------------
# Results


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


@dataclass(slots=True, eq=False)
class _PendingWrite:
    """One chunk of write_chunks whose data writes are at the drive, not yet journalled."""

    namespace_id: bytes
    keys: list[bytes]
    parents: list[bytes]
    slots: np.ndarray
    drives: np.ndarray
    files: np.ndarray
    ok: np.ndarray  # per block: may still be written (cleared on a failure)
    chosen: np.ndarray  # positions submitted
    block_bytes: int
    batch: int = -1  # the engine's batch, -1 when nothing was submitted
    checksums: np.ndarray | None = None  # (blocks, layers) crc32c of the source


class ReadFailure(enum.IntEnum):
    """Why read_blocks said False for a block (its first failure)."""

    NONE = 0
    IO_ERROR = 1  # the engine returned -errno for a layer
    SHORT_READ = 2  # fewer bytes than a layer (e.g. the segment was truncated)
    CHECKSUM = 3  # read in full, but a layer's crc32c differs from its record
    MISSING_SEGMENT = 4  # the segment file was missing at open (read-only tiers)


def _error_kind(result: int, short: str) -> str:
    if result >= 0:
        return short
    return errno.errorcode.get(-result, f"errno_{-result}")


# ----------------------------------------------------------------------
# A read-only file system for inspecting directories without touching them


class ReadOnlyFileSystem:
    """Reads through; turns the repairs replay would make into no-ops.

    Manifest.open truncates a torn tail and removes stale manifests; inspect
    and fsck (without --repair) must look without changing anything.
    """

    def __init__(self) -> None:
        self._os = OsFileSystem()

    def read(self, path: Path) -> bytes | None:
        return self._os.read(path)

    def list(self, directory: Path) -> list[str]:
        return self._os.list(directory)

    def truncate(self, path: Path, size: int) -> None:
        pass

    def fsync(self, path: Path) -> None:
        pass

    def remove(self, path: Path) -> None:
        pass

    def write_new(self, path: Path, data: bytes) -> None:
        check(False, f"read-only disk tier tried to write {path}")

    def append(self, path: Path, data: bytes) -> None:
        check(False, f"read-only disk tier tried to append to {path}")

    def rename(self, source: Path, target: Path) -> None:
        check(False, f"read-only disk tier tried to rename {source}")

    def fsync_directory(self, path: Path) -> None:
        check(False, f"read-only disk tier tried to sync directory {path}")


# ----------------------------------------------------------------------
# The tier


class DiskTier:
    """The byte side of the disk tier; see the module docstring for threading."""

    def __init__(
        self,
        config: DiskConfig,
        *,
        engine: object | None = None,
        fs: FileSystem | None = None,
        read_only: bool = False,
    ) -> None:
        self.config = config
        self.read_only = read_only
        # Manifests and registries go through `fs` (crash tests swap it);
        # segment data always goes through the I/O engine.
        self._fs: FileSystem = ReadOnlyFileSystem() if read_only else (fs or OsFileSystem())
        self._corrupt_log = LogBudget(log, lines=20, per_s=60.0)
        self._engine = engine
        self._owns_engine = engine is None
        self._op_read = 0
        self._op_write = 1
        self.stats = DiskStats()
        self.namespaces: dict[bytes, NamespaceEntry] = {}
        self._manifests: list[Manifest] = []
        self._registries: list[NamespaceRegistry] = []
        self._fds: list[int] = []
        self._file_present = np.ones(config.file_count, dtype=bool)
        self._placeholder_fd = -1
        self._file_sizes = np.zeros(config.file_count, dtype=np.int64)
        # slot -> the record of the live block in it.
        self._owners: dict[int, PutRecord] = {}
        # The page `shred` writes over deleted blocks (4 KiB aligned, for O_DIRECT).
        self._tombstone = aligned_empty(ALIGN_BYTES)
        # Per drive: slots whose REMOVE was appended but not yet synced (GROUP).
        self._unsynced_removals: list[set[int]] = [set() for _ in config.directories]
        # GROUP: segment files written since the drive's last sync; their
        # fdatasync goes with the manifest's, just before it.
        self._unsynced_data: list[set[int]] = [set() for _ in config.directories]
        # Per drive: why it takes no more writes (its manifest could not be
        # appended or synced, so the log's tail is no longer trustworthy).
        self.failed_drives: dict[int, str] = {}
        # Per drive whose metadata cannot be read: why (it is in failed_drives too).
        self.quarantined: dict[int, DriveDamage] = {}
        self._opened = False
        self._closed = False

    # -- admission ------------------------------------------------------

    def accepts(self, spec: NamespaceSpec) -> Admission:
        """Whether blocks of `spec` can go to disk, and if not, why."""
        return self.config.admit(spec.layer_bytes, spec.num_layers)

    # -- open -------------------------------------------------------------

    def open(self) -> DiskRecovery:
        """Validate or create the drives, replay the manifests; reads no block data.

        Raises DiskIdentityError for a directory that belongs to something
        else. Damage that only loses blocks (torn tails, missing or short
        segments) is repaired and counted in the returned DiskRecovery.
        """
        check(not self._opened, "disk tier opened twice")
        self._opened = True
        try:
            return self._open()
        except BaseException:
            self.close()  # release whatever files and engine were opened
            raise

    def _open(self) -> DiskRecovery:
        recovery = DiskRecovery()
        fresh = self._open_identities(recovery)
        self._open_registries(recovery)
        self._inspect_segments(recovery, fresh)
        for drive, directory in enumerate(self.config.directories):
            manifest = Manifest(directory, self.config.fsync_policy, self._fs)
            report = ReplayReport()
            if drive not in self.quarantined:
                try:
                    report = manifest.open(create=not self.read_only, in_use=self._has_segments(drive))
                except MetadataDamage as damage:
                    manifest = Manifest(directory, self.config.fsync_policy, self._fs)  # nothing replayed
                    self._quarantine(drive, damage.path, damage.problem, damage.blocks)
            self._manifests.append(manifest)
            recovery.manifests.append(report)
            recovery.records += report.records
            recovery.truncated_bytes += report.truncated_bytes
            recovery.damaged_bytes += report.damaged_bytes
            recovery.lost_records += report.lost_records
        self._keep_valid_records(recovery)
        if not self.read_only:
            self._complete_registries(recovery)
            self._complete_segments(recovery)
        self._open_files()
        self._start_engine()
        if not self.read_only:
            self._sync_found()
        recovery.quarantined = dict(self.quarantined)
        log.info(
            "disk tier open",
            extra={
                "drives": self.config.drive_count,
                "quarantined_drives": len(self.quarantined),
                "blocks": recovery.block_count,
                "dropped": recovery.dropped.total,
                "truncated_bytes": recovery.truncated_bytes,
                "damaged_bytes": recovery.damaged_bytes,
                "lost_records": recovery.lost_records,
            },
        )
        return recovery

    def _sync_found(self) -> None:
        """Sync every segment and manifest found: a previous run that was killed
        may have left writes in the page cache, and what this run serves as
        durable must be."""
        per_drive = self.config.segments_per_drive
        for drive in range(len(self._manifests)):
            if drive in self.failed_drives:
                continue
            first = file_index(self.config, drive, 0)
            self._unsynced_data[drive].update(
                index for index in range(first, first + per_drive) if self._file_sizes[index] >= 0)
            self._sync_drive(drive, force=True)  # (a replayed manifest counts as unsynced)

    def _quarantine(self, drive: int, path: Path, problem: str, blocks: int | None) -> None:
        """Take a drive whose metadata cannot be read out of service: nothing
        of it is read or written (its files stay as they are, for `kvd fsck
        --repair`), its blocks are lost. The other drives go on."""
        if blocks is None:
            blocks = self._blocks_described(drive)
        damage = DriveDamage(drive, Path(path), problem, blocks)
        self.quarantined[drive] = damage
        self.failed_drives[drive] = f"quarantined: {path}: {problem}"
        log.error(
            f"disk drive {drive} quarantined: {path}: {problem}; its blocks "
            f"({'an unknown number' if blocks is None else blocks}) are lost until `kvd fsck --repair`",
            extra={"drive": drive, "directory": str(self.config.directories[drive]), "file": str(path),
                   "problem": problem, "blocks_lost": -1 if blocks is None else blocks},
        )

    def _blocks_described(self, drive: int) -> int | None:
        """How many blocks the drive's manifest holds, where it can still be
        read (a drive quarantined for its IDENTITY, say); for reports only."""
        manifest = Manifest(self.config.directories[drive], FsyncPolicy.NONE, ReadOnlyFileSystem())
        try:
            manifest.open(create=False)
        except (MetadataDamage, OSError):
            return None
        return len(manifest.live)

    def _open_identities(self, recovery: DiskRecovery) -> set[int]:
        found: list[Identity | None] = []
        for drive, directory in enumerate(self.config.directories):
            self._check_directory(directory)
            try:
                identity = read_identity(directory)
            except IdentityDamaged as damage:
                self._quarantine(drive, damage.path, damage.problem, None)
                identity = None
            if identity is None and drive not in self.quarantined:
                if holds_kvd_files(directory):
                    self._quarantine(drive, directory / IDENTITY, "is missing, but the directory holds kvd's "
                                     "manifest or segment files", None)
                elif self.read_only:
                    raise DiskIdentityError(directory, "magic", "missing: not a kvd disk directory")
            found.append(identity)
        expected, missing = identities_for(self.config, found, set(self.quarantined))
        for drive in missing:
            (self.config.directories[drive] / (IDENTITY + ".tmp")).unlink(missing_ok=True)
            write_identity(self.config.directories[drive], expected[drive])
            recovery.created_drives.append(drive)
        if not self.read_only:
            self._migrate(found, recovery)
        return set(missing)

    def _migrate(self, found: list[Identity | None], recovery: DiskRecovery) -> None:
        """Rewrite the IDENTITY of drives of an older format: every version
        this kvd reads is a subset of the one it writes (FORMAT.md), so the
        drive's files stay as they are."""
        for drive, identity in enumerate(found):
            if identity is None or drive in self.quarantined or identity.format_version == FORMAT_VERSION:
                continue
            directory = self.config.directories[drive]
            write_identity(directory, identity.migrated)
            recovery.migrated_drives.append(drive)
            log.warning("disk directory migrated to a newer format; a kvd older than this one can no longer "
                        "open it", extra={"directory": str(directory), "from_version": identity.format_version,
                                          "to_version": FORMAT_VERSION})

    def _check_directory(self, directory: Path) -> None:
        """The drive directory exists, or is created; its parent never is."""
        if self.read_only:
            if not directory.is_dir():
                raise DiskIdentityError(directory, "magic", "no such directory", file="")
            return
        if directory.exists() and not directory.is_dir():
            raise DiskIdentityError(directory, "disk.directories", "is not a directory", file="")
        try:
            # No parents: a missing mount point must fail, not become a
            # directory on the root file system.
            directory.mkdir(exist_ok=True)
        except FileNotFoundError:
            raise DiskIdentityError(directory, "disk.directories", f"its parent {directory.parent} does not exist "
                                    "(a drive not mounted?); kvd creates a drive directory, never its parents",
                                    file="") from None
        except OSError as error:
            raise DiskIdentityError(directory, "disk.directories", f"cannot be created: {error.strerror}",
                                    file="") from None
        if not directory.is_dir():
            raise DiskIdentityError(directory, "disk.directories", "is not a directory", file="")

    def _open_registries(self, recovery: DiskRecovery) -> None:
        for drive, directory in enumerate(self.config.directories):
            registry = NamespaceRegistry(directory, self._fs, read_only=self.read_only or drive in self.quarantined)
            report = RegistryReport()
            if drive not in self.quarantined:
                try:
                    report = registry.open()
                except OSError as error:
                    self._quarantine(drive, registry.path, f"cannot be read ({error.strerror or error})", None)
            recovery.registries.append(report)
            recovery.truncated_bytes += report.truncated_bytes
            recovery.damaged_bytes += report.damaged_bytes
            self._registries.append(registry)
            for namespace_id, entry in registry.entries.items():
                known = self.namespaces.setdefault(namespace_id, entry)
                if known.encoding != entry.encoding:
                    raise DiskIdentityError(
                        directory, "namespace_id", f"{namespace_id.hex()[:16]} differs from another drive's", file="NAMESPACES"
                    )
        recovery.namespaces = dict(self.namespaces)

    def _complete_registries(self, recovery: DiskRecovery) -> None:
        """A crash inside register_namespace (or damage to one drive's file)
        can leave some drives without an entry the others have; complete
        them so every drive is whole (quarantined ones are not touched)."""
        for drive, registry in enumerate(self._registries):
            if drive in self.quarantined:
                continue
            if recovery.registries[drive].damaged_regions:
                registry.rewrite()  # without the damage, which a later open would meet again
            for entry in self.namespaces.values():
                registry.add(entry)

    def _has_segments(self, drive: int) -> bool:
        """Whether any segment file of the drive is there (created only after CURRENT was)."""
        first = file_index(self.config, drive, 0)
        return bool((self._file_sizes[first:first + self.config.segments_per_drive] >= 0).any())

    def _segment_path(self, drive: int, segment: int) -> Path:
        return self.config.directories[drive] / segment_name(segment)

    def _inspect_segments(self, recovery: DiskRecovery, fresh: set[int]) -> None:
        for drive in range(self.config.drive_count):
            for segment in range(self.config.segments_per_drive):
                if drive in self.quarantined:
                    self._file_sizes[file_index(self.config, drive, segment)] = -1  # never opened
                    continue
                path = self._segment_path(drive, segment)
                index = file_index(self.config, drive, segment)
                try:
                    size = path.stat().st_size
                except FileNotFoundError:
                    size = -1
                    if drive not in fresh:
                        recovery.missing_segments.append(path)
                else:
                    if size < self.config.segment_bytes:
                        recovery.short_segments.append(path)
                self._file_sizes[index] = size

    def _keep_valid_records(self, recovery: DiskRecovery) -> None:
        """Drop (and count) every live record that cannot be read back right."""
        dropped = recovery.dropped
        for drive, manifest in enumerate(self._manifests):
            doomed: list[tuple[bytes, bytes]] = []
            for record in manifest.live.values():
                reason = self._record_problem(drive, record)
                if reason is not None:
                    setattr(dropped, reason, getattr(dropped, reason) + 1)
                    doomed.append((record.namespace_id, record.key))
                    continue
                slot = record.location
                older = self._owners.get(slot)
                if older is not None:
                    # Two live records claim one slot: only the newer one's
                    # bytes can be there. (Never after a correct REMOVE.)
                    dropped.duplicate_slot += 1
                    if older.sequence > record.sequence:
                        doomed.append((record.namespace_id, record.key))
                        continue
                    doomed.append((older.namespace_id, older.key))
                self._owners[slot] = record
            for identity in doomed:
                manifest.live.pop(identity, None)
            for record in self._overlapping(manifest.live.values()):
                dropped.duplicate_slot += 1
                doomed.append((record.namespace_id, record.key))
                manifest.live.pop((record.namespace_id, record.key))
                del self._owners[record.location]
            if (doomed or recovery.manifests[drive].damaged) and not self.read_only:
                # A snapshot without them, durable before any of their slots
                # (or a re-created segment) can take new bytes; and without
                # the damage, which a later replay would otherwise meet again.
                manifest.compact()
        for manifest in self._manifests:
            for record in manifest.live.values():
                recovery.blocks.setdefault(record.namespace_id, []).append(record)
        check(len(self._owners) == recovery.block_count, "a kept record lost its slot")

    @staticmethod
    def _overlapping(records: Iterable[PutRecord]) -> list[PutRecord]:
        """Records in a page whose bytes a newer record of another slot size
        class overlaps: a page holds slots of one class at a time, and its
        old class's REMOVEs were durable before the new class wrote there.
        (Never after a correct REMOVE.)"""
        classes: dict[int, dict[int, int]] = {}  # page -> class -> newest sequence
        for record in records:
            page, class_index, _ = split_location(record.location)
            newest = classes.setdefault(page, {})
            newest[class_index] = max(newest.get(class_index, -1), record.sequence)
        keep = {page: max(newest, key=newest.__getitem__) for page, newest in classes.items() if len(newest) > 1}
        if not keep:
            return []
        return [record for record in records
                if (page := split_location(record.location)[0]) in keep
                and split_location(record.location)[1] != keep[page]]

    def _record_problem(self, drive: int, record: PutRecord) -> str | None:
        config = self.config
        slot = record.location
        if not valid_location(config, slot) or drive_of(config, slot) != drive:
            return "out_of_range"
        entry = self.namespaces.get(record.namespace_id)
        if entry is None:
            return "unknown_namespace"
        layers = record.layer_count
        if entry.spec is not None:
            if layers != entry.spec.num_layers or not config.admit(entry.spec.layer_bytes, layers):
                return "malformed"
            extent_bytes = layers * entry.spec.layer_bytes
        slot_bytes = config.slot_bytes >> split_location(slot)[1]
        if entry.spec is None:
            extent_bytes = slot_bytes  # shape unknown: the whole slot must be there
        elif extent_bytes > slot_bytes:
            return "malformed"  # a block larger than the slot of the class its record names
        place = locate(config, slot)
        if int(self._file_sizes[place.file_index]) < place.offset + extent_bytes:
            return "missing_segment"
        return None

    def _complete_segments(self, recovery: DiskRecovery) -> None:
        """Create missing segments and extend short ones to full length."""
        for drive in range(self.config.drive_count):
            if drive in self.quarantined:
                continue  # left exactly as it is, for fsck --repair
            created = False
            for segment in range(self.config.segments_per_drive):
                index = file_index(self.config, drive, segment)
                if self._file_sizes[index] >= self.config.segment_bytes:
                    continue
                path = self._segment_path(drive, segment)
                self._preallocate(drive, segment, path, max(0, int(self._file_sizes[index])))
                created = created or self._file_sizes[index] < 0
                self._file_sizes[index] = self.config.segment_bytes
            if created:
                fsync_directory(self.config.directories[drive])

    def _preallocate(self, drive: int, segment: int, path: Path, old_size: int) -> None:
        """A segment file at full length; with disk.zero_segments, the bytes past its old size
        written with zeros (what was there before is never touched)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.posix_fallocate(fd, 0, self.config.segment_bytes)
            os.fsync(fd)
            if self.config.zero_segments:
                log.info("zeroing %s from %d to %d bytes (disk.zero_segments; segment %d of %d on drive %d)",
                         path, old_size, self.config.segment_bytes, segment + 1, self.config.segments_per_drive,
                         drive)
                zero_range(path, -(-old_size // ALIGN_BYTES) * ALIGN_BYTES, self.config.segment_bytes)
        except OSError as error:
            raise ResourceExhausted(
                f"disk directory {self.config.directories[drive]}: cannot preallocate {path.name} "
                f"({self.config.segment_bytes} bytes; disk.capacity_bytes is per drive): {error}"
            ) from None
        finally:
            os.close(fd)

    def _open_files(self) -> None:
        needed = self.config.file_count + 64
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft < needed:
            if hard != resource.RLIM_INFINITY and hard < needed:
                raise FailedPrecondition(
                    f"the disk tier needs {self.config.file_count} open segment files but RLIMIT_NOFILE is {hard}; "
                    "raise the limit or disk.segment_bytes"
                )
            resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        flags = (os.O_RDONLY if self.read_only else os.O_RDWR) | os.O_DIRECT | os.O_CLOEXEC
        placeholder = -1
        for drive in range(self.config.drive_count):
            for segment in range(self.config.segments_per_drive):
                index = file_index(self.config, drive, segment)
                if self._file_sizes[index] < 0:
                    # Missing (read-only open) or on a quarantined drive: no
                    # kept record points here and reads of it are refused
                    # before submission, but the engine's file table needs a
                    # descriptor in every place.
                    if placeholder < 0:
                        placeholder = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                        self._placeholder_fd = placeholder
                    self._fds.append(placeholder)
                    self._file_present[index] = False
                    continue
                path = self._segment_path(drive, segment)
                try:
                    self._fds.append(os.open(path, flags))
                except OSError as error:
                    if error.errno == errno.EINVAL:
                        raise FailedPrecondition(
                            f"disk directory {self.config.directories[drive]}: its file system does not support O_DIRECT"
                        ) from None
                    raise

    def _start_engine(self) -> None:
        from kvd.io.engine import Op, open_engine

        self._op_read, self._op_write = Op.READ, Op.WRITE
        if self._engine is None:
            self._engine = open_engine(kind=self.config.io_engine, queue_depth=self.config.queue_depth)
        self._engine.register_files(np.array(self._fds, dtype=np.int32))

    # -- namespaces -------------------------------------------------------

    def register_namespace(self, namespace_id: bytes, spec_encoding: bytes) -> NamespaceEntry:
        """Record a namespace on every drive; durable when this returns.

        Idempotent. InvalidArgument if the encoding is not a spec whose
        digest is `namespace_id`.
        """
        self._check_writable()
        try:
            spec = decode_spec(spec_encoding)
        except InvalidArgument as error:
            raise InvalidArgument(f"cannot register namespace {namespace_id.hex()[:16]}: {error.message}") from None
        if spec.namespace_id() != namespace_id:
            raise InvalidArgument(f"namespace {namespace_id.hex()[:16]} is not the digest of the spec given")
        entry = NamespaceEntry(namespace_id, spec_encoding, spec)
        known = self.namespaces.get(namespace_id)
        if known is not None:
            if known.encoding != spec_encoding:
                raise InvalidArgument(f"namespace {namespace_id.hex()[:16]} is on disk with another spec encoding")
            return known
        for drive, registry in enumerate(self._registries):
            if drive not in self.quarantined:  # untouched until fsck --repair; it completes them at reopen
                registry.add(entry)
        self.namespaces[namespace_id] = entry
        return entry

    def _spec_for(self, namespace_id: bytes, layer_bytes: int, num_layers: int) -> None:
        entry = self.namespaces.get(namespace_id)
        check(entry is not None, f"namespace {namespace_id.hex()[:16]} used before register_namespace")
        check(
            entry.spec is not None
            and entry.spec.layer_bytes == layer_bytes
            and entry.spec.num_layers == num_layers,
            "layer shape differs from the registered namespace",
        )
        admission = self.config.admit(layer_bytes, num_layers)
        check(admission.accepted, admission.reason)

    # -- write ------------------------------------------------------------

    def write_blocks(
        self, namespace_id: bytes, layer_bytes: int, num_layers: int, items: Sequence[WriteItem]
    ) -> list[bool]:
        """Write blocks into their slots and journal them; per-item durable.

        items: (key, parent key or b"" for a root, slot, source address of
        the block, layer-major, 4 KiB aligned). A slot must be free: never
        written, or its block removed. Failures (EIO, ENOSPC, short writes,
        a failed fdatasync or manifest append) are False, never exceptions.
        """
        done = self.write_chunks(namespace_id, layer_bytes, num_layers, [items] if items else [])
        return done[0] if done else []

    def write_chunks(
        self, namespace_id: bytes, layer_bytes: int, num_layers: int, chunks: Sequence[Sequence[WriteItem]],
        stop: Callable[[], bool] | None = None,
    ) -> list[list[bool]]:
        """write_blocks of each chunk in turn, pipelined: chunk k+1 is at the drive while chunk k
        is finished (synced as the policy says, journalled), so the drive never drains between
        chunks. Before each chunk after the first, `stop()` (if given) may end the run: the
        chunks not started are not written. Returns one ok list per chunk written, in order."""
        self._check_writable()
        self._spec_for(namespace_id, layer_bytes, num_layers)
        done: list[list[bool]] = []
        pending: _PendingWrite | None = None
        try:
            for chunk in chunks:
                if pending is not None and stop is not None and stop():
                    break
                # The newest chunk is `pending` before the one behind it is finished, so that
                # should finishing fail, the newest is still waited for below.
                previous, pending = pending, self._start_write(namespace_id, layer_bytes, num_layers, chunk)
                if previous is not None:
                    done.append(self._finish_write(previous))
        finally:
            if pending is not None:  # (also on an error: never leave a batch reading its source behind)
                done.append(self._finish_write(pending))
        return done

    def _start_write(self, namespace_id: bytes, layer_bytes: int, num_layers: int,
                     items: Sequence[WriteItem]) -> _PendingWrite:
        """Check one chunk, and submit its data writes (the checksums computed meanwhile)."""
        count = len(items)
        keys = [item[0] for item in items]
        parents = [item[1] or ROOT_PARENT for item in items]
        slots = np.fromiter((item[2] for item in items), dtype=np.int64, count=count)
        sources = np.fromiter((item[3] for item in items), dtype=np.uint64, count=count)
        check(count > 0, "a write chunk without blocks")
        check(all(len(key) == KEY_BYTES for key in keys), "block keys are 32 bytes")
        check(all(len(parent) == KEY_BYTES for parent in parents), "parent keys are 32 bytes (or b'' for a root)")
        check(len(np.unique(slots)) == count, "a slot appears twice in one write")
        check(not np.any(sources % ALIGN_BYTES), "source addresses must be 4 KiB aligned for O_DIRECT")
        check(all(int(slot) not in self._owners for slot in slots), "writing into a slot whose block was not removed")
        drives, files, offsets = locate_many(self.config, slots)
        ok = self._sync_reused_slots(drives, slots)
        block_bytes = layer_bytes * num_layers
        pending = _PendingWrite(namespace_id, keys, parents, slots, drives, files, ok, np.nonzero(ok)[0], block_bytes)
        if pending.chosen.size:  # (a block's layers are contiguous in the slot and in the source)
            pending.batch = self._submit(self._op_write, files[pending.chosen], offsets[pending.chosen], block_bytes,
                                         sources[pending.chosen])
        try:
            # Computed from the source while the drive writes it (one native call, the GIL
            # released): the drive and the checksum read the same pinned bytes. Should the
            # source change under us anyway, the record disagrees with the disk and the block
            # reads back as corrupt (a miss), never as wrong bytes.
            pending.checksums = crc32c_chunks(sources, layer_bytes, num_layers)
        except BaseException:
            if pending.batch >= 0:
                self._engine.wait(pending.batch)
            raise
        return pending

    def _finish_write(self, pending: _PendingWrite) -> list[bool]:
        """Wait for a chunk's data, clear `ok` where a write fell short, sync, journal it."""
        ok = pending.ok
        if pending.batch >= 0:
            results = self._engine.wait(pending.batch)
            for position, result in zip(pending.chosen.tolist(), results.tolist(), strict=True):
                if result == pending.block_bytes:
                    self.stats.bytes_written += pending.block_bytes
                else:
                    ok[position] = False
                    self.stats.count_error(_error_kind(result, "short_write"))
        self._sync_data(ok, pending.drives, pending.files)
        for drive in np.unique(pending.drives[ok]).tolist():
            members = np.nonzero(ok & (pending.drives == drive))[0].tolist()
            manifest = self._manifests[drive]
            records = [
                PutRecord(manifest.sequence(), pending.namespace_id, pending.keys[i], pending.parents[i],
                          int(pending.slots[i]), pending.checksums[i].astype("<u4").tobytes())
                for i in members
            ]
            if self._append(drive, records):
                for record in records:
                    self._owners[record.location] = record
            else:
                ok[members] = False
        written = int(ok.sum())
        self.stats.blocks_written += written
        self.stats.write_failures += len(ok) - written
        return ok.tolist()

    def _sync_data(self, ok: np.ndarray, drives: np.ndarray, files: np.ndarray) -> None:
        """Make the written data durable as the policy says, before its records are.

        STRICT: fdatasync every segment file written, now (a failure clears
        `ok` for its blocks). GROUP: the files wait for the drive's next
        sync, which flushes them before the manifest. NONE: at the next forced
        sync only (a client waiting for durability, a Delete); a record that
        outlives its data after a power loss reads back as a checksum
        failure, a miss, never wrong bytes.
        """
        if self.config.fsync_policy != FsyncPolicy.STRICT:
            for drive, index in set(zip(drives[ok].tolist(), files[ok].tolist())):
                self._unsynced_data[drive].add(index)
            return
        for index in np.unique(files[ok]).tolist():
            result = self._fdatasync(index)
            if result != 0:
                ok[files == index] = False
                self.stats.count_error("fsync_" + _error_kind(result, "fsync"))

    def _sync_reused_slots(self, drives: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Which items may be written: their drive takes writes, and the REMOVE
        of each reused slot's previous block is durable first (FORMAT.md, write order)."""
        ok = np.array([int(drive) not in self.failed_drives for drive in drives], dtype=bool)
        if not ok.all():
            self.stats.count_error("drive_failed", int((~ok).sum()))
        for drive in np.unique(drives[ok]).tolist():
            pending = self._unsynced_removals[drive]
            if pending and not pending.isdisjoint(slots[drives == drive].tolist()):
                self._sync_drive(drive)
                ok &= np.array([int(d) not in self.failed_drives for d in drives], dtype=bool)
        return ok

    def _transfer(
        self, op: int, files: np.ndarray, offsets: np.ndarray, length: int, addresses: np.ndarray
    ) -> np.ndarray:
        """One batch through the engine; waited before returning."""
        batch = self._submit(op, files, offsets, length, addresses)
        return self._engine.wait(batch)

    def _submit(self, op: int, files: np.ndarray, offsets: np.ndarray, length: int, addresses: np.ndarray,
                **checksums: object) -> int:
        count = len(files)
        self.stats.submissions += 1
        return self._engine.submit(
            op,
            np.ascontiguousarray(files, dtype=np.int32),
            np.ascontiguousarray(offsets, dtype=np.int64),
            np.full(count, length, dtype=np.uint32),
            np.ascontiguousarray(addresses, dtype=np.uint64),
            **checksums,
        )

    def _fdatasync(self, index: int) -> int:
        self.stats.fsyncs += 1
        try:
            self._engine.fsync(index, datasync=True)
        except OSError as error:
            return -(error.errno or errno.EIO)
        return 0

    def _append(self, drive: int, records: Sequence[PutRecord | RemoveRecord]) -> bool:
        """Append to a drive's manifest; on failure take the drive out of writes.

        After a failed append the file may end in a partial frame, and a
        failed fsync may have lost pages: anything appended after that could
        be cut off at replay. So the drive takes no more writes until the
        daemon reopens the tier (replay then repairs the tail).
        """
        manifest = self._manifests[drive]
        # A failed append leaves the manifest's live map and file as they
        # were (Manifest.append cuts a partial frame back off).
        try:
            manifest.append(records)
        except OSError as error:
            self._fail_drive(drive, f"manifest append failed: {error}")
            return False
        return True

    def _fail_drive(self, drive: int, reason: str) -> None:
        if drive not in self.failed_drives:
            log.error("disk drive taken out of writes", extra={"drive": drive, "reason": reason})
            self.failed_drives[drive] = reason
        self.stats.count_error("manifest")

    # -- read -------------------------------------------------------------

    def read_blocks(
        self,
        namespace_id: bytes,
        layer_bytes: int,
        num_layers: int,
        items: Sequence[ReadItem],
        on_layer: LayerCallback | None = None,
        *,
        failures: np.ndarray | None = None,
        between_groups: Callable[[int, int], None] | None = None,
        whole_blocks: bool = False,
        on_blocks: BlocksCallback | None = None,
    ) -> np.ndarray:
        """Read blocks in layer order, verifying each layer; per-block ok mask.

        items: (key, slot, destination address, the layer checksums of its
        record). Layers are read in groups: one extent of `width` layers per
        block (about config.read_extent_bytes), ONE batch of N extents per
        group, so O(L) submissions at most. Later groups are in flight
        while this one is checked; the engine computes every layer's crc32c
        as it is reaped, and this method compares whole arrays.
        whole_blocks: one group of every layer instead, each block one
        extent, for a caller that uses no layer before all have landed:
        blocks in consecutive slots then reach the drive as requests as
        large as it takes (fine layers make small extents otherwise).
        on_layer(layer, ok) is called, in layer order, once layer `layer` of
        every block is verified; ok[i] is True while block i's layers
        0..layer are good.
        A False block's destination holds garbage; never use it.
        failures, if given (int8, one per item), receives each block's
        ReadFailure code (fsck tells corrupt blocks from unreadable ones).
        between_groups(first, stop), if given, is called on this thread
        after layers [first, stop) are verified and before the next group
        is waited for, with later groups in flight: the caller may run
        other I/O there (writes in the layers' slack) on the same engine.
        on_blocks(stop, ok), whole blocks only, is called as leading runs of
        blocks are verified: blocks [0, stop) are done, ok says which of
        them are good; the last call has stop == len(items).
        """
        check(on_blocks is None or (whole_blocks and on_layer is None and between_groups is None),
              "on_blocks reports whole blocks, read in one group with nothing between groups")
        self._check_open()
        self._spec_for(namespace_id, layer_bytes, num_layers)
        count = len(items)
        ok = np.ones(count, dtype=bool)
        reasons = np.zeros(count, dtype=np.int8) if failures is None else failures
        check(reasons.shape == (count,) and reasons.dtype == np.int8, "failures must be int8, one per item")
        reasons[:] = ReadFailure.NONE
        if count == 0:
            return ok
        files, offsets, destinations, expected = self._read_targets(namespace_id, num_layers, items, ok, reasons)
        if on_blocks is not None:
            self._read_block_parts(layer_bytes, num_layers, files, offsets, destinations, expected, ok, reasons,
                                   on_blocks)
        else:
            width = num_layers if whole_blocks else self.config.read_extent_bytes // layer_bytes
            self._read_layer_groups(layer_bytes, num_layers, max(1, min(num_layers, width)), files, offsets,
                                    destinations, expected, ok, reasons, on_layer, between_groups)
        good = int(ok.sum())
        self.stats.blocks_read += good
        self.stats.read_failures += count - good
        if good < count:
            self._report_corrupt(namespace_id, items, reasons)
        return ok

    def _report_corrupt(self, namespace_id: bytes, items: Sequence[ReadItem], reasons: np.ndarray) -> None:
        """Count the blocks that failed their checksum, per namespace, and log each (drive,
        slot, namespace, key) within the log budget: damage is never silent."""
        corrupt = np.nonzero(reasons == ReadFailure.CHECKSUM)[0].tolist()
        if not corrupt:
            return
        counts = self.stats.corrupt_blocks
        counts[namespace_id] = counts.get(namespace_id, 0) + len(corrupt)
        for position in corrupt:
            key, slot = items[position][0], items[position][1]
            self._corrupt_log.warning(
                "disk block failed its checksum: lost (recomputed by whoever wanted it)",
                extra={"drive": drive_of(self.config, slot), "slot": slot, "namespace": namespace_id.hex()[:16],
                       "key": key.hex()[:16]})

    def _read_targets(self, namespace_id: bytes, num_layers: int, items: Sequence[ReadItem], ok: np.ndarray,
                      reasons: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Where each block is (file, offset), where it goes, its expected layer checksums;
        blocks whose segment is missing are failed in `ok` and `reasons`."""
        count = len(items)
        slots = np.fromiter((item[1] for item in items), dtype=np.int64, count=count)
        destinations = np.fromiter((item[2] for item in items), dtype=np.uint64, count=count)
        check(all(len(item[3]) == 4 * num_layers for item in items), "every read item needs one checksum per layer")
        expected = np.frombuffer(b"".join(item[3] for item in items), dtype="<u4").reshape(count, num_layers)
        check(not np.any(destinations % ALIGN_BYTES), "destination addresses must be 4 KiB aligned for O_DIRECT")
        check(all(self._holds(item[1], namespace_id, item[0]) for item in items),
              "reading a slot that does not hold the block asked for")
        _, files, offsets = locate_many(self.config, slots)
        # A segment missing at a read-only open: its blocks were dropped, but
        # a caller may still ask (fsck of an explicit slot list).
        present = self._file_present[files]
        if not present.all():
            ok &= present
            reasons[~present] = ReadFailure.MISSING_SEGMENT
            self.stats.count_error("missing_segment", int((~present).sum()))
        return files, offsets, destinations, expected

    def _read_layer_groups(self, layer_bytes: int, num_layers: int, width: int, files: np.ndarray,
                           offsets: np.ndarray, destinations: np.ndarray, expected: np.ndarray, ok: np.ndarray,
                           reasons: np.ndarray, on_layer: LayerCallback | None, between_groups=None) -> None:
        """Each block in extents of `width` whole layers: one batch per group
        of layers, every block in it, so O(L / width) submissions. Later
        groups are in flight while this one is checked: two at least, more
        (up to READ_AHEAD_GROUPS) while they hold at most READ_AHEAD_BYTES."""
        check(1 <= width <= num_layers, "a read extent of {} layers of {}", width, num_layers)
        groups = [(first, min(first + width, num_layers)) for first in range(0, num_layers, width)]
        # (group, batch id, positions, checksum cells, bytes) in order.
        flights: collections.deque[tuple[int, int, np.ndarray, np.ndarray, int]] = collections.deque()
        submitted = 0  # groups submitted (or skipped: no block left to read)

        def submit(group: int) -> None:
            chosen = np.nonzero(ok)[0]  # blocks already failed are not read further
            if chosen.size == 0:
                return
            first, stop = groups[group]
            shift = first * layer_bytes
            # The engine checksums every layer as it lands (the GIL released,
            # the drive kept busy meanwhile); this thread only compares.
            cells = np.empty(chosen.size * (stop - first), dtype=np.uint32)
            batch = self._submit(
                self._op_read, files[chosen], offsets[chosen] + shift, (stop - first) * layer_bytes,
                destinations[chosen] + np.uint64(shift), checksums=cells, checksum_chunk=layer_bytes,
            )
            flights.append((group, batch, chosen, cells, chosen.size * (stop - first) * layer_bytes))

        def top_up() -> None:
            nonlocal submitted
            while submitted < len(groups):
                first, stop = groups[submitted]
                in_flight = sum(flight[4] for flight in flights)
                if len(flights) >= 2 and (len(flights) >= READ_AHEAD_GROUPS or
                                          in_flight + len(files) * (stop - first) * layer_bytes > READ_AHEAD_BYTES):
                    return
                submit(submitted)
                submitted += 1

        try:
            for group, (first, stop) in enumerate(groups):
                top_up()  # the drive works on the next groups while this one is checked
                good_through = None
                if flights and flights[0][0] == group:
                    _, batch, chosen, cells, _ = flights.popleft()
                    results = self._engine.wait(batch)
                    good_through = self._verify_group(
                        first, stop, layer_bytes, chosen, results, cells, expected, ok, reasons
                    )
                if on_layer is not None:
                    _report_layers(on_layer, first, stop, ok, good_through)
                if good_through is not None:
                    chosen, good = good_through
                    ok[chosen] = good[:, -1]
                if between_groups is not None and stop < num_layers:
                    top_up()  # the next groups go to the drive before anything else does
                    between_groups(first, stop)
        finally:
            # Never return while the kernel may still write into the caller's memory.
            while flights:
                self._engine.wait(flights.popleft()[1])

    def _read_block_parts(self, layer_bytes: int, num_layers: int, files: np.ndarray, offsets: np.ndarray,
                          destinations: np.ndarray, expected: np.ndarray, ok: np.ndarray, reasons: np.ndarray,
                          on_blocks: BlocksCallback) -> None:
        """Whole blocks in up to BLOCK_PARTS consecutive runs, one batch each,
        all submitted at once; on_blocks after each run is verified, in order.

        A block larger than BLOCK_ENTRY_MAX_BYTES goes as several entries of
        whole layers, in block order. The engine's ring then admits entries
        in that order as earlier ones complete, so the first runs land
        first; a few huge entries would all be in flight from the start and
        land together, at the end."""
        count = len(files)
        bounds = np.linspace(0, count, min(BLOCK_PARTS, count) + 1).astype(np.int64).tolist()
        width = _entry_layers(layer_bytes, num_layers)
        pieces = num_layers // width
        shifts = np.arange(pieces, dtype=np.int64) * (width * layer_bytes)
        # (stop, batch id or -1 when nothing was read, positions, checksum cells) in order.
        flights: collections.deque[tuple[int, int, np.ndarray, np.ndarray]] = collections.deque()
        try:
            for start, stop in zip(bounds[:-1], bounds[1:]):
                chosen = start + np.nonzero(ok[start:stop])[0]  # a missing segment is not read
                cells = np.empty(chosen.size * num_layers, dtype=np.uint32)
                batch = -1 if chosen.size == 0 else self._submit(
                    self._op_read, np.repeat(files[chosen], pieces), (offsets[chosen, None] + shifts).ravel(),
                    width * layer_bytes, (destinations[chosen, None] + shifts.astype(np.uint64)).ravel(),
                    checksums=cells, checksum_chunk=layer_bytes)
                flights.append((stop, batch, chosen, cells))
            while flights:
                stop, batch, chosen, cells = flights[0]
                if batch >= 0:
                    results = _block_results(np.asarray(self._engine.wait(batch)), pieces, width * layer_bytes)
                    _, good = self._verify_group(0, num_layers, layer_bytes, chosen, results, cells, expected, ok,
                                                 reasons)
                    ok[chosen] = good[:, -1]
                flights.popleft()
                on_blocks(stop, ok.copy())
        finally:
            # Never return while the kernel may still write into the caller's memory.
            for flight in flights:
                if flight[1] >= 0:
                    self._engine.wait(flight[1])

    def _verify_group(
        self,
        first: int,
        stop: int,
        layer_bytes: int,
        chosen: np.ndarray,
        results: np.ndarray,
        cells: np.ndarray,
        expected: np.ndarray,
        ok: np.ndarray,
        reasons: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Check layers first..stop-1 of the chosen blocks, without a Python loop over them.

        Returns (chosen, good) where good[k, j] says block chosen[k] is good
        through layer first + j; records why a block failed, and counts.
        `ok` itself is left for the caller to update after on_layer.
        """
        extent = (stop - first) * layer_bytes
        results = np.asarray(results)
        full = results == extent
        self.stats.bytes_read += int(full.sum()) * extent
        matches = cells.reshape(-1, stop - first) == expected[chosen, first:stop]
        matches &= full[:, None]
        good = np.logical_and.accumulate(matches, axis=1)
        was_ok = ok[chosen]
        for position, result in zip(chosen[~full & was_ok].tolist(), results[~full & was_ok].tolist(), strict=True):
            self.stats.count_error(_error_kind(result, "short_read"))
            reasons[position] = ReadFailure.IO_ERROR if result < 0 else ReadFailure.SHORT_READ
        corrupt = full & was_ok & ~good[:, -1]
        if corrupt.any():
            reasons[chosen[corrupt]] = ReadFailure.CHECKSUM
            self.stats.checksum_failures += int((~matches[corrupt]).sum())
        good &= was_ok[:, None]
        return chosen, good

    # -- remove -----------------------------------------------------------

    def remove_blocks(
        self, namespace_id: bytes, keys_and_slots: Sequence[tuple[bytes, int]], *, deleted: bool = False
    ) -> list[bool]:
        """Journal the removal of blocks; their slots may then be written again.

        Under STRICT the REMOVE records are durable when this returns; under
        GROUP at the next sync(), and write_blocks syncs first if it is
        handed one of these slots before then. False: the drive's manifest
        failed; the slot stays unusable until the tier is reopened. A slot
        no record names (its write failed before the PUT was journalled)
        needs nothing journalled: True at once.

        deleted: a client's Delete. Its REMOVE records are durable when this
        returns whatever the fsync policy (False where they are not), and
        the first page of each block is overwritten with a tombstone
        (`shred`), so that even a manifest damaged later, which could lose
        the REMOVE and bring the PUT record back, can never serve the bytes:
        the block's layer 0 no longer matches its checksum.
        """
        self._check_writable()
        count = len(keys_and_slots)
        ok = np.ones(count, dtype=bool)
        by_drive: dict[int, list[int]] = {}
        for position, (key, slot) in enumerate(keys_and_slots):
            drive = drive_of(self.config, slot)
            if slot not in self._owners and drive not in self.failed_drives:
                # A write that failed before its PUT was journalled (EIO,
                # ENOSPC, a short write, a failed fdatasync): the engine
                # cannot tell that from a failed append and asks for a
                # REMOVE, but no record names the block. A failed append
                # fails the drive, so on a working drive nothing is left to
                # remove: the slot is free.
                continue
            check(
                slot not in self._owners or self._holds(slot, namespace_id, key),
                f"removing key {key.hex()[:16]} from slot {slot}, which does not hold it",
            )
            by_drive.setdefault(drive, []).append(position)
        for drive, members in sorted(by_drive.items()):
            if drive in self.failed_drives:
                ok[members] = False
                continue
            manifest = self._manifests[drive]
            records = [RemoveRecord(manifest.sequence(), namespace_id, keys_and_slots[i][0]) for i in members]
            if not self._append(drive, records):
                ok[members] = False
                continue
            slots = [keys_and_slots[i][1] for i in members]
            for slot in slots:
                del self._owners[slot]
            if deleted:
                if not self._sync_drive(drive, force=True):
                    ok[members] = False
            elif self.config.fsync_policy == FsyncPolicy.GROUP:
                self._unsynced_removals[drive].update(slots)
        if deleted:
            # Every deleted block, even where the REMOVE failed: its record
            # may then come back at a restart, but never its bytes.
            self.shred([slot for members in by_drive.values() for slot in (keys_and_slots[i][1] for i in members)])
        return ok.tolist()

    def shred(self, slots: Sequence[int]) -> int:
        """Overwrite the first page of each slot with a tombstone; how many were.

        The tombstone carries random bytes drawn for this call, so no block
        a client stored can equal it: whatever record still names one of
        these slots, its layer 0 fails its checksum from now on. One batch,
        then one fdatasync per segment file touched. A failure only costs
        this second line of defence (counted), never the removal itself.
        """
        if not slots:
            return 0
        tombstone = self._tombstone
        tombstone[:] = 0
        marker = TOMBSTONE_MAGIC + os.urandom(16)
        tombstone[: len(marker)] = np.frombuffer(marker, dtype=np.uint8)
        slot_array = np.asarray(slots, dtype=np.int64)
        _, files, offsets = locate_many(self.config, slot_array)
        addresses = np.full(len(slot_array), address_of(tombstone), dtype=np.uint64)
        results = self._transfer(self._op_write, files, offsets, ALIGN_BYTES, addresses)
        good = np.asarray(results) == ALIGN_BYTES
        for index in np.unique(files[good]).tolist():
            if self._fdatasync(index) != 0:
                good[files == index] = False
        shredded = int(good.sum())
        self.stats.shredded += shredded
        if shredded < len(slot_array):
            self.stats.count_error("shred", len(slot_array) - shredded)
        return shredded

    # -- maintenance --------------------------------------------------------

    def sync(self, *, force: bool = False) -> None:
        """Make every appended record durable (GROUP: the daemon's timer calls
        this); `force`: under NONE too (a Delete: see remove_blocks)."""
        self._check_open()
        for drive in range(self.config.drive_count):
            if drive not in self.failed_drives:
                self._sync_drive(drive, force=force)

    def _sync_segments(self, drive: int) -> bool:
        """fdatasync the drive's segments written since their last sync; False (the drive
        taken out of writes) when one fails."""
        pending = self._unsynced_data[drive]
        for index in sorted(pending):
            result = self._fdatasync(index)
            if result != 0:
                self.stats.count_error("fsync_" + _error_kind(result, "fsync"))
                self._fail_drive(drive, f"segment fdatasync failed: {os.strerror(-result)}")
                return False
            pending.discard(index)
        return True

    def _sync_drive(self, drive: int, *, force: bool = False) -> bool:
        """Sync a drive's manifest (whatever the policy if `force`), the data its
        records point at first; False takes the drive out of writes."""
        if self.config.fsync_policy == FsyncPolicy.NONE and not force:
            return True
        if not self._sync_segments(drive):
            return False
        try:
            self._manifests[drive].sync(force=force)
        except OSError as error:
            self._fail_drive(drive, f"manifest fsync failed: {error}")
            return False
        self._unsynced_removals[drive].clear()
        return True

    def compact_if_needed(self, max_bytes: int) -> int:
        """Rewrite each manifest larger than max_bytes as a snapshot; how many were."""
        self._check_writable()
        compacted = 0
        for drive, manifest in enumerate(self._manifests):
            if drive in self.failed_drives or manifest.size_bytes <= max_bytes:
                continue
            # The snapshot is durable the moment it is published: the data of every record in it
            # goes to the drive first, as before any manifest sync.
            if not self._sync_segments(drive):
                continue
            try:
                manifest.compact()
            except OSError as error:
                # compact() has already moved on to the new manifest's name;
                # appends there would be invisible behind the old CURRENT.
                self._fail_drive(drive, f"manifest compaction failed: {error}")
                continue
            self._unsynced_removals[drive].clear()  # the snapshot is durable
            compacted += 1
        return compacted

    def _holds(self, slot: int, namespace_id: bytes, key: bytes) -> bool:
        record = self._owners.get(slot)
        return record is not None and record.namespace_id == namespace_id and record.key == key

    def record_of(self, slot: int) -> PutRecord | None:
        """The live record of a slot, None if the slot is free."""
        return self._owners.get(slot)

    def key_of(self, slot: int) -> bytes:
        record = self._owners.get(slot)
        check(record is not None, f"disk slot {slot} holds no block")
        return record.key

    def layer_checksums_of(self, slot: int) -> bytes:
        record = self._owners.get(slot)
        check(record is not None, f"disk slot {slot} holds no block")
        return record.layer_checksums

    def manifest_bytes(self) -> list[int]:
        return [manifest.size_bytes for manifest in self._manifests]

    def live_records(self) -> list[PutRecord]:
        """Every live block's record, all drives (fsck walks these)."""
        return [record for manifest in self._manifests for record in manifest.live.values()]

    def engine_stats(self) -> dict[str, int]:
        return dict(self._engine.stats) if self._engine is not None else {}

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> None:
        """Pass (address, nbytes) regions, e.g. the host arena, to the I/O
        engine to register: only a speed-up (the kernel skips pinning pages
        per I/O); OSError when the kernel refuses (RLIMIT_MEMLOCK)."""
        self._check_open()
        # The tombstone page too: every address the tier hands the engine then
        # lies in a registered buffer (debug builds of kvd._native check it).
        self._engine.register_buffers([*regions, (address_of(self._tombstone), ALIGN_BYTES)])

    @property
    def engine(self) -> object:
        """The I/O engine (tests inject faults through it)."""
        return self._engine

    def close(self) -> None:
        """Sync what the policy syncs, stop the engine, close the files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._opened and not self.read_only:
            for drive in range(len(self._manifests)):
                if drive not in self.failed_drives:
                    self._sync_drive(drive)
        if self._engine is not None and self._owns_engine:
            self._engine.close()
        for fd in set(self._fds):
            os.close(fd)
        self._fds = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- checks -------------------------------------------------------------

    def _check_open(self) -> None:
        check(self._opened and not self._closed, "disk tier is not open")

    def _check_writable(self) -> None:
        self._check_open()
        check(not self.read_only, "disk tier opened read-only")

    def verify(self) -> None:
        """Cross-check the slot map against the manifests (tests call it)."""
        owners: dict[int, PutRecord] = {}
        for drive, manifest in enumerate(self._manifests):
            for identity, record in manifest.live.items():
                check(identity == (record.namespace_id, record.key), "manifest live map keyed wrongly")
                check(drive_of(self.config, record.location) == drive, "record on the wrong drive")
                check(record.location not in owners, "slot {} held twice", record.location)
                owners[record.location] = record
        check(owners == self._owners, "slot owners differ from the manifests")
