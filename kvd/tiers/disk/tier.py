"""The disk tier's bytes: segment files on one or more drives, behind one facade.

`DiskTier` owns everything that touches the drives: IDENTITY, segment
files, O_DIRECT reads and writes through the batched I/O engine (kvd.io),
layer checksums, the per-drive manifests (journal.Manifest) and namespace
registries. Which block sits in which slot, eviction and promotion are the
engine's (kvd.core); this tier only moves the bytes and keeps the records
that let a restart find them again. See FORMAT.md for the layout. Its
parts, one job each, all working on one `TierState`:

| module | job |
|---|---|
| state.py | the open tier's state; the drive primitives the jobs share (a batch, an fdatasync, a manifest append, a drive's sync, failing or quarantining a drive) |
| results.py | what the tier reports: DiskRecovery, DiskStats, ReadFailure, ... |
| identities.py | drive directories and their IDENTITY: checked, created, migrated |
| recovery.py | open: registries, manifest replay, every record validated, the damage counted |
| segments.py | the segment files at open: measured, completed, opened, the engine started |
| writes.py | namespaces registered; blocks written, their data synced, their PUTs journalled |
| reads.py | blocks read in layer groups or block runs, every layer verified |
| maintenance.py | removal, shredding, sync and compaction |

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
    block's first page overwritten (maintenance.py's `shred`);
  * damage: a drive whose IDENTITY, CURRENT or live manifest cannot be
    read is quarantined alone (read and written no more, its blocks lost);
    damage inside a manifest costs only the records it hit.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Self

import numpy as np

from kvd.core.keys import NamespaceSpec
from kvd.invariants import check
from kvd.io.engine import address_of
from kvd.tiers.disk.fs import FileSystem
from kvd.tiers.disk.records import PutRecord
from kvd.tiers.disk.layout import ALIGN_BYTES, Admission, DiskConfig, drive_of
from kvd.tiers.disk.maintenance import TOMBSTONE_MAGIC, Maintenance
from kvd.tiers.disk.reads import BlockReader, BlocksCallback, LayerCallback, Places, ReadItem, ReadOptions
from kvd.tiers.disk.recovery import recover
from kvd.tiers.disk.registry import NamespaceEntry
from kvd.tiers.disk.results import DiskRecovery, DiskStats, DriveDamage, DroppedCounts, ReadFailure
from kvd.tiers.disk.state import ReadOnlyFileSystem, TierState
from kvd.tiers.disk.writes import BlockWriter, WriteItem

# Importable from here as before the tier was split into parts. The read path's
# tunables (READ_AHEAD_BYTES, BLOCK_PARTS, ...) are not: they live, and are
# patched by tests, in reads.py.
__all__ = [
    "TOMBSTONE_MAGIC", "BlocksCallback", "DiskRecovery", "DiskStats", "DiskTier", "DriveDamage", "DroppedCounts",
    "LayerCallback", "ReadFailure", "ReadItem", "ReadOnlyFileSystem", "WriteItem",
]


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
        self._state = state = TierState(config, engine=engine, fs=fs, read_only=read_only)
        self._writer = BlockWriter(state)
        self._reader = BlockReader(state)
        self._maintenance = Maintenance(state)
        # What callers read: the state's own objects, which it never rebinds.
        self.config = config
        self.read_only = read_only
        self.stats: DiskStats = state.stats
        self.namespaces: dict[bytes, NamespaceEntry] = state.namespaces  # every namespace the registries hold
        self.failed_drives: dict[int, str] = state.failed_drives  # per drive: why it takes no more writes
        # Per drive whose metadata cannot be read: why (it is in failed_drives too).
        self.quarantined: dict[int, DriveDamage] = state.quarantined

    # -- admission ------------------------------------------------------

    def accepts(self, spec: NamespaceSpec) -> Admission:
        """Whether blocks of `spec` can go to disk, and if not, why."""
        return self._state.config.admit(spec.layer_bytes, spec.num_layers)

    # -- open -------------------------------------------------------------

    def open(self) -> DiskRecovery:
        """Validate or create the drives, replay the manifests; reads no block data.

        Raises DiskIdentityError for a directory that belongs to something
        else. Damage that only loses blocks (torn tails, missing or short
        segments) is repaired and counted in the returned DiskRecovery.
        """
        check(not self._state.opened, "disk tier opened twice")
        self._state.opened = True
        try:
            return recover(self._state)
        except BaseException:
            self.close()  # release whatever files and engine were opened
            raise

    # -- namespaces -------------------------------------------------------

    def register_namespace(self, namespace_id: bytes, spec_encoding: bytes) -> NamespaceEntry:
        """Record a namespace on every drive; durable when this returns.

        Idempotent. InvalidArgument if the encoding is not a spec whose
        digest is `namespace_id`.
        """
        self._state.check_writable()
        return self._writer.register_namespace(namespace_id, spec_encoding)

    # -- write ------------------------------------------------------------

    def write_chunks(
        self, namespace_id: bytes, layer_bytes: int, num_layers: int, chunks: Sequence[Sequence[WriteItem]],
        stop: Callable[[], bool] | None = None,
    ) -> list[list[bool]]:
        """Write each chunk of blocks into their slots and journal them; per-item durable.

        A chunk's items: (key, parent key or b"" for a root, slot, source
        address of the block, layer-major, 4 KiB aligned); it goes to the
        drive as one batch. A slot must be free: never written, or its block
        removed. Failures (EIO, ENOSPC, short writes, a failed fdatasync or
        manifest append) are False, never exceptions.
        Chunks are pipelined: chunk k+1 is at the drive while chunk k is
        finished (synced as the policy says, journalled), so the drive never
        drains between chunks. Before each chunk after the first, `stop()`
        (if given) may end the run: the chunks not started are not written.
        Returns one ok list per chunk written, in order.
        """
        self._state.check_writable()
        return self._writer.write_chunks(namespace_id, layer_bytes, num_layers, chunks, stop)

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
        record). Layers are read in groups: layer 0 alone, then groups
        doubling up to about config.read_extent_bytes (reads.layer_groups),
        ONE batch of N extents per group, so O(L) submissions at most. Later groups are in flight
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
        options = ReadOptions(on_layer, failures, between_groups, whole_blocks, on_blocks)
        return self._reader.read_blocks(namespace_id, layer_bytes, num_layers, items, options)

    def places(self, namespace_id: bytes, layer_bytes: int, num_layers: int,
               keys_and_slots: Sequence[tuple[bytes, int]]) -> Places:
        """Where each block lies on the drives and what each of its layers must checksum to, for a
        reader that reads them itself (a pool's I/O ring proxy, through segment_fds()); the
        caller keeps the blocks from moving or going while it reads (a lease in the core)."""
        return self._reader.places(namespace_id, layer_bytes, num_layers, keys_and_slots)

    def segment_fds(self) -> list[int]:
        """The segment files' descriptors (O_DIRECT), by file index; a placeholder where a file is
        absent. Owned by the tier: a reader that keeps them past close() duplicates them."""
        self._state.check_open()
        return list(self._state.fds)

    # -- remove -----------------------------------------------------------

    def remove_blocks(
        self, namespace_id: bytes, keys_and_slots: Sequence[tuple[bytes, int]], *, deleted: bool = False
    ) -> list[bool]:
        """Journal the removal of blocks; their slots may then be written again.

        Under STRICT the REMOVE records are durable when this returns; under
        GROUP at the next sync(), and write_chunks syncs first if it is
        handed one of these slots before then. False: the drive's manifest
        failed; the slot stays unusable until the tier is reopened. A slot
        no record names (its write failed before the PUT was journalled)
        needs nothing journalled: True at once.

        deleted: a client's Delete. Its REMOVE records are durable when this
        returns whatever the fsync policy (False where they are not), and
        the first page of each block is overwritten with a tombstone
        (maintenance.py's `shred`), so that even a manifest damaged later,
        which could lose the REMOVE and bring the PUT record back, can never
        serve the bytes: the block's layer 0 no longer matches its checksum.
        """
        self._state.check_writable()
        return self._maintenance.remove_blocks(namespace_id, keys_and_slots, deleted=deleted)

    # -- maintenance --------------------------------------------------------

    def sync(self, *, force: bool = False) -> None:
        """Make every appended record durable (GROUP: the daemon's timer calls
        this); `force`: under NONE too (a Delete: see remove_blocks)."""
        self._state.check_open()
        self._maintenance.sync(force=force)

    def compact_if_needed(self, max_bytes: int) -> int:
        """Rewrite each manifest larger than max_bytes as a snapshot; how many were."""
        self._state.check_writable()
        return self._maintenance.compact_if_needed(max_bytes)

    # -- records ------------------------------------------------------------

    def key_of(self, slot: int) -> bytes:
        record = self._state.owners.get(slot)
        check(record is not None, f"disk slot {slot} holds no block")
        return record.key

    def layer_checksums_of(self, slot: int) -> bytes:
        record = self._state.owners.get(slot)
        check(record is not None, f"disk slot {slot} holds no block")
        return record.layer_checksums

    def live_records(self) -> list[PutRecord]:
        """Every live block's record, all drives (fsck walks these)."""
        return [record for manifest in self._state.manifests for record in manifest.live.values()]

    # -- the engine and the files ---------------------------------------------

    @property
    def engine(self) -> object:
        """The I/O engine (tests inject faults through it)."""
        return self._state.engine

    def register_buffers(self, regions: Sequence[tuple[int, int]]) -> None:
        """Pass (address, nbytes) regions, e.g. the host arena, to the I/O
        engine to register: only a speed-up (the kernel skips pinning pages
        per I/O); OSError when the kernel refuses (RLIMIT_MEMLOCK)."""
        self._state.check_open()
        # The tombstone page too: every address the tier hands the engine then
        # lies in a registered buffer (debug builds of kvd._native check it).
        tombstone = self._maintenance.tombstone
        self._state.engine.register_buffers([*regions, (address_of(tombstone), ALIGN_BYTES)])

    @property
    def closed(self) -> bool:
        """Whether close() has run (it is idempotent). Only tests ask (did a daemon's
        shutdown close its tier?); it stays here because that is the tier's own state,
        which nothing else it shows would tell."""
        return self._state.closed

    def close(self) -> None:
        """Sync what the policy syncs, stop the engine, close the files. Idempotent."""
        state = self._state
        if state.closed:
            return
        state.closed = True
        if state.opened and not state.read_only:
            for drive in range(len(state.manifests)):
                if drive not in state.failed_drives:
                    state.sync_drive(drive)
        if state.engine is not None and state.owns_engine:
            state.engine.close()
        for fd in set(state.fds):
            os.close(fd)
        state.fds = []

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- checks -------------------------------------------------------------

    def verify(self) -> None:
        """Cross-check the slot map against the manifests (tests call it)."""
        state = self._state
        check(self.stats is state.stats and self.namespaces is state.namespaces
              and self.failed_drives is state.failed_drives and self.quarantined is state.quarantined,
              "the tier's state rebound an object its facade shows")
        owners: dict[int, PutRecord] = {}
        for drive, manifest in enumerate(state.manifests):
            for identity, record in manifest.live.items():
                check(identity == (record.namespace_id, record.key), "manifest live map keyed wrongly")
                check(drive_of(self.config, record.location) == drive, "record on the wrong drive")
                check(record.location not in owners, "slot {} held twice", record.location)
                owners[record.location] = record
        check(owners == state.owners, "slot owners differ from the manifests")
