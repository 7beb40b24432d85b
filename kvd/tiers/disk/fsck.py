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

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import numpy as np

from kvd.errors import KvdError
from kvd.io.engine import address_of, aligned_empty
from kvd.tiers.disk.journal import FsyncPolicy, Manifest, MetadataDamage
from kvd.tiers.disk.records import PutRecord
from kvd.tiers.disk.layout import (
    ALIGN_BYTES,
    IDENTITY,
    DiskConfig,
    DiskIdentityError,
    Identity,
    IdentityDamaged,
    drive_of,
    holds_kvd_files,
    read_identity,
    segment_number,
    split_location,
    write_identity,
)
from kvd.tiers.disk.registry import NamespaceRegistry
from kvd.tiers.disk.tier import DiskRecovery, DiskTier, ReadFailure, ReadOnlyFileSystem

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
    try:
        identity = read_identity(directory)
    except IdentityDamaged as damage:
        identity = None
        problem = damage.problem
    else:
        problem = "missing"
    if identity is None and not (directory.is_dir() and holds_kvd_files(directory)):
        raise DiskIdentityError(directory, "magic", "missing: not a kvd disk directory")
    out.write(f"{directory}\n")
    if identity is None:
        out.write(f"  identity   DAMAGED: {problem}\n")
    else:
        out.write(
            f"  identity   {identity.magic} v{identity.format_version}, set {identity.set_uuid}, "
            f"drive {identity.drive_index} of {identity.drive_count}\n"
            f"             slot {_size(identity.slot_bytes)}, segment {_size(identity.segment_bytes)}\n"
        )
    _inspect_segments(directory, identity.segment_bytes if identity is not None else 0, out)
    registry = NamespaceRegistry(directory, ReadOnlyFileSystem(), read_only=True)
    registry_report = registry.open()
    manifest = _inspect_manifest(directory, out)
    if registry_report.truncated_bytes:
        out.write(f"  NAMESPACES has {registry_report.truncated_bytes} bytes of torn tail\n")
    _inspect_namespaces(registry, manifest, out)


def _inspect_segments(directory: Path, segment_bytes: int, out: TextIO) -> None:
    segments = {}
    for path in directory.iterdir():
        number = segment_number(path.name)
        if number is not None:
            segments[number] = path.stat().st_size
    expected = max(segments, default=-1) + 1
    missing = [number for number in range(expected) if number not in segments]
    short = [number for number, size in segments.items() if size < segment_bytes]
    out.write(
        f"  segments   {len(segments)} files, {_size(sum(segments.values()))}"
        f"{f', missing {missing}' if missing else ''}{f', short {sorted(short)}' if short else ''}\n"
    )


def _inspect_manifest(directory: Path, out: TextIO) -> Manifest:
    manifest = Manifest(directory, FsyncPolicy.NONE, ReadOnlyFileSystem())
    try:
        report = manifest.open(create=False)
    except MetadataDamage as damage:
        out.write(f"  manifest   DAMAGED: {damage.path.name}: {damage.problem}\n")
        return manifest
    torn = f", {report.truncated_bytes} bytes of torn tail" if report.truncated_bytes else ""
    damaged = (f", DAMAGED: {report.damaged_bytes} bytes in {report.damaged_regions} places, at least "
               f"{report.lost_records} records lost" if report.damaged else "")
    out.write(
        f"  manifest   {report.manifest or 'none yet'}, {manifest.size_bytes} bytes, {report.records} records, "
        f"{report.live_blocks} live blocks{torn}{damaged}\n"
    )
    return manifest


def _inspect_namespaces(registry: NamespaceRegistry, manifest: Manifest, out: TextIO) -> None:
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

    Geometry comes from the first drive whose IDENTITY can be read (a
    damaged one is the damage fsck reports). Capacity is not in IDENTITY:
    it is taken from the segment files found (the most any drive has), so
    a missing trailing segment still counts.
    """
    directories = [Path(directory) for directory in directories]
    first = sound_identity(directories)
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
        # Every slot size class a record can name, whatever the daemon's configuration.
        min_slot_bytes=ALIGN_BYTES,
    )


def sound_identity(directories: Sequence[Path]) -> Identity:
    """The IDENTITY of the first drive that has a readable one."""
    for directory in directories:
        if not Path(directory).is_dir():
            continue
        try:
            identity = read_identity(Path(directory))
        except IdentityDamaged:
            continue
        if identity is not None:
            return identity
    raise DiskIdentityError(Path(directories[0]), "magic",
                            "no drive of the set has a readable IDENTITY: not a kvd disk tier, or every drive's is lost")


def repair_drives(config: DiskConfig) -> list[str]:
    """Make every drive's metadata readable again (fsck --repair), before the
    set is opened: an IDENTITY rewritten from a sound drive's, CURRENT
    pointed at the right manifest, or a new empty manifest where none can
    be read. Damaged files are renamed *.damaged, never deleted. What was
    done, one line per drive that needed it."""
    template = sound_identity(config.directories)
    actions = []
    for drive, directory in enumerate(config.directories):
        try:
            identity = read_identity(directory)
            damaged = identity is None and holds_kvd_files(directory)
        except IdentityDamaged:
            damaged = True
        if damaged:
            path = directory / IDENTITY
            if path.exists():
                path.rename(path.with_name(IDENTITY + ".damaged"))
            write_identity(directory, Identity(template.set_uuid, drive, config.drive_count, template.slot_bytes,
                                               template.segment_bytes))
            actions.append(f"drive {drive}: IDENTITY rewritten from the other drives'")
        if holds_kvd_files(directory):
            in_use = any(segment_number(name) is not None for name in os.listdir(directory))
            action = Manifest(directory, FsyncPolicy.STRICT).repair(in_use=in_use)
            if action:
                actions.append(f"drive {drive}: {action}")
    return actions


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


def _tally_failures(report: FsckReport, group: list[PutRecord], reasons: list[int]) -> list[PutRecord]:
    """Count each failed read by its kind; the records that failed."""
    bad = []
    for record, reason in zip(group, reasons, strict=True):
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
    return bad


def _slot_name(config: DiskConfig, location: int) -> str:
    """A slot as a person reads it: its page, and its place if it is smaller than a page."""
    page, class_index, position = split_location(location)
    if not class_index:
        return str(page)
    return f"{page}.{position} ({config.slot_bytes >> class_index} bytes)"


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
            # Whole blocks: nothing here uses a layer before all have landed.
            ok = tier.read_blocks(namespace_id, spec.layer_bytes, spec.num_layers, items, failures=reasons,
                                  whole_blocks=True)
            report.good += int(ok.sum())
            bad.extend(_tally_failures(report, group, reasons.tolist()))
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
    """Verify every block of the set; progress goes to stderr unless given.

    0: nothing lost, nothing corrupt. 1: blocks the metadata described are
    lost (quarantined drives, damage inside a manifest, dropped records,
    missing segments) or corrupt or unreadable, or --repair repaired
    something; the report says how many and why (run it again after a
    repair to see a clean set).
    """
    out = out or sys.stdout
    progress_stream = progress_stream or sys.stderr
    config = config_from_directories(directories)
    if io_engine != config.io_engine:
        config = dataclasses.replace(config, io_engine=io_engine)
    actions = repair_drives(config) if repair else []
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
    lost = _write_losses(out, config, recovery, report)
    if recovery.truncated_bytes:
        out.write(f"torn tails: {recovery.truncated_bytes} bytes (appends a crash cut short, never acknowledged)"
                  f"{' (cut off)' if repair else ''}\n")
    for path in recovery.short_segments:
        out.write(f"short segment: {path}\n")
    for kind, record in report.bad_blocks:
        out.write(
            f"{kind}: drive {drive_of(config, record.location)} slot {_slot_name(config, record.location)} "
            f"namespace {record.namespace_id.hex()[:16]} key {record.key.hex()[:16]}\n"
        )
    for action in actions:
        out.write(f"repaired: {action}\n")
    if repair:
        out.write(f"repaired: {report.repaired} REMOVE records appended\n")
    return 0 if report.clean and not lost and not actions else 1


def _write_losses(out: TextIO, config: DiskConfig, recovery: DiskRecovery, report: FsckReport) -> bool:
    """Say what was lost and why, one line each; whether anything was."""
    lines = []
    for drive, damage in sorted(recovery.quarantined.items()):
        count = "an unknown number of" if damage.blocks is None else str(damage.blocks)
        lines.append(f"quarantined: drive {drive}: {damage.path}: {damage.problem}; {count} blocks lost")
    for drive, manifest in enumerate(recovery.manifests):
        if manifest.damaged:
            lines.append(f"damaged: drive {drive}: {manifest.manifest}: {manifest.damaged_bytes} bytes in "
                         f"{manifest.damaged_regions} places; at least {manifest.lost_records} records lost")
    for drive, registry in enumerate(recovery.registries):
        if registry.damaged_regions:
            # Not a loss by itself: every drive holds every namespace, and a
            # namespace no drive has left shows as dropped blocks below.
            out.write(f"damaged: drive {drive}: NAMESPACES: {registry.damaged_bytes} bytes in "
                      f"{registry.damaged_regions} places (completed from the other drives' copies)\n")
    for reason, meaning in DROP_REASONS.items():
        count = getattr(recovery.dropped, reason)
        if count:
            lines.append(f"dropped: {count} blocks: {meaning}")
    for path in recovery.missing_segments:
        lines.append(f"missing segment: {path}")
    for line in lines:
        out.write(line + "\n")
    lost = sum(damage.blocks or 0 for damage in recovery.quarantined.values()) + recovery.lost_records + \
        recovery.dropped.total
    unknown = [str(drive) for drive, damage in sorted(recovery.quarantined.items()) if damage.blocks is None]
    if lines:
        also = f", and every block of drive {', '.join(unknown)} (how many, nothing left tells)" if unknown else ""
        out.write(f"lost: at least {lost} blocks the metadata described{also}\n")
    return bool(lines) or not report.clean


DROP_REASONS = {
    "out_of_range": "slot beyond the drives' capacity or on the wrong drive",
    "missing_segment": "segment file missing or too short",
    "unknown_namespace": "their namespace is in no drive's NAMESPACES (its layout is unknown)",
    "malformed": "layer count or shape does not match their namespace",
    "duplicate_slot": "an older record for a slot a newer one claims",
}


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
    except OSError as error:
        print(f"kvd {command}: {error}", file=sys.stderr)
        return 2
