"""DiskTier on real O_DIRECT files: faults injected through the I/O engine and
the file system fail only the blocks they hit (shared pieces: tests/disk/conftest.py)."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from kvd.io import Op
from kvd.tiers.disk.fs import OsFileSystem
from kvd.tiers.disk.journal import FsyncPolicy
from kvd.tiers.disk.layout import locate
from kvd.tiers.disk import reads as reads_module
from kvd.tiers.disk.tier import ReadFailure
from tests.disk.conftest import (LAYER_BYTES, LAYERS, NAMESPACE, expected_bytes, host_bytes, key, make_config,
    open_tier, read, records_by_slot, write)


# ----------------------------------------------------------------------
# Faults through the I/O engine


@pytest.mark.parametrize(
    ("fault", "kind"),
    [({"errno": errno.EIO}, "EIO"), ({"errno": errno.ENOSPC}, "ENOSPC"), ({"short_bytes": 4096}, "short_write")],
)
def test_write_faults_fail_only_the_blocks_they_hit(drives, arena, io_engine, fault, kind):
    config = make_config(drives, engine=io_engine)
    tier, _ = open_tier(config)
    place = locate(config, 3)
    tier.engine.inject_fault(Op.WRITE, file_index=place.file_index, offset_range=(place.offset, place.offset + 1),
                             **fault)
    assert write(tier, arena, {slot: slot for slot in range(6)}) == [True, True, True, False, True, True]
    assert tier.stats.errors == {kind: 1} and tier.stats.write_failures == 1
    assert 3 not in records_by_slot(tier)
    tier.verify()
    # The engine asks for a REMOVE of every failed write (it cannot tell one
    # that failed before its PUT was journalled): nothing names the block,
    # so there is nothing to remove (this was an InvariantError that killed
    # the daemon's disk writer; tests/soak found it).
    assert tier.remove_blocks(NAMESPACE, [(key(3), 3)]) == [True]
    # The failed slot is still free and takes the block on a retry.
    assert write(tier, arena, {3: 3}) == [True]
    tier.close()
    tier, recovery = open_tier(config)
    assert sorted(r.location for r in recovery.blocks[NAMESPACE]) == list(range(6))
    assert read(tier, arena, list(range(6))).all()
    tier.close()


@pytest.mark.parametrize(
    ("fault", "reason", "kind"),
    [({"errno": errno.EIO}, ReadFailure.IO_ERROR, "EIO"), ({"short_bytes": 0}, ReadFailure.SHORT_READ, "short_read")],
)
@pytest.mark.parametrize("extent_layers", [1, LAYERS])
def test_read_faults_fail_only_the_blocks_they_hit(drives, arena, io_engine, fault, reason, kind, extent_layers):
    """The fault hits the extent holding layer 2 of block 2: read per layer,
    layers 0 and 1 were good; read as one extent, none of it is."""
    config = make_config(drives, engine=io_engine, read_extent_bytes=extent_layers * LAYER_BYTES)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {slot: slot for slot in range(6)}))
    place = locate(config, 2)
    extent = place.offset + (2 // extent_layers) * extent_layers * LAYER_BYTES
    tier.engine.inject_fault(Op.READ, file_index=place.file_index, offset_range=(extent, extent + 1), **fault)
    reasons = np.zeros(6, dtype=np.int8)
    masks = []
    ok = read(tier, arena, list(range(6)), failures=reasons, on_layer=lambda layer, mask: masks.append(mask[2]))
    assert ok.tolist() == [True, True, False, True, True, True]
    assert masks == ([True, True, False] if extent_layers == 1 else [False, False, False])
    assert reasons[2] == reason and tier.stats.errors == {kind: 1}
    assert tier.stats.read_failures == 1 and tier.stats.checksum_failures == 0
    tier.close()


@pytest.mark.parametrize(
    ("fault", "reason", "kind"),
    [({"errno": errno.EIO}, ReadFailure.IO_ERROR, "EIO"), ({"short_bytes": 0}, ReadFailure.SHORT_READ, "short_read")],
)
def test_a_read_fault_in_one_entry_of_a_block_read_in_runs_fails_that_block_only(drives, arena, io_engine,
                                                                                 monkeypatch, fault, reason, kind):
    """on_blocks with a block cut into an entry per layer: a fault on layer 2's entry of block 2
    fails block 2 alone, for the reason the fault gives, and the runs still report in order."""
    monkeypatch.setattr(reads_module, "BLOCK_PARTS", 3)
    monkeypatch.setattr(reads_module, "BLOCK_ENTRY_MAX_BYTES", LAYER_BYTES)
    config = make_config(drives, engine=io_engine)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {slot: slot for slot in range(6)}))
    place = locate(config, 2)
    layer_2 = place.offset + 2 * LAYER_BYTES
    tier.engine.inject_fault(Op.READ, file_index=place.file_index, offset_range=(layer_2, layer_2 + 1), **fault)
    reasons = np.zeros(6, dtype=np.int8)
    reports = []
    ok = read(tier, arena, list(range(6)), failures=reasons, whole_blocks=True,
              on_blocks=lambda stop, mask: reports.append((stop, mask[:stop].tolist())))
    assert ok.tolist() == [True, True, False, True, True, True]
    assert reports == [(2, [True, True]), (4, [True, True, False, True]), (6, ok.tolist())]
    assert reasons[2] == reason and tier.stats.errors == {kind: 1}
    assert tier.stats.read_failures == 1 and tier.stats.checksum_failures == 0
    for i in (0, 1, 3, 4, 5):
        assert host_bytes(arena, 32 + i) == expected_bytes(i)
    tier.close()


def test_a_failed_fdatasync_fails_the_blocks_of_that_file(drives, arena, io_engine):
    config = make_config(drives, engine=io_engine)
    tier, _ = open_tier(config)
    tier.engine.inject_fault(Op.FSYNC, file_index=locate(config, 1).file_index, errno=errno.EIO)
    assert write(tier, arena, {0: 0, 1: 1, 2: 2, 3: 3}) == [True, False, True, False]
    assert tier.stats.errors == {"fsync_EIO": 1}
    assert sorted(records_by_slot(tier)) == [0, 2]
    tier.close()


def test_a_failed_group_fdatasync_takes_the_drive_out_before_its_manifest_is_synced(drives, arena, io_engine):
    config = make_config(drives, policy=FsyncPolicy.GROUP, engine=io_engine)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {0: 1, 1: 2}))
    place = locate(config, 1)
    tier.engine.inject_fault(Op.FSYNC, file_index=place.file_index, errno=errno.EIO)
    tier.sync()
    assert place.drive in tier.failed_drives and "fdatasync" in tier.failed_drives[place.drive]
    assert tier._state.manifests[place.drive].unsynced_bytes > 0  # its records were not made durable
    other = 1 - place.drive
    assert other not in tier.failed_drives and tier._state.manifests[other].unsynced_bytes == 0
    assert tier.stats.errors["fsync_EIO"] == 1
    tier.close()


class FailingAppends(OsFileSystem):
    """Manifest appends fail with EIO once armed (a drive dying under the log)."""

    armed = False

    def append(self, path, data):
        if self.armed and path.name.startswith("MANIFEST"):
            raise OSError(errno.EIO, "injected")
        super().append(path, data)


def test_a_failed_manifest_append_takes_the_drive_out_of_writes(drives, arena):
    config = make_config(drives)
    fs = FailingAppends()
    tier, _ = open_tier(config, fs=fs)
    assert all(write(tier, arena, {0: 0, 1: 1}))
    fs.armed = True
    assert write(tier, arena, {2: 2, 3: 3}) == [False, False]
    assert set(tier.failed_drives) == {0, 1} and tier.stats.errors["manifest"] == 2
    tier.verify()  # the live map was rolled back to what the log holds
    fs.armed = False
    # A failed drive takes no more writes, even though appends work again.
    assert write(tier, arena, {4: 4}) == [False]
    assert tier.stats.errors["drive_failed"] == 1
    assert read(tier, arena, [0, 1]).all()  # reads still work
    tier.close()
    tier, recovery = open_tier(config)
    assert sorted(r.location for r in recovery.blocks[NAMESPACE]) == [0, 1]
    assert tier.failed_drives == {}
    tier.close()
