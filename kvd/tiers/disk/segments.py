"""The segment files at open: found and measured, completed to full length,
opened O_DIRECT and registered with the I/O engine.

Steps of DiskTier.open (recovery.py runs them in order). A quarantined
drive's files are never opened or changed; a missing file (read-only
opens) gets a placeholder descriptor, and reads of it are refused before
they reach the engine.
"""

from __future__ import annotations

import errno
import os
import resource

import numpy as np

from kvd.errors import FailedPrecondition, ResourceExhausted
from kvd.tiers.disk.layout import ALIGN_BYTES, file_index, fsync_directory
from kvd.tiers.disk.results import DiskRecovery
from kvd.tiers.disk.state import TierState, log
from kvd.tiers.disk.zeroing import zero_range


def inspect_segments(state: TierState, recovery: DiskRecovery, fresh: set[int]) -> None:
    """Measure every segment file into state.file_sizes (-1: missing); report the
    missing (except on drives created now) and short ones."""
    config = state.config
    for drive in range(config.drive_count):
        for segment in range(config.segments_per_drive):
            index = file_index(config, drive, segment)
            if drive in state.quarantined:
                state.file_sizes[index] = -1  # never opened
                continue
            path = state.segment_path(drive, segment)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                size = -1
                if drive not in fresh:
                    recovery.missing_segments.append(path)
            else:
                if size < config.segment_bytes:
                    recovery.short_segments.append(path)
            state.file_sizes[index] = size


def complete_segments(state: TierState) -> None:
    """Create missing segments and extend short ones to full length."""
    config = state.config
    for drive in range(config.drive_count):
        if drive in state.quarantined:
            continue  # left exactly as it is, for fsck --repair
        created = False
        for segment in range(config.segments_per_drive):
            index = file_index(config, drive, segment)
            if state.file_sizes[index] >= config.segment_bytes:
                continue
            _preallocate(state, drive, segment, max(0, int(state.file_sizes[index])))
            created = created or state.file_sizes[index] < 0
            state.file_sizes[index] = config.segment_bytes
        if created:
            fsync_directory(config.directories[drive])


def _preallocate(state: TierState, drive: int, segment: int, old_size: int) -> None:
    """A segment file at full length; with disk.zero_segments, the bytes past its old size
    written with zeros (what was there before is never touched)."""
    config = state.config
    path = state.segment_path(drive, segment)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        os.posix_fallocate(fd, 0, config.segment_bytes)
        os.fsync(fd)
        if config.zero_segments:
            log.info("zeroing %s from %d to %d bytes (disk.zero_segments; segment %d of %d on drive %d)",
                     path, old_size, config.segment_bytes, segment + 1, config.segments_per_drive, drive)
            zero_range(path, -(-old_size // ALIGN_BYTES) * ALIGN_BYTES, config.segment_bytes)
    except OSError as error:
        raise ResourceExhausted(
            f"disk directory {config.directories[drive]}: cannot preallocate {path.name} "
            f"({config.segment_bytes} bytes; disk.capacity_bytes is per drive): {error}"
        ) from None
    finally:
        os.close(fd)


def open_files(state: TierState) -> None:
    """Open every segment file O_DIRECT into state.fds, in file_index order (the
    engine's file table), raising RLIMIT_NOFILE first where it is too low."""
    config = state.config
    _raise_file_limit(config.file_count)
    flags = (os.O_RDONLY if state.read_only else os.O_RDWR) | os.O_DIRECT | os.O_CLOEXEC
    placeholder = -1
    for drive in range(config.drive_count):
        for segment in range(config.segments_per_drive):
            index = file_index(config, drive, segment)
            if state.file_sizes[index] < 0:
                # Missing (read-only open) or on a quarantined drive: no
                # kept record points here and reads of it are refused
                # before submission, but the engine's file table needs a
                # descriptor in every place.
                if placeholder < 0:
                    placeholder = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
                state.fds.append(placeholder)
                state.file_present[index] = False
                continue
            try:
                state.fds.append(os.open(state.segment_path(drive, segment), flags))
            except OSError as error:
                if error.errno == errno.EINVAL:
                    raise FailedPrecondition(
                        f"disk directory {config.directories[drive]}: its file system does not support O_DIRECT"
                    ) from None
                raise


def _raise_file_limit(file_count: int) -> None:
    needed = file_count + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise FailedPrecondition(
                f"the disk tier needs {file_count} open segment files but RLIMIT_NOFILE is {hard}; "
                "raise the limit or disk.segment_bytes"
            )
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def start_engine(state: TierState) -> None:
    """Open the I/O engine unless one was given, and register the segment files with it."""
    from kvd.io.engine import Op, open_engine

    state.op_read, state.op_write = Op.READ, Op.WRITE
    if state.engine is None:
        state.engine = open_engine(kind=state.config.io_engine, queue_depth=state.config.queue_depth)
    state.engine.register_files(np.array(state.fds, dtype=np.int32))
