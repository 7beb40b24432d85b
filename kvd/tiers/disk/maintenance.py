"""The disk tier's removal, sync and compaction: what frees slots and keeps the
manifests durable and small.

  * remove: REMOVE records appended per drive; a slot may take new bytes
    once its REMOVE is durable (the write path syncs first if need be);
  * delete: a client's Delete is synced whatever the policy, and the
    block's first page overwritten with a tombstone (`shred`);
  * sync: every drive's segments, then its manifest (TierState.sync_drive);
  * compaction: a manifest past its size limit rewritten as a snapshot,
    the data of its records synced before the snapshot is published.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from kvd.invariants import check
from kvd.io.engine import address_of, aligned_empty
from kvd.tiers.disk.journal import FsyncPolicy
from kvd.tiers.disk.records import RemoveRecord
from kvd.tiers.disk.layout import ALIGN_BYTES, drive_of, locate_many
from kvd.tiers.disk.state import TierState

# The first bytes of the page `shred` writes over a deleted block (random bytes follow).
TOMBSTONE_MAGIC = b"kvd-deleted-block\0"


class Maintenance:
    """Removal, shredding, sync and compaction over a TierState (their contracts:
    DiskTier.remove_blocks, sync, compact_if_needed; shred's below)."""

    def __init__(self, state: TierState) -> None:
        self.state = state
        # The page `shred` writes over deleted blocks (4 KiB aligned, for O_DIRECT).
        self.tombstone = aligned_empty(ALIGN_BYTES)

    def remove_blocks(
        self, namespace_id: bytes, keys_and_slots: Sequence[tuple[bytes, int]], *, deleted: bool = False
    ) -> list[bool]:
        """See DiskTier.remove_blocks."""
        state = self.state
        ok = np.ones(len(keys_and_slots), dtype=bool)
        by_drive = self._journalled_by_drive(namespace_id, keys_and_slots)
        for drive, members in sorted(by_drive.items()):
            if drive in state.failed_drives:
                ok[members] = False
                continue
            manifest = state.manifests[drive]
            records = [RemoveRecord(manifest.sequence(), namespace_id, keys_and_slots[i][0]) for i in members]
            if not state.append(drive, records):
                ok[members] = False
                continue
            slots = [keys_and_slots[i][1] for i in members]
            for slot in slots:
                del state.owners[slot]
            if deleted:
                if not state.sync_drive(drive, force=True):
                    ok[members] = False
            elif state.config.fsync_policy == FsyncPolicy.GROUP:
                state.unsynced_removals[drive].update(slots)
        if deleted:
            # Every deleted block, even where the REMOVE failed: its record
            # may then come back at a restart, but never its bytes.
            self.shred([slot for members in by_drive.values() for slot in (keys_and_slots[i][1] for i in members)])
        return ok.tolist()

    def _journalled_by_drive(self, namespace_id: bytes,
                             keys_and_slots: Sequence[tuple[bytes, int]]) -> dict[int, list[int]]:
        """The positions of the blocks that need a REMOVE, by drive."""
        state = self.state
        by_drive: dict[int, list[int]] = {}
        for position, (key, slot) in enumerate(keys_and_slots):
            drive = drive_of(state.config, slot)
            if slot not in state.owners and drive not in state.failed_drives:
                # A write that failed before its PUT was journalled (EIO,
                # ENOSPC, a short write, a failed fdatasync): the engine
                # cannot tell that from a failed append and asks for a
                # REMOVE, but no record names the block. A failed append
                # fails the drive, so on a working drive nothing is left to
                # remove: the slot is free.
                continue
            check(
                slot not in state.owners or state.holds(slot, namespace_id, key),
                f"removing key {key.hex()[:16]} from slot {slot}, which does not hold it",
            )
            by_drive.setdefault(drive, []).append(position)
        return by_drive

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
        state = self.state
        tombstone = self.tombstone
        tombstone[:] = 0
        marker = TOMBSTONE_MAGIC + os.urandom(16)
        tombstone[: len(marker)] = np.frombuffer(marker, dtype=np.uint8)
        slot_array = np.asarray(slots, dtype=np.int64)
        _, files, offsets = locate_many(state.config, slot_array)
        addresses = np.full(len(slot_array), address_of(tombstone), dtype=np.uint64)
        results = state.transfer(state.op_write, files, offsets, ALIGN_BYTES, addresses)
        good = np.asarray(results) == ALIGN_BYTES
        for index in np.unique(files[good]).tolist():
            if state.fdatasync(index) != 0:
                good[files == index] = False
        shredded = int(good.sum())
        state.stats.shredded += shredded
        if shredded < len(slot_array):
            state.stats.count_error("shred", len(slot_array) - shredded)
        return shredded

    def sync(self, *, force: bool = False) -> None:
        """See DiskTier.sync."""
        state = self.state
        for drive in range(state.config.drive_count):
            if drive not in state.failed_drives:
                state.sync_drive(drive, force=force)

    def compact_if_needed(self, max_bytes: int) -> int:
        """See DiskTier.compact_if_needed."""
        state = self.state
        compacted = 0
        for drive, manifest in enumerate(state.manifests):
            if drive in state.failed_drives or manifest.size_bytes <= max_bytes:
                continue
            # The snapshot is durable the moment it is published: the data of every record in it
            # goes to the drive first, as before any manifest sync.
            if not state.sync_segments(drive):
                continue
            try:
                manifest.compact()
            except OSError as error:
                # compact() has already moved on to the new manifest's name;
                # appends there would be invisible behind the old CURRENT.
                state.fail_drive(drive, f"manifest compaction failed: {error}")
                continue
            state.unsynced_removals[drive].clear()  # the snapshot is durable
            compacted += 1
        return compacted
