"""DiskTier.open: from the drives' files to a tier ready for I/O, without
reading any block data.

The order (FORMAT.md, Recovery): identities (identities.py), registries,
segment sizes (segments.py), manifest replay, then every live record
validated against the namespaces, the capacity and the segment files; the
records that cannot be read back right are dropped and counted (a
`DiskRecovery`), and a manifest that lost any is compacted without them
before a slot of theirs can take new bytes. Then the registries and
segments are completed, the files opened, the engine started, and
whatever a killed run left in the page cache is synced. Damage that
cannot be read quarantines its drive alone (TierState.quarantine).
"""

from __future__ import annotations

from collections.abc import Iterable

from kvd.invariants import check
from kvd.tiers.disk.identities import open_identities
from kvd.tiers.disk.journal import Manifest, MetadataDamage, ReplayReport
from kvd.tiers.disk.records import PutRecord
from kvd.tiers.disk.layout import DiskIdentityError, drive_of, file_index, locate, split_location, valid_location
from kvd.tiers.disk.registry import NamespaceRegistry, RegistryReport
from kvd.tiers.disk.results import DiskRecovery
from kvd.tiers.disk.segments import complete_segments, inspect_segments, open_files, start_engine
from kvd.tiers.disk.state import TierState, log


def recover(state: TierState) -> DiskRecovery:
    """Validate or create the drives, replay the manifests; see DiskTier.open."""
    recovery = DiskRecovery()
    fresh = open_identities(state, recovery)
    _open_registries(state, recovery)
    inspect_segments(state, recovery, fresh)
    _open_manifests(state, recovery)
    _keep_valid_records(state, recovery)
    if not state.read_only:
        _complete_registries(state, recovery)
        complete_segments(state)
    open_files(state)
    start_engine(state)
    if not state.read_only:
        _sync_found(state)
    recovery.quarantined = dict(state.quarantined)
    log.info(
        "disk tier open",
        extra={
            "drives": state.config.drive_count,
            "quarantined_drives": len(state.quarantined),
            "blocks": recovery.block_count,
            "dropped": recovery.dropped.total,
            "truncated_bytes": recovery.truncated_bytes,
            "damaged_bytes": recovery.damaged_bytes,
            "lost_records": recovery.lost_records,
        },
    )
    return recovery


def _open_registries(state: TierState, recovery: DiskRecovery) -> None:
    """Read every drive's NAMESPACES into state.namespaces; drives must agree on each encoding."""
    for drive, directory in enumerate(state.config.directories):
        registry = NamespaceRegistry(directory, state.fs, read_only=state.read_only or drive in state.quarantined)
        report = RegistryReport()
        if drive not in state.quarantined:
            try:
                report = registry.open()
            except OSError as error:
                state.quarantine(drive, registry.path, f"cannot be read ({error.strerror or error})", None)
        recovery.registries.append(report)
        recovery.truncated_bytes += report.truncated_bytes
        recovery.damaged_bytes += report.damaged_bytes
        state.registries.append(registry)
        for namespace_id, entry in registry.entries.items():
            known = state.namespaces.setdefault(namespace_id, entry)
            if known.encoding != entry.encoding:
                raise DiskIdentityError(
                    directory, "namespace_id", f"{namespace_id.hex()[:16]} differs from another drive's", file="NAMESPACES"
                )
    recovery.namespaces = dict(state.namespaces)


def _complete_registries(state: TierState, recovery: DiskRecovery) -> None:
    """A crash inside register_namespace (or damage to one drive's file)
    can leave some drives without an entry the others have; complete
    them so every drive is whole (quarantined ones are not touched)."""
    for drive, registry in enumerate(state.registries):
        if drive in state.quarantined:
            continue
        if recovery.registries[drive].damaged_regions:
            registry.rewrite()  # without the damage, which a later open would meet again
        for entry in state.namespaces.values():
            registry.add(entry)


def _open_manifests(state: TierState, recovery: DiskRecovery) -> None:
    """Replay every drive's manifest into state.manifests (an empty one for a quarantined drive)."""
    config = state.config
    for drive, directory in enumerate(config.directories):
        manifest = Manifest(directory, config.fsync_policy, state.fs)
        report = ReplayReport()
        if drive not in state.quarantined:
            try:
                report = manifest.open(create=not state.read_only, in_use=state.has_segments(drive))
            except MetadataDamage as damage:
                manifest = Manifest(directory, config.fsync_policy, state.fs)  # nothing replayed
                state.quarantine(drive, damage.path, damage.problem, damage.blocks)
        state.manifests.append(manifest)
        recovery.manifests.append(report)
        recovery.records += report.records
        recovery.truncated_bytes += report.truncated_bytes
        recovery.damaged_bytes += report.damaged_bytes
        recovery.lost_records += report.lost_records


def _keep_valid_records(state: TierState, recovery: DiskRecovery) -> None:
    """Drop (and count) every live record that cannot be read back right."""
    dropped = recovery.dropped
    for drive, manifest in enumerate(state.manifests):
        doomed: list[tuple[bytes, bytes]] = []
        for record in manifest.live.values():
            reason = _record_problem(state, drive, record)
            if reason is not None:
                setattr(dropped, reason, getattr(dropped, reason) + 1)
                doomed.append((record.namespace_id, record.key))
                continue
            slot = record.location
            older = state.owners.get(slot)
            if older is not None:
                # Two live records claim one slot: only the newer one's
                # bytes can be there. (Never after a correct REMOVE.)
                dropped.duplicate_slot += 1
                if older.sequence > record.sequence:
                    doomed.append((record.namespace_id, record.key))
                    continue
                doomed.append((older.namespace_id, older.key))
            state.owners[slot] = record
        for identity in doomed:
            manifest.live.pop(identity, None)
        for record in _overlapping(manifest.live.values()):
            dropped.duplicate_slot += 1
            doomed.append((record.namespace_id, record.key))
            manifest.live.pop((record.namespace_id, record.key))
            del state.owners[record.location]
        if (doomed or recovery.manifests[drive].damaged) and not state.read_only:
            # A snapshot without them, durable before any of their slots
            # (or a re-created segment) can take new bytes; and without
            # the damage, which a later replay would otherwise meet again.
            manifest.compact()
    for manifest in state.manifests:
        for record in manifest.live.values():
            recovery.blocks.setdefault(record.namespace_id, []).append(record)
    check(len(state.owners) == recovery.block_count, "a kept record lost its slot")


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


def _record_problem(state: TierState, drive: int, record: PutRecord) -> str | None:
    """Why a live record cannot be kept (a DroppedCounts field), or None."""
    config = state.config
    slot = record.location
    if not valid_location(config, slot) or drive_of(config, slot) != drive:
        return "out_of_range"
    entry = state.namespaces.get(record.namespace_id)
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
    if int(state.file_sizes[place.file_index]) < place.offset + extent_bytes:
        return "missing_segment"
    return None


def _sync_found(state: TierState) -> None:
    """Sync every segment and manifest found: a previous run that was killed
    may have left writes in the page cache, and what this run serves as
    durable must be."""
    per_drive = state.config.segments_per_drive
    for drive in range(len(state.manifests)):
        if drive in state.failed_drives:
            continue
        first = file_index(state.config, drive, 0)
        state.unsynced_data[drive].update(
            index for index in range(first, first + per_drive) if state.file_sizes[index] >= 0)
        state.sync_drive(drive, force=True)  # (a replayed manifest counts as unsynced)
