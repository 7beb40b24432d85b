"""The disk tier's write path: namespaces registered, blocks written and journalled.

A chunk of blocks goes to the drive in one batch while the checksums of
its layers are computed from the same source memory; then its data is
made durable as the fsync policy says, and its PUT records appended to
each drive's manifest. A block is reported written only if every step
succeeded (FORMAT.md, write order):

    check -> submit data (crc32c meanwhile) -> wait -> sync data -> append PUTs

write_chunks pipelines chunks: chunk k+1 is at the drive while chunk k is
synced and journalled. A reused slot's REMOVE is made durable before new
bytes go into it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvd.core.keys import KEY_BYTES
from kvd.errors import InvalidArgument
from kvd.invariants import check
from kvd.io.checksum import crc32c_chunks
from kvd.tiers.disk.journal import FsyncPolicy
from kvd.tiers.disk.records import ROOT_PARENT, PutRecord
from kvd.tiers.disk.layout import ALIGN_BYTES, locate_many
from kvd.tiers.disk.registry import NamespaceEntry, decode_spec
from kvd.tiers.disk.results import error_kind
from kvd.tiers.disk.state import TierState

WriteItem = tuple[bytes, bytes, int, int]  # key, parent key (b"" for a root), slot, source address


@dataclass(slots=True, eq=False)
class PendingWrite:
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


class BlockWriter:
    """The write path over a TierState (its contract: DiskTier.register_namespace, write_chunks)."""

    def __init__(self, state: TierState) -> None:
        self.state = state

    def register_namespace(self, namespace_id: bytes, spec_encoding: bytes) -> NamespaceEntry:
        """See DiskTier.register_namespace."""
        state = self.state
        try:
            spec = decode_spec(spec_encoding)
        except InvalidArgument as error:
            raise InvalidArgument(f"cannot register namespace {namespace_id.hex()[:16]}: {error.message}") from None
        if spec.namespace_id() != namespace_id:
            raise InvalidArgument(f"namespace {namespace_id.hex()[:16]} is not the digest of the spec given")
        entry = NamespaceEntry(namespace_id, spec_encoding, spec)
        known = state.namespaces.get(namespace_id)
        if known is not None:
            if known.encoding != spec_encoding:
                raise InvalidArgument(f"namespace {namespace_id.hex()[:16]} is on disk with another spec encoding")
            return known
        for drive, registry in enumerate(state.registries):
            if drive not in state.quarantined:  # untouched until fsck --repair; it completes them at reopen
                registry.add(entry)
        state.namespaces[namespace_id] = entry
        return entry

    def write_chunks(
        self, namespace_id: bytes, layer_bytes: int, num_layers: int, chunks: Sequence[Sequence[WriteItem]],
        stop: Callable[[], bool] | None = None,
    ) -> list[list[bool]]:
        """See DiskTier.write_chunks."""
        self.state.check_shape(namespace_id, layer_bytes, num_layers)
        done: list[list[bool]] = []
        pending: PendingWrite | None = None
        try:
            for chunk in chunks:
                if pending is not None and stop is not None and stop():
                    break
                # The newest chunk is `pending` before the one behind it is finished, so that
                # should finishing fail, the newest is still waited for below.
                previous, pending = pending, self._start(namespace_id, layer_bytes, num_layers, chunk)
                if previous is not None:
                    done.append(self._finish(previous))
        finally:
            if pending is not None:  # (also on an error: never leave a batch reading its source behind)
                done.append(self._finish(pending))
        return done

    def _start(self, namespace_id: bytes, layer_bytes: int, num_layers: int,
               items: Sequence[WriteItem]) -> PendingWrite:
        """Check one chunk, and submit its data writes (the checksums computed meanwhile)."""
        state = self.state
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
        check(all(int(slot) not in state.owners for slot in slots), "writing into a slot whose block was not removed")
        drives, files, offsets = locate_many(state.config, slots)
        ok = self._sync_reused_slots(drives, slots)
        block_bytes = layer_bytes * num_layers
        pending = PendingWrite(namespace_id, keys, parents, slots, drives, files, ok, np.nonzero(ok)[0], block_bytes)
        if pending.chosen.size:  # (a block's layers are contiguous in the slot and in the source)
            pending.batch = state.submit(state.op_write, files[pending.chosen], offsets[pending.chosen], block_bytes,
                                         sources[pending.chosen])
        try:
            # Computed from the source while the drive writes it (one native call, the GIL
            # released): the drive and the checksum read the same pinned bytes. Should the
            # source change under us anyway, the record disagrees with the disk and the block
            # reads back as corrupt (a miss), never as wrong bytes.
            pending.checksums = crc32c_chunks(sources, layer_bytes, num_layers)
        except BaseException:
            if pending.batch >= 0:
                state.engine.wait(pending.batch)
            raise
        return pending

    def _finish(self, pending: PendingWrite) -> list[bool]:
        """Wait for a chunk's data, clear `ok` where a write fell short, sync, journal it."""
        state = self.state
        ok = pending.ok
        if pending.batch >= 0:
            results = state.engine.wait(pending.batch)
            for position, result in zip(pending.chosen.tolist(), results.tolist(), strict=True):
                if result == pending.block_bytes:
                    state.stats.bytes_written += pending.block_bytes
                else:
                    ok[position] = False
                    state.stats.count_error(error_kind(result, "short_write"))
        self.sync_data(ok, pending.drives, pending.files)
        for drive in np.unique(pending.drives[ok]).tolist():
            self._journal(pending, drive)
        written = int(ok.sum())
        state.stats.blocks_written += written
        state.stats.write_failures += len(ok) - written
        return ok.tolist()

    def _journal(self, pending: PendingWrite, drive: int) -> None:
        """Append the PUT records of a chunk's blocks still ok on one drive; they
        own their slots once appended, and are failed in `ok` when not."""
        state = self.state
        ok = pending.ok
        members = np.nonzero(ok & (pending.drives == drive))[0].tolist()
        manifest = state.manifests[drive]
        records = [
            PutRecord(manifest.sequence(), pending.namespace_id, pending.keys[i], pending.parents[i],
                      int(pending.slots[i]), pending.checksums[i].astype("<u4").tobytes())
            for i in members
        ]
        if state.append(drive, records):
            for record in records:
                state.owners[record.location] = record
        else:
            ok[members] = False

    def sync_data(self, ok: np.ndarray, drives: np.ndarray, files: np.ndarray) -> None:
        """Make the written data durable as the policy says, before its records are.

        STRICT: fdatasync every segment file written, now (a failure clears
        `ok` for its blocks). GROUP: the files wait for the drive's next
        sync, which flushes them before the manifest. NONE: at the next forced
        sync only (a client waiting for durability, a Delete); a record that
        outlives its data after a power loss reads back as a checksum
        failure, a miss, never wrong bytes.
        """
        state = self.state
        if state.config.fsync_policy != FsyncPolicy.STRICT:
            for drive, index in set(zip(drives[ok].tolist(), files[ok].tolist())):
                state.unsynced_data[drive].add(index)
            return
        for index in np.unique(files[ok]).tolist():
            result = state.fdatasync(index)
            if result != 0:
                ok[files == index] = False
                state.stats.count_error("fsync_" + error_kind(result, "fsync"))

    def _sync_reused_slots(self, drives: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Which items may be written: their drive takes writes, and the REMOVE
        of each reused slot's previous block is durable first (FORMAT.md, write order)."""
        state = self.state
        ok = np.array([int(drive) not in state.failed_drives for drive in drives], dtype=bool)
        if not ok.all():
            state.stats.count_error("drive_failed", int((~ok).sum()))
        for drive in np.unique(drives[ok]).tolist():
            pending = state.unsynced_removals[drive]
            if pending and not pending.isdisjoint(slots[drives == drive].tolist()):
                state.sync_drive(drive)
                ok &= np.array([int(d) not in state.failed_drives for d in drives], dtype=bool)
        return ok
