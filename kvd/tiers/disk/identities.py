"""Opening the drives' identities: each directory checked or created, its
IDENTITY read, written for a new drive, or migrated from an older format.

The first step of DiskTier.open (recovery.py runs it): the IDENTITY of every
drive is checked before anything is written to any of them (FORMAT.md,
IDENTITY). The file format itself is layout.py's.
"""

from __future__ import annotations

from pathlib import Path

from kvd.tiers.disk.layout import (
    FORMAT_VERSION,
    IDENTITY,
    DiskIdentityError,
    Identity,
    IdentityDamaged,
    holds_kvd_files,
    identities_for,
    read_identity,
    write_identity,
)
from kvd.tiers.disk.results import DiskRecovery
from kvd.tiers.disk.state import TierState, log


def open_identities(state: TierState, recovery: DiskRecovery) -> set[int]:
    """Read every drive's IDENTITY, quarantine the damaged ones, create the
    missing ones and migrate older ones; the drives created now."""
    found: list[Identity | None] = []
    for drive, directory in enumerate(state.config.directories):
        check_directory(directory, read_only=state.read_only)
        found.append(_read_drive_identity(state, drive, directory))
    expected, missing = identities_for(state.config, found, set(state.quarantined))
    for drive in missing:
        (state.config.directories[drive] / (IDENTITY + ".tmp")).unlink(missing_ok=True)
        write_identity(state.config.directories[drive], expected[drive])
        recovery.created_drives.append(drive)
    if not state.read_only:
        migrate(state, found, recovery)
    return set(missing)


def _read_drive_identity(state: TierState, drive: int, directory: Path) -> Identity | None:
    """A drive's IDENTITY; None where it is damaged (the drive quarantined) or
    missing (a new drive, or one quarantined for holding kvd's files without it)."""
    try:
        identity = read_identity(directory)
    except IdentityDamaged as damage:
        state.quarantine(drive, damage.path, damage.problem, None)
        identity = None
    if identity is None and drive not in state.quarantined:
        if holds_kvd_files(directory):
            state.quarantine(drive, directory / IDENTITY, "is missing, but the directory holds kvd's "
                             "manifest or segment files", None)
        elif state.read_only:
            raise DiskIdentityError(directory, "magic", "missing: not a kvd disk directory")
    return identity


def migrate(state: TierState, found: list[Identity | None], recovery: DiskRecovery) -> None:
    """Rewrite the IDENTITY of drives of an older format: every version
    this kvd reads is a subset of the one it writes (FORMAT.md), so the
    drive's files stay as they are."""
    for drive, identity in enumerate(found):
        if identity is None or drive in state.quarantined or identity.format_version == FORMAT_VERSION:
            continue
        directory = state.config.directories[drive]
        write_identity(directory, identity.migrated)
        recovery.migrated_drives.append(drive)
        log.warning("disk directory migrated to a newer format; a kvd older than this one can no longer "
                    "open it", extra={"directory": str(directory), "from_version": identity.format_version,
                                      "to_version": FORMAT_VERSION})


def check_directory(directory: Path, *, read_only: bool) -> None:
    """The drive directory exists, or is created; its parent never is."""
    if read_only:
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
