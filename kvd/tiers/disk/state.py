"""The open disk tier's state, and the drive primitives every job shares.

`TierState` is what the parts of the tier (kvd/tiers/disk/tier.py lists
them) work on together: the configuration, the segment files, the
manifests and registries per drive, the I/O engine, the counters, the
namespaces, the live record of every slot, and the drives out of service.
Its methods are the steps more than one job takes: a batch through the
engine, a segment fdatasync, a manifest append, a drive's sync (data before
the records that point at it), taking a drive out of writes or out of
service. Each job's own rules live in its module.

Invariants: `owners` holds exactly the live records of the working
drives' manifests (DiskTier.verify); a drive in `quarantined` is in
`failed_drives` too; nothing is written to a drive in `failed_drives`;
`stats`, `namespaces`, `failed_drives` and `quarantined` are never rebound
(DiskTier shows them as its own attributes).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvd.invariants import check
from kvd.tiers.disk.fs import FileSystem, OsFileSystem
from kvd.tiers.disk.journal import FsyncPolicy, Manifest, MetadataDamage
from kvd.tiers.disk.records import PutRecord, RemoveRecord
from kvd.tiers.disk.layout import DiskConfig, file_index, segment_name
from kvd.tiers.disk.registry import NamespaceEntry, NamespaceRegistry
from kvd.tiers.disk.results import DiskStats, DriveDamage, error_kind

# One logger for every part of the tier, named as before the tier was split
# into parts (the daemon's JSON lines carry the logger's name).
log = logging.getLogger("kvd.tiers.disk.tier")


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


class TierState:
    """One open disk tier's state; owned, like the DiskTier, by one I/O thread.

    Not slotted: tests wrap its primitives (`submit`, `fdatasync`) per
    instance to watch or fail them.
    """

    def __init__(self, config: DiskConfig, *, engine: object | None, fs: FileSystem | None, read_only: bool) -> None:
        self.config = config
        self.read_only = read_only
        # Manifests and registries go through `fs` (crash tests swap it);
        # segment data always goes through the I/O engine.
        self.fs: FileSystem = ReadOnlyFileSystem() if read_only else (fs or OsFileSystem())
        self.engine = engine
        self.owns_engine = engine is None
        self.op_read = 0  # the engine's Op codes, set when the engine starts
        self.op_write = 1
        self.stats = DiskStats()
        self.namespaces: dict[bytes, NamespaceEntry] = {}
        self.manifests: list[Manifest] = []  # per drive, an empty one for a quarantined drive
        self.registries: list[NamespaceRegistry] = []  # per drive
        self.fds: list[int] = []  # per segment file (file_index), a placeholder where absent
        self.file_present = np.ones(config.file_count, dtype=bool)
        self.file_sizes = np.zeros(config.file_count, dtype=np.int64)  # -1: missing
        # slot -> the record of the live block in it.
        self.owners: dict[int, PutRecord] = {}
        # Per drive: slots whose REMOVE was appended but not yet synced (GROUP).
        self.unsynced_removals: list[set[int]] = [set() for _ in config.directories]
        # GROUP: segment files written since the drive's last sync; their
        # fdatasync goes with the manifest's, just before it.
        self.unsynced_data: list[set[int]] = [set() for _ in config.directories]
        # Per drive: why it takes no more writes (its manifest could not be
        # appended or synced, so the log's tail is no longer trustworthy).
        self.failed_drives: dict[int, str] = {}
        # Per drive whose metadata cannot be read: why (it is in failed_drives too).
        self.quarantined: dict[int, DriveDamage] = {}
        self.opened = False
        self.closed = False

    # -- checks -------------------------------------------------------------

    def check_open(self) -> None:
        check(self.opened and not self.closed, "disk tier is not open")

    def check_writable(self) -> None:
        self.check_open()
        check(not self.read_only, "disk tier opened read-only")

    def check_shape(self, namespace_id: bytes, layer_bytes: int, num_layers: int) -> None:
        """The namespace is registered with this layer shape, and its blocks fit a slot."""
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

    def holds(self, slot: int, namespace_id: bytes, key: bytes) -> bool:
        record = self.owners.get(slot)
        return record is not None and record.namespace_id == namespace_id and record.key == key

    # -- files --------------------------------------------------------------

    def segment_path(self, drive: int, segment: int) -> Path:
        return self.config.directories[drive] / segment_name(segment)

    def has_segments(self, drive: int) -> bool:
        """Whether any segment file of the drive is there (created only after CURRENT was)."""
        first = file_index(self.config, drive, 0)
        return bool((self.file_sizes[first:first + self.config.segments_per_drive] >= 0).any())

    # -- the engine ---------------------------------------------------------

    def submit(self, op: int, files: np.ndarray, offsets: np.ndarray, length: int, addresses: np.ndarray,
               **checksums: object) -> int:
        """Hand one batch of equal-length entries to the engine; its batch id."""
        count = len(files)
        self.stats.submissions += 1
        return self.engine.submit(
            op,
            np.ascontiguousarray(files, dtype=np.int32),
            np.ascontiguousarray(offsets, dtype=np.int64),
            np.full(count, length, dtype=np.uint32),
            np.ascontiguousarray(addresses, dtype=np.uint64),
            **checksums,
        )

    def transfer(self, op: int, files: np.ndarray, offsets: np.ndarray, length: int,
                 addresses: np.ndarray) -> np.ndarray:
        """One batch through the engine; waited before returning."""
        batch = self.submit(op, files, offsets, length, addresses)
        return self.engine.wait(batch)

    def fdatasync(self, index: int) -> int:
        """fdatasync one segment file: 0, or -errno."""
        self.stats.fsyncs += 1
        try:
            self.engine.fsync(index, datasync=True)
        except OSError as error:
            return -(error.errno or errno.EIO)
        return 0

    # -- manifests and drives -------------------------------------------------

    def append(self, drive: int, records: Sequence[PutRecord | RemoveRecord]) -> bool:
        """Append to a drive's manifest; on failure take the drive out of writes.

        After a failed append the file may end in a partial frame, and a
        failed fsync may have lost pages: anything appended after that could
        be cut off at replay. So the drive takes no more writes until the
        daemon reopens the tier (replay then repairs the tail).
        """
        # A failed append leaves the manifest's live map and file as they
        # were (Manifest.append cuts a partial frame back off).
        try:
            self.manifests[drive].append(records)
        except OSError as error:
            self.fail_drive(drive, f"manifest append failed: {error}")
            return False
        return True

    def fail_drive(self, drive: int, reason: str) -> None:
        """Take a drive out of writes (its manifest's tail can no longer be trusted)."""
        if drive not in self.failed_drives:
            log.error("disk drive taken out of writes", extra={"drive": drive, "reason": reason})
            self.failed_drives[drive] = reason
        self.stats.count_error("manifest")

    def sync_segments(self, drive: int) -> bool:
        """fdatasync the drive's segments written since their last sync; False (the drive
        taken out of writes) when one fails."""
        pending = self.unsynced_data[drive]
        for index in sorted(pending):
            result = self.fdatasync(index)
            if result != 0:
                self.stats.count_error("fsync_" + error_kind(result, "fsync"))
                self.fail_drive(drive, f"segment fdatasync failed: {os.strerror(-result)}")
                return False
            pending.discard(index)
        return True

    def sync_drive(self, drive: int, *, force: bool = False) -> bool:
        """Sync a drive's manifest (whatever the policy if `force`), the data its
        records point at first; False takes the drive out of writes."""
        if self.config.fsync_policy == FsyncPolicy.NONE and not force:
            return True
        if not self.sync_segments(drive):
            return False
        try:
            self.manifests[drive].sync(force=force)
        except OSError as error:
            self.fail_drive(drive, f"manifest fsync failed: {error}")
            return False
        self.unsynced_removals[drive].clear()
        return True

    def quarantine(self, drive: int, path: Path, problem: str, blocks: int | None) -> None:
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
