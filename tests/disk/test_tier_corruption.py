"""DiskTier on real O_DIRECT files: corrupt blocks and damaged segments fail
the blocks they hit, never lie (shared pieces: tests/disk/conftest.py)."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from kvd.invariants import InvariantError
from kvd.testing import disk_ops
from kvd.tiers.disk import reads as reads_module
from kvd.tiers.disk.tier import ReadFailure
from tests.disk.conftest import (LAYER_BYTES, LAYERS, NAMESPACE, SEGMENT_BYTES, expected_bytes, host_bytes, make_config,
    open_tier, read, segment_path, write)


# ----------------------------------------------------------------------
# Corruption and damaged segments


def flip_byte(config, slot: int, position: int) -> None:
    path, offset = segment_path(config, slot)
    with open(path, "r+b") as handle:
        handle.seek(offset + position)
        value = handle.read(1)[0]
        handle.seek(offset + position)
        handle.write(bytes([value ^ 0x40]))


def test_a_flipped_byte_fails_that_block_only(drives, arena):
    config = make_config(drives)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {slot: 50 + slot for slot in range(8)}))
    tier.close()
    flip_byte(config, 5, LAYER_BYTES + 123)  # inside layer 1 of slot 5

    tier, recovery = open_tier(config)
    assert recovery.block_count == 8  # no data is read at open
    masks = []
    reasons = np.zeros(8, dtype=np.int8)
    ok = read(tier, arena, list(range(8)), on_layer=lambda layer, mask: masks.append(mask[5]), failures=reasons)
    assert ok.tolist() == [True] * 5 + [False] + [True] * 2
    assert masks == [True, False, False]  # layer 0 was good, layer 1 was not
    assert reasons.tolist() == [0] * 5 + [ReadFailure.CHECKSUM] + [0] * 2
    assert tier.stats.checksum_failures == 1
    for i in (0, 1, 2, 3, 4, 6, 7):
        assert host_bytes(arena, 32 + i) == expected_bytes(50 + i)
    tier.close()


def test_whole_block_reads_are_one_batch_of_one_extent_per_block_every_layer_still_verified(drives, arena,
                                                                                           io_engine):
    """whole_blocks: whatever read_extent_bytes says, one batch with one extent per block; each layer
    is still checksummed on its own, so a flipped byte in a middle layer fails that block only."""
    config = make_config(drives, engine=io_engine, read_extent_bytes=LAYER_BYTES)  # one layer per group otherwise
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {slot: 70 + slot for slot in range(8)}))
    tier.close()
    flip_byte(config, 3, LAYER_BYTES + 7)  # inside layer 1 of slot 3
    tier, _ = open_tier(config)
    reasons = np.zeros(8, dtype=np.int8)
    ok = read(tier, arena, list(range(8)), failures=reasons, whole_blocks=True)
    assert ok.tolist() == [True] * 3 + [False] + [True] * 4
    assert reasons.tolist() == [0] * 3 + [ReadFailure.CHECKSUM] + [0] * 4
    assert tier.stats.submissions == 1
    engine_stats = disk_ops.engine_stats(tier)
    assert engine_stats["entries"] == 8 and engine_stats["checksum_chunks"] == 8 * LAYERS
    for i in (0, 1, 2, 4, 5, 6, 7):
        assert host_bytes(arena, 32 + i) == expected_bytes(70 + i)
    tier.close()


@pytest.mark.parametrize("entry_layers", [1, LAYERS])
def test_whole_blocks_reported_in_runs_land_in_order_and_a_corrupt_block_fails_alone(drives, arena, io_engine,
                                                                                    monkeypatch, entry_layers):
    """on_blocks: runs of whole blocks, a batch each, reported in order as each is verified, with
    the mask of every block so far (a corrupt one False, the rest of its run good); a block goes
    as one entry, or as an entry per layer where BLOCK_ENTRY_MAX_BYTES is smaller than it."""
    monkeypatch.setattr(reads_module, "BLOCK_PARTS", 4)
    monkeypatch.setattr(reads_module, "BLOCK_ENTRY_MAX_BYTES", entry_layers * LAYER_BYTES)
    config = make_config(drives, engine=io_engine)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {slot: 90 + slot for slot in range(8)}))
    tier.close()
    flip_byte(config, 5, 2 * LAYER_BYTES + 9)  # inside layer 2 of slot 5
    tier, _ = open_tier(config)
    reports = []

    def on_blocks(stop: int, mask: np.ndarray) -> None:
        # Every block reported good holds its bytes already.
        assert all(host_bytes(arena, 32 + i) == expected_bytes(90 + i) for i in range(stop) if mask[i])
        reports.append((stop, mask[:stop].tolist()))

    ok = read(tier, arena, list(range(8)), whole_blocks=True, on_blocks=on_blocks)
    assert ok.tolist() == [True] * 5 + [False] + [True] * 2
    good = ok.tolist()
    assert reports == [(2, good[:2]), (4, good[:4]), (6, good[:6]), (8, good)]
    assert tier.stats.submissions == 4 and disk_ops.engine_stats(tier)["entries"] == 8 * LAYERS // entry_layers
    with pytest.raises(InvariantError, match="whole blocks"):
        read(tier, arena, [0], on_blocks=on_blocks)  # layer groups cannot report blocks
    tier.close()


def test_a_block_read_in_entries_is_whole_only_if_every_entry_was():
    """Three blocks of two 4 KiB entries: whole; second entry short; first entry an error."""
    results = np.array([4096, 4096, 4096, 100, -errno.EIO, 4096], dtype=np.int64)
    assert reads_module.block_results(results, 2, 4096).tolist() == [8192, 100, -errno.EIO]
    assert reads_module.entry_layers(1 << 20, 32) == 4  # 4 MiB of 1 MiB layers, dividing 32
    assert reads_module.entry_layers(3 << 20, 32) == 1
    assert reads_module.entry_layers(5 << 20, 4) == 1  # larger than the cap: a layer per entry


def test_a_truncated_segment_drops_its_blocks_at_open(drives, arena):
    config = make_config(drives)
    tier, _ = open_tier(config)
    # Drive 1 holds the odd slots; slots 1 and 3 are its local slots 0 and 1.
    assert all(write(tier, arena, {0: 10, 1: 11, 3: 13, 5: 15}))
    tier.close()
    path, offset = segment_path(config, 3)
    os.truncate(path, offset + LAYER_BYTES)  # slot 3 keeps only its first layer

    tier, recovery = open_tier(config)
    assert recovery.short_segments == [path]
    assert recovery.dropped.missing_segment == 2  # slots 3 and 5
    assert sorted(r.location for r in recovery.blocks[NAMESPACE]) == [0, 1]
    assert os.path.getsize(path) == SEGMENT_BYTES  # extended back, durable drop first
    assert read(tier, arena, [0, 1]).all()
    assert host_bytes(arena, 33) == expected_bytes(11)
    # The slots are usable again.
    assert all(write(tier, arena, {3: 23}))
    tier.close()
    tier, recovery = open_tier(config)
    assert sorted(r.location for r in recovery.blocks[NAMESPACE]) == [0, 1, 3]
    assert recovery.dropped.total == 0
    tier.close()


def test_a_deleted_segment_drops_its_blocks_and_comes_back_empty(drives, arena):
    config = make_config(drives)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {0: 1, 1: 2, 129: 3}))  # 129: drive 1, segment 1
    tier.close()
    path, _ = segment_path(config, 129)
    path.unlink()

    tier, recovery = open_tier(config)
    assert recovery.missing_segments == [path] and recovery.dropped.missing_segment == 1
    assert sorted(r.location for r in recovery.blocks[NAMESPACE]) == [0, 1]
    assert path.stat().st_size == SEGMENT_BYTES
    tier.close()


def test_a_segment_truncated_while_open_fails_reads_not_lies(drives, arena):
    config = make_config(drives)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {0: 1, 2: 2, 4: 3}))
    path, offset = segment_path(config, 2)
    os.truncate(path, offset + LAYER_BYTES + 4096)  # slot 2: layer 0 whole, layer 1 half
    reasons = np.zeros(3, dtype=np.int8)
    ok = read(tier, arena, [0, 2, 4], failures=reasons)
    assert ok.tolist() == [True, False, False]
    assert reasons.tolist() == [0, ReadFailure.SHORT_READ, ReadFailure.SHORT_READ]
    assert tier.stats.errors == {"short_read": 2}
    tier.close()


def test_recovery_drops_records_beyond_a_smaller_capacity(drives, arena):
    config = make_config(drives, segments=2)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {0: 1, 128: 2, 255: 3}))  # 128, 255: second segments
    tier.close()
    smaller = make_config(drives, segments=1)
    tier, recovery = open_tier(smaller)
    assert recovery.dropped.out_of_range == 2
    assert [r.location for r in recovery.blocks[NAMESPACE]] == [0]
    tier.close()
