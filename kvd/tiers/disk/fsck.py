"""`kvd inspect` and `kvd fsck`: look at disk tier directories offline.

inspect  prints each directory's IDENTITY, segment files, manifest and
         per-namespace block counts. It changes nothing and reads no block
         data; each directory is inspected on its own.
fsck     opens the whole drive set (the directories in their configured
         order), reads every live block's layers and checks them against
         their records, with a progress bar on stderr. Without --repair it
         changes nothing; with --repair it opens the set as the daemon would
         (torn tails cut, dropped records compacted away, missing segments
         re-created) and appends REMOVE records for corrupt and unreadable
         blocks, so the daemon never even tries them.

Run either only while no daemon uses the directories.

Exit codes: 0 clean (missing blocks are a loss, not an error: the tier may
lose blocks), 1 some block is corrupt or unreadable, 2 a directory was
refused (the message names the file and field).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from kvd.errors import KvdError
from kvd.io.engine import address_of, aligned_empty
from kvd.tiers.disk.journal import CURRENT, FsyncPolicy, Manifest, PutRecord
from kvd.tiers.disk.layout import DiskConfig, DiskIdentityError, read_identity, segment_number
from kvd.tiers.disk.registry import NamespaceRegistry
from kvd.tiers.disk.tier import DiskTier, ReadFailure, ReadOnlyFileSystem

# fsck reads at most this many bytes of blocks per batch of read_blocks.
READ_BUFFER_BYTES = 64 << 20
MAX_BLOCKS_PER_READ = 1024


def _size(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << (shift - 4)) == 0:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


# ----------------------------------------------------------------------
# inspect


def inspect_directory(directory: Path, out: TextIO) -> None:
    identity = read_identity(directory)
    if identity is None:
        raise DiskIdentityError(directory, "magic", "missing: not a kvd disk directory")
    out.write(f"{directory}\n")
    out.write(
        f"  identity   {identity.magic} v{identity.format_version}, set {identity.set_uuid}, "
        f"drive {identity.drive_index} of {identity.drive_count}\n"
        f"             slot {_size(identity.slot_bytes)}, segment {_size(identity.segment_bytes)}\n"
    )
    segments = {}
    for path in directory.iterdir():
        number = segment_number(path.name)
        if number is not None:
            segments[number] = path.stat().st_size
    expected = max(segments, default=-1) + 1
    missing = [number for number in range(expected) if number not in segments]
    short = [number for number, size in segments.items() if size < identity.segment_bytes]
    out.write(
        f"  segments   {len(segments)} files, {_size(sum(segments.values()))}"
        f"{f', missing {missing}' if missing else ''}{f', short {sorted(short)}' if short else ''}\n"
    )
    registry = NamespaceRegistry(directory, ReadOnlyFileSystem(), read_only=True)
    registry_report = registry.open()
    fs = ReadOnlyFileSystem()
    manifest = Manifest(directory, FsyncPolicy.NONE, fs)
    if fs.read(directory / CURRENT) is None:
        out.write("  manifest   none yet\n")
    else:
        report = manifest.open()
        torn = f", {report.truncated_bytes} bytes of torn tail" if report.truncated_bytes else ""
        out.write(
            f"  manifest   {report.manifest}, {manifest.size_bytes} bytes, {report.records} records, "
            f"{report.live_blocks} live blocks{torn}\n"
        )
    if registry_report.truncated_bytes:
        out.write(f"  NAMESPACES has {registry_report.truncated_bytes} bytes of torn tail\n")
    counts: dict[bytes, int] = {}
    for record in manifest.records():
        counts[record.namespace_id] = counts.get(record.namespace_id, 0) + 1
    out.write(f"  namespaces {len(registry.entries)}\n")
    for namespace_id in sorted(set(registry.entries) | set(counts)):
        entry = registry.entries.get(namespace_id)
        if entry is None:
            description = "(not in NAMESPACES)"
        elif entry.spec is None:
            description = "(spec written by another kvd version)"
        else:
            spec = entry.spec
            description = f"{spec.model_id} layers={spec.num_layers} layer_bytes={spec.layer_bytes}"
            if spec.lora_id:
                description += f" lora={spec.lora_id}"
        out.write(f"    {namespace_id.hex()[:16]}  {counts.get(namespace_id, 0):>8} blocks  {description}\n")


def inspect(directories: Sequence[Path], out: TextIO | None = None) -> int:
    out = out or sys.stdout
    for directory in directories:
        inspect_directory(Path(directory), out)
    return 0


# ----------------------------------------------------------------------
# fsck


def config_from_directories(directories: Sequence[Path]) -> DiskConfig:
    """The configuration the drives were written with, read from themselves.

    Capacity is not in IDENTITY: it is taken from the segment files found
    (the most any drive has), so a missing trailing segment still counts.
    """
    directories = [Path(directory) for directory in directories]
    first = read_identity(directories[0])
    if first is None:
        raise DiskIdentityError(directories[0], "magic", "missing: not a kvd disk directory")
    segments = 1
    for directory in directories:
        numbers = [segment_number(path.name) for path in directory.iterdir()] if directory.is_dir() else []
        segments = max(segments, max((n + 1 for n in numbers if n is not None), default=0))
    return DiskConfig(
        tuple(directories),
        capacity_bytes=segments * first.segment_bytes,
        slot_bytes=first.slot_bytes,
        segment_bytes=first.segment_bytes,
        fsync_policy=FsyncPolicy.STRICT,
    )


class Progress:
    """A one-line progress bar, redrawn at most every `interval_s`."""

    def __init__(self, total: int, stream: TextIO, label: str = "fsck", width: int = 32, interval_s: float = 0.1):
        self.total = total
        self.stream = stream
        self.label = label
        self.width = width
        self.interval_s = interval_s
        self.done = 0
        self._drawn_at = float("-inf")

    def advance(self, amount: int) -> None:
        self.done += amount
        now = time.monotonic()
        if now - self._drawn_at >= self.interval_s:
            self._draw()
            self._drawn_at = now

    def _draw(self) -> None:
        fraction = self.done / self.total if self.total else 1.0
        filled = int(fraction * self.width)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} blocks {fraction * 100:5.1f}%")
        self.stream.flush()

    def finish(self) -> None:
        self._draw()
        self.stream.write("\n")
        self.stream.flush()


@dataclass(slots=True)
class FsckReport:
    good: int = 0
    corrupt: int = 0  # read in full, a layer's checksum differs
    missing: int = 0  # segment missing or short (at open or on read)
    unreadable: int = 0  # the drive returned an error
    dropped: int = 0  # records dropped at open for other reasons (out of range, unknown namespace, ...)
    unverifiable: int = 0  # namespace spec unreadable by this kvd: shape unknown
    repaired: int = 0  # REMOVE records appended (--repair)
    bad_blocks: list[tuple[str, PutRecord]] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.corrupt == 0 and self.unreadable == 0


def fsck_tier(tier: DiskTier, progress_stream: TextIO | None = None, repair: bool = False) -> FsckReport:
    """Read and verify every live block of an open tier."""
    report = FsckReport()
    by_namespace: dict[bytes, list[PutRecord]] = {}
    for record in tier.live_records():
        by_namespace.setdefault(record.namespace_id, []).append(record)
    total = sum(len(records) for records in by_namespace.values())
    progress = Progress(total, progress_stream) if progress_stream is not None else None
    slot_bytes = tier.config.slot_bytes
    chunk = max(1, min(MAX_BLOCKS_PER_READ, READ_BUFFER_BYTES // slot_bytes))
    buffer = aligned_empty(chunk * slot_bytes)
    base = address_of(buffer)
    for namespace_id, records in sorted(by_namespace.items()):
        entry = tier.namespaces.get(namespace_id)
        if entry is None or entry.spec is None:
            report.unverifiable += len(records)
            if progress is not None:
                progress.advance(len(records))
            continue
        spec = entry.spec
        bad: list[PutRecord] = []
        for start in range(0, len(records), chunk):
            group = records[start : start + chunk]
            items = [
                (record.key, record.location, base + position * slot_bytes, record.layer_checksums)
                for position, record in enumerate(group)
            ]
            reasons = np.zeros(len(group), dtype=np.int8)
            ok = tier.read_blocks(namespace_id, spec.layer_bytes, spec.num_layers, items, failures=reasons)
            report.good += int(ok.sum())
            for record, reason in zip(group, reasons.tolist(), strict=True):
                if reason == ReadFailure.NONE:
                    continue
                if reason == ReadFailure.CHECKSUM:
                    report.corrupt += 1
                    kind = "corrupt"
                elif reason == ReadFailure.IO_ERROR:
                    report.unreadable += 1
                    kind = "unreadable"
                else:
                    report.missing += 1
                    kind = "missing"
                report.bad_blocks.append((kind, record))
                bad.append(record)
            if progress is not None:
                progress.advance(len(group))
        if repair and bad:
            removed = tier.remove_blocks(namespace_id, [(record.key, record.location) for record in bad])
            report.repaired += sum(removed)
    if progress is not None:
        progress.finish()
    return report


def fsck(
    directories: Sequence[Path],
    *,
    repair: bool = False,
    out: TextIO | None = None,
    progress_stream: TextIO | None = None,
    io_engine: str = "auto",
) -> int:
    """Verify every block of the set; progress goes to stderr unless given."""
    out = out or sys.stdout
    progress_stream = progress_stream or sys.stderr
    config = config_from_directories(directories)
    if io_engine != config.io_engine:
        config = DiskConfig(
            config.directories, config.capacity_bytes, config.slot_bytes, config.segment_bytes,
            config.fsync_policy, config.queue_depth, io_engine,
        )
    with DiskTier(config, read_only=not repair) as tier:
        recovery = tier.open()
        report = fsck_tier(tier, progress_stream, repair=repair)
        if repair:
            tier.sync()
    dropped = recovery.dropped
    report.missing += dropped.missing_segment
    report.dropped = dropped.total - dropped.missing_segment
    out.write(
        f"fsck: {config.drive_count} drives, {len(recovery.namespaces)} namespaces, "
        f"{recovery.block_count} blocks checked\n"
        f"good {report.good}  corrupt {report.corrupt}  missing {report.missing}  unreadable {report.unreadable}  "
        f"dropped {report.dropped}  unverifiable {report.unverifiable}\n"
    )
    if recovery.truncated_bytes:
        out.write(f"torn tails: {recovery.truncated_bytes} bytes{' (cut off)' if repair else ''}\n")
    for path in recovery.missing_segments:
        out.write(f"missing segment: {path}\n")
    for path in recovery.short_segments:
        out.write(f"short segment: {path}\n")
    for kind, record in report.bad_blocks:
        out.write(
            f"{kind}: drive {record.location % config.drive_count} slot {record.location} "
            f"namespace {record.namespace_id.hex()[:16]} key {record.key.hex()[:16]}\n"
        )
    if repair:
        out.write(f"repaired: {report.repaired} REMOVE records appended\n")
    return 0 if report.clean else 1


def main(command: str, directories: Sequence[str], *, repair: bool = False) -> int:
    """Entry point of `kvd inspect` and `kvd fsck` (kvd.cli)."""
    paths = [Path(directory) for directory in directories]
    try:
        if command == "inspect":
            return inspect(paths)
        return fsck(paths, repair=repair)
    except KvdError as error:
        print(f"kvd {command}: {error}", file=sys.stderr)
        return 2
