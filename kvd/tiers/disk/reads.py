"""The disk tier's read path: blocks read in layer order, every layer verified.

A read is never trusted before its checksum: the engine computes each
layer's crc32c as the layer lands (the GIL released), and this module
compares whole arrays of them with the layer checksums of the blocks'
records. A block with any bad layer is a miss, its first failure told in
a ReadFailure code; blocks failing their checksum are counted per
namespace and logged (damage is never silent).

Two shapes of read:

  layer groups   one batch per group of `width` layers, every block in it;
                 later groups in flight while one is checked (read-ahead)
  block parts    whole blocks in up to BLOCK_PARTS consecutive runs, all
                 submitted at once, each reported as it is verified
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvd.invariants import check
from kvd.logbudget import LogBudget
from kvd.tiers.disk.layout import ALIGN_BYTES, drive_of, locate_many
from kvd.tiers.disk.results import ReadFailure, error_kind
from kvd.tiers.disk.state import TierState, log

# key, slot, destination address, layer checksums (packed u32le, as in PutRecord)
ReadItem = tuple[bytes, int, int, bytes]
# How read_blocks hands progress to its caller: (layer, ok mask of all blocks).
LayerCallback = Callable[[int, np.ndarray], None]
# ... or, for whole blocks: (stop, ok mask of all blocks): blocks [0, stop) are done.
BlocksCallback = Callable[[int, np.ndarray], None]
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


def entry_layers(layer_bytes: int, num_layers: int) -> int:
    """Layers per entry of a block read in runs: the most that divide num_layers and
    fit BLOCK_ENTRY_MAX_BYTES (one layer if even that does not fit)."""
    fitting = [width for width in range(1, num_layers + 1)
               if num_layers % width == 0 and width * layer_bytes <= BLOCK_ENTRY_MAX_BYTES]
    return max(fitting, default=1)


def block_results(results: np.ndarray, pieces: int, piece_bytes: int) -> np.ndarray:
    """Per-block results from per-entry ones (`pieces` entries a block): the whole block's
    length if every entry read in full, else the first entry's result that did not."""
    per_block = results.reshape(-1, pieces)
    full = per_block == piece_bytes
    first_bad = per_block[np.arange(per_block.shape[0]), np.argmin(full, axis=1)]
    return np.where(full.all(axis=1), pieces * piece_bytes, first_bad)


def _report_layers(on_layer: LayerCallback, first: int, stop: int, ok: np.ndarray, good_through) -> None:
    """on_layer for layers [first, stop): `ok` before the group, with the group's verdicts per
    layer (good_through: (positions read, [blocks, layers] good)) where it was read."""
    for layer in range(first, stop):
        mask = ok.copy()
        if good_through is not None:
            mask[good_through[0]] = good_through[1][:, layer - first]
        on_layer(layer, mask)


@dataclass(frozen=True, slots=True)
class ReadOptions:
    """How read_blocks reads and reports (each field: DiskTier.read_blocks's argument of that name)."""

    on_layer: LayerCallback | None = None
    failures: np.ndarray | None = None
    between_groups: Callable[[int, int], None] | None = None
    whole_blocks: bool = False
    on_blocks: BlocksCallback | None = None


@dataclass(frozen=True, slots=True, eq=False)
class Places:
    """Where blocks lie on the drives, for a reader that reads them itself: segment file index and
    byte offset per block (layer l at offset + l * layer_bytes), each layer's crc32c [blocks,
    layers], and whether each block's segment file is there at all."""

    files: np.ndarray
    offsets: np.ndarray
    checksums: np.ndarray
    present: np.ndarray


@dataclass(slots=True, eq=False)
class _ReadBatch:
    """One read_blocks call's blocks: where each is, where it goes, what it must checksum to,
    and the verdicts so far (`ok` and `reasons` are the caller's, updated in place)."""

    layer_bytes: int
    num_layers: int
    files: np.ndarray
    offsets: np.ndarray
    destinations: np.ndarray
    expected: np.ndarray  # (blocks, layers) crc32c of the records
    ok: np.ndarray
    reasons: np.ndarray


def layer_groups(num_layers: int, width: int) -> list[tuple[int, int]]:
    """[first, stop) of each group of layers a streamed restore reads as one batch: one layer, then
    twice as many each time up to `width` (about disk.read_extent_bytes). Layer 0 lands after a small
    part of the read, so an engine computes it while the rest is read; later groups get the large
    extents a drive reads fastest."""
    groups, first, size = [], 0, 1
    while first < num_layers:
        stop = min(first + size, num_layers)
        groups.append((first, stop))
        first, size = stop, min(2 * size, width)
    return groups


class BlockReader:
    """The read path over a TierState (its contract: DiskTier.read_blocks)."""

    def __init__(self, state: TierState) -> None:
        self.state = state
        self._corrupt_log = LogBudget(log, lines=20, per_s=60.0)

    def read_blocks(self, namespace_id: bytes, layer_bytes: int, num_layers: int, items: Sequence[ReadItem],
                    options: ReadOptions) -> np.ndarray:
        """See DiskTier.read_blocks."""
        state, on_blocks = self.state, options.on_blocks
        check(on_blocks is None or (options.whole_blocks and options.on_layer is None
                                    and options.between_groups is None),
              "on_blocks reports whole blocks, read in one group with nothing between groups")
        state.check_open()
        state.check_shape(namespace_id, layer_bytes, num_layers)
        count = len(items)
        ok = np.ones(count, dtype=bool)
        reasons = np.zeros(count, dtype=np.int8) if options.failures is None else options.failures
        check(reasons.shape == (count,) and reasons.dtype == np.int8, "failures must be int8, one per item")
        reasons[:] = ReadFailure.NONE
        if count == 0:
            return ok
        batch = self._targets(namespace_id, layer_bytes, num_layers, items, ok, reasons)
        if on_blocks is not None:
            self._read_block_parts(batch, on_blocks)
        else:
            width = max(1, min(num_layers, state.config.read_extent_bytes // layer_bytes))
            groups = [(0, num_layers)] if options.whole_blocks else layer_groups(num_layers, width)
            self._read_layer_groups(batch, groups, options.on_layer, options.between_groups)
        good = int(ok.sum())
        state.stats.blocks_read += good
        state.stats.read_failures += count - good
        if good < count:
            self._report_corrupt(namespace_id, items, reasons)
        return ok

    def places(self, namespace_id: bytes, layer_bytes: int, num_layers: int,
               keys_and_slots: Sequence[tuple[bytes, int]]) -> Places:
        """See DiskTier.places."""
        state = self.state
        state.check_open()
        state.check_shape(namespace_id, layer_bytes, num_layers)
        check(all(state.holds(slot, namespace_id, key) for key, slot in keys_and_slots),
              "placing a slot that does not hold the block asked for")
        slots = np.fromiter((slot for _, slot in keys_and_slots), dtype=np.int64, count=len(keys_and_slots))
        _, files, offsets = locate_many(state.config, slots)
        checksums = np.frombuffer(b"".join(state.owners[int(slot)].layer_checksums for slot in slots.tolist()),
                                  dtype="<u4").reshape(len(slots), num_layers)
        return Places(files, offsets, checksums, state.file_present[files])

    def _report_corrupt(self, namespace_id: bytes, items: Sequence[ReadItem], reasons: np.ndarray) -> None:
        """Count the blocks that failed their checksum, per namespace, and log each (drive,
        slot, namespace, key) within the log budget: damage is never silent."""
        corrupt = np.nonzero(reasons == ReadFailure.CHECKSUM)[0].tolist()
        if not corrupt:
            return
        counts = self.state.stats.corrupt_blocks
        counts[namespace_id] = counts.get(namespace_id, 0) + len(corrupt)
        for position in corrupt:
            key, slot = items[position][0], items[position][1]
            self._corrupt_log.warning(
                "disk block failed its checksum: lost (recomputed by whoever wanted it)",
                extra={"drive": drive_of(self.state.config, slot), "slot": slot, "namespace": namespace_id.hex()[:16],
                       "key": key.hex()[:16]})

    def _targets(self, namespace_id: bytes, layer_bytes: int, num_layers: int, items: Sequence[ReadItem],
                 ok: np.ndarray, reasons: np.ndarray) -> _ReadBatch:
        """Where each block is (file, offset), where it goes, its expected layer checksums;
        blocks whose segment is missing are failed in `ok` and `reasons`."""
        state = self.state
        count = len(items)
        slots = np.fromiter((item[1] for item in items), dtype=np.int64, count=count)
        destinations = np.fromiter((item[2] for item in items), dtype=np.uint64, count=count)
        check(all(len(item[3]) == 4 * num_layers for item in items), "every read item needs one checksum per layer")
        expected = np.frombuffer(b"".join(item[3] for item in items), dtype="<u4").reshape(count, num_layers)
        check(not np.any(destinations % ALIGN_BYTES), "destination addresses must be 4 KiB aligned for O_DIRECT")
        check(all(state.holds(item[1], namespace_id, item[0]) for item in items),
              "reading a slot that does not hold the block asked for")
        _, files, offsets = locate_many(state.config, slots)
        # A segment missing at a read-only open: its blocks were dropped, but
        # a caller may still ask (fsck of an explicit slot list).
        present = state.file_present[files]
        if not present.all():
            ok &= present
            reasons[~present] = ReadFailure.MISSING_SEGMENT
            state.stats.count_error("missing_segment", int((~present).sum()))
        return _ReadBatch(layer_bytes, num_layers, files, offsets, destinations, expected, ok, reasons)

    def _read_layer_groups(self, batch: _ReadBatch, groups: list[tuple[int, int]], on_layer: LayerCallback | None,
                           between_groups: Callable[[int, int], None] | None) -> None:
        """Each block in extents of whole layers, `groups` of them ([first,
        stop) each, in order; layer_groups): one batch per group, every
        block in it, so O(L / width + log width) submissions. Later
        groups are in flight while this one is checked: two at least, more
        (up to READ_AHEAD_GROUPS) while they hold at most READ_AHEAD_BYTES."""
        state, layer_bytes, num_layers, ok = self.state, batch.layer_bytes, batch.num_layers, batch.ok
        check(groups[0][0] == 0 and groups[-1][1] == num_layers and
              all(a[1] == b[0] for a, b in zip(groups, groups[1:])), "layer groups {} do not tile {} layers",
              groups, num_layers)
        # (group, batch id, positions, checksum cells, bytes) in order.
        flights: collections.deque[tuple[int, int, np.ndarray, np.ndarray, int]] = collections.deque()
        submitted = 0  # groups submitted (or skipped: no block left to read)

        def top_up() -> None:
            nonlocal submitted
            while submitted < len(groups):
                first, stop = groups[submitted]
                in_flight = sum(flight[4] for flight in flights)
                if len(flights) >= 2 and (len(flights) >= READ_AHEAD_GROUPS or
                                          in_flight + len(batch.files) * (stop - first) * layer_bytes
                                          > READ_AHEAD_BYTES):
                    return
                flight = self._submit_group(batch, submitted, first, stop)
                if flight is not None:
                    flights.append(flight)
                submitted += 1

        try:
            for group, (first, stop) in enumerate(groups):
                top_up()  # the drive works on the next groups while this one is checked
                good_through = None
                if flights and flights[0][0] == group:
                    _, batch_id, chosen, cells, _ = flights.popleft()
                    results = state.engine.wait(batch_id)
                    good_through = self._verify_group(batch, first, stop, chosen, results, cells)
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
                state.engine.wait(flights.popleft()[1])

    def _submit_group(self, batch: _ReadBatch, group: int, first: int,
                      stop: int) -> tuple[int, int, np.ndarray, np.ndarray, int] | None:
        """Submit layers [first, stop) of the blocks still good; the flight, None when none is."""
        chosen = np.nonzero(batch.ok)[0]  # blocks already failed are not read further
        if chosen.size == 0:
            return None
        layer_bytes = batch.layer_bytes
        shift = first * layer_bytes
        # The engine checksums every layer as it lands (the GIL released,
        # the drive kept busy meanwhile); this thread only compares.
        cells = np.empty(chosen.size * (stop - first), dtype=np.uint32)
        batch_id = self.state.submit(
            self.state.op_read, batch.files[chosen], batch.offsets[chosen] + shift, (stop - first) * layer_bytes,
            batch.destinations[chosen] + np.uint64(shift), checksums=cells, checksum_chunk=layer_bytes,
        )
        return group, batch_id, chosen, cells, chosen.size * (stop - first) * layer_bytes

    def _read_block_parts(self, batch: _ReadBatch, on_blocks: BlocksCallback) -> None:
        """Whole blocks in up to BLOCK_PARTS consecutive runs, one batch each,
        all submitted at once; on_blocks after each run is verified, in order.

        A block larger than BLOCK_ENTRY_MAX_BYTES goes as several entries of
        whole layers, in block order. The engine's ring then admits entries
        in that order as earlier ones complete, so the first runs land
        first; a few huge entries would all be in flight from the start and
        land together, at the end."""
        state, layer_bytes, num_layers, ok = self.state, batch.layer_bytes, batch.num_layers, batch.ok
        count = len(batch.files)
        bounds = np.linspace(0, count, min(BLOCK_PARTS, count) + 1).astype(np.int64).tolist()
        width = entry_layers(layer_bytes, num_layers)
        pieces = num_layers // width
        shifts = np.arange(pieces, dtype=np.int64) * (width * layer_bytes)
        # (stop, batch id or -1 when nothing was read, positions, checksum cells) in order.
        flights: collections.deque[tuple[int, int, np.ndarray, np.ndarray]] = collections.deque()
        try:
            for start, stop in zip(bounds[:-1], bounds[1:]):
                chosen = start + np.nonzero(ok[start:stop])[0]  # a missing segment is not read
                cells = np.empty(chosen.size * num_layers, dtype=np.uint32)
                batch_id = -1 if chosen.size == 0 else state.submit(
                    state.op_read, np.repeat(batch.files[chosen], pieces),
                    (batch.offsets[chosen, None] + shifts).ravel(), width * layer_bytes,
                    (batch.destinations[chosen, None] + shifts.astype(np.uint64)).ravel(),
                    checksums=cells, checksum_chunk=layer_bytes)
                flights.append((stop, batch_id, chosen, cells))
            while flights:
                stop, batch_id, chosen, cells = flights[0]
                if batch_id >= 0:
                    results = block_results(np.asarray(state.engine.wait(batch_id)), pieces, width * layer_bytes)
                    _, good = self._verify_group(batch, 0, num_layers, chosen, results, cells)
                    ok[chosen] = good[:, -1]
                flights.popleft()
                on_blocks(stop, ok.copy())
        finally:
            # Never return while the kernel may still write into the caller's memory.
            for flight in flights:
                if flight[1] >= 0:
                    state.engine.wait(flight[1])

    def _verify_group(self, batch: _ReadBatch, first: int, stop: int, chosen: np.ndarray, results: np.ndarray,
                      cells: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Check layers first..stop-1 of the chosen blocks, without a Python loop over them.

        Returns (chosen, good) where good[k, j] says block chosen[k] is good
        through layer first + j; records why a block failed, and counts.
        `batch.ok` itself is left for the caller to update after on_layer.
        """
        stats = self.state.stats
        extent = (stop - first) * batch.layer_bytes
        results = np.asarray(results)
        full = results == extent
        stats.bytes_read += int(full.sum()) * extent
        matches = cells.reshape(-1, stop - first) == batch.expected[chosen, first:stop]
        matches &= full[:, None]
        good = np.logical_and.accumulate(matches, axis=1)
        was_ok = batch.ok[chosen]
        for position, result in zip(chosen[~full & was_ok].tolist(), results[~full & was_ok].tolist(), strict=True):
            stats.count_error(error_kind(result, "short_read"))
            batch.reasons[position] = ReadFailure.IO_ERROR if result < 0 else ReadFailure.SHORT_READ
        corrupt = full & was_ok & ~good[:, -1]
        if corrupt.any():
            batch.reasons[chosen[corrupt]] = ReadFailure.CHECKSUM
            stats.checksum_failures += int((~matches[corrupt]).sum())
        good &= was_ok[:, None]
        return chosen, good
