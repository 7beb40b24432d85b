"""One flipped byte in a real drive's manifest, at every position in turn
(issue 10, item 6: a flip in the middle used to drop every record after it,
21 to 34 blocks of a 72-block store).

The manifest is the one a DiskTier wrote for 48 blocks (a snapshot, then
edits: PUTs and REMOVEs). For every byte position: replay keeps every
record the flip did not hit (at most one lost, plus the block whose REMOVE
was hit coming back), never a record that was not written; and for a
stride of positions the tier is reopened read-write over the damaged copy
and every block it keeps reads back bit-exact from disk.
"""

from __future__ import annotations

import shutil

import pytest

from kvd.tiers.disk.journal import CURRENT, FsyncPolicy, Manifest
from tests.disk.conftest import (
    BLOCK_BYTES,
    LAYER_BYTES,
    LAYERS,
    NAMESPACE,
    arena_address,
    key,
    make_config,
    open_tier,
    write,
)

BLOCKS = 48
REMOVED = (3, 17, 40)  # seeds whose REMOVE follows their PUT


@pytest.fixture
def store(drives, arena):
    """A drive set whose drive 0 manifest has a snapshot, PUTs and REMOVEs;
    returns (config, {seed: bytes} of every block written to drive 0)."""
    config = make_config(drives, policy=FsyncPolicy.STRICT)
    tier, _ = open_tier(config)
    written = {}
    for first in range(0, BLOCKS, 16):
        seeds = {2 * seed: seed for seed in range(first, first + 16)}  # even slots: drive 0
        assert all(write(tier, arena, seeds))
        for seed in seeds.values():
            written[seed] = arena.slots[seed - first, :BLOCK_BYTES].tobytes()  # write() fills host slots 0..
        if first == 0:
            tier.compact_if_needed(0)  # the first 16 go into the snapshot
    assert all(tier.remove_blocks(NAMESPACE, [(key(seed), 2 * seed) for seed in REMOVED]))
    tier.close()
    return config, written


def test_every_byte_flipped_costs_at_most_the_record_it_hit(store, tmp_path):
    config, _ = store
    drive = config.directories[0]
    path = drive / (drive / CURRENT).read_text().strip()
    original = path.read_bytes()
    clean = Manifest(drive, FsyncPolicy.STRICT)
    clean.open()
    live = {identity: record for identity, record in clean.live.items()}
    assert len(live) == BLOCKS - len(REMOVED)
    worst = 0
    for position in range(len(original)):
        damaged = bytearray(original)
        damaged[position] ^= 0x10
        files = DamagedFiles({CURRENT: f"{path.name}\n".encode(), path.name: bytes(damaged)})
        replayed = Manifest(drive, FsyncPolicy.STRICT, files)
        report = replayed.open()
        # Nothing that was not written; everything written, but the one hit.
        for identity, record in replayed.live.items():
            assert live.get(identity, record) == record, position
            assert identity in live or identity[1] in {key(seed) for seed in REMOVED}, position
        lost = len(set(live) - set(replayed.live))
        worst = max(worst, lost)
        assert lost <= 1, f"a flip at byte {position} cost {lost} records"
        if lost:
            assert report.damaged and report.lost_records >= 1, position
    assert worst == 1  # some flips do hit a PUT


class DamagedFiles:
    """The manifest's files as bytes in memory, for replay only: what replay
    would repair (a torn tail, a stale manifest) it repairs nowhere."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def read(self, path):
        return self.files.get(path.name)

    def list(self, directory):
        return sorted(self.files)

    def truncate(self, path, size):
        pass

    def fsync(self, path):
        pass

    def remove(self, path):
        pass


@pytest.mark.parametrize("stride_start", [0, 1])
def test_blocks_kept_after_a_flip_read_back_bit_exact(store, tmp_path, arena, stride_start):
    config, expected = store
    drive = config.directories[0]
    path = drive / (drive / CURRENT).read_text().strip()
    original = path.read_bytes()
    for position in range(stride_start, len(original), 211):
        copy = tmp_path / f"flip-{position}"
        shutil.copytree(drive.parent, copy)
        damaged = bytearray(original)
        damaged[position] ^= 0x01
        (copy / drive.name / path.name).write_bytes(bytes(damaged))
        tier, recovery = open_tier(make_config([copy / "nvme0", copy / "nvme1"]))
        try:
            records = [record for record in recovery.blocks.get(NAMESPACE, []) if record.location % 2 == 0]
            assert len(records) >= BLOCKS - len(REMOVED) - 1, position
            items = [(record.key, record.location, arena_address(arena, index), record.layer_checksums)
                     for index, record in enumerate(records)]
            ok = tier.read_blocks(NAMESPACE, LAYER_BYTES, LAYERS, items)
            for index, record in enumerate(records):
                # Every block kept is its key's bytes (a removed one whose REMOVE the
                # flip hit included: its slot was never reused, its bytes are its own).
                seed = int.from_bytes(record.key[:4], "little")
                assert ok[index] and arena.slots[index, :BLOCK_BYTES].tobytes() == expected[seed], position
            tier.verify()
        finally:
            tier.close()
        shutil.rmtree(copy)
