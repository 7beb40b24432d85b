"""DiskTier on real O_DIRECT files: round trips, striping, recovery, faults."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from kvd.core.keys import DType, NamespaceSpec
from kvd.errors import InvalidArgument
from kvd.invariants import InvariantError
from kvd.io import Op
from kvd.testing import disk_ops
from kvd.tiers.disk.fs import OsFileSystem
from kvd.tiers.disk.journal import FsyncPolicy
from kvd.tiers.disk.layout import locate, segment_name
from kvd.tiers.disk import reads as reads_module
from kvd.tiers.disk.tier import DiskTier, ReadFailure
from tests.disk.conftest import (
    BLOCK_BYTES,
    LAYER_BYTES,
    LAYERS,
    NAMESPACE,
    SEGMENT_BYTES,
    SLOT_BYTES,
    SPEC,
    arena_address,
    expected_bytes,
    fill,
    host_bytes,
    key,
    make_config,
    open_tier,
    read,
    records_by_slot,
    write,
)


def segment_path(config, slot: int):
    place = locate(config, slot)
    return config.directories[place.drive] / segment_name(place.segment), place.offset


def raw_block(config, slot: int) -> bytes:
    path, offset = segment_path(config, slot)
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read(BLOCK_BYTES)


def test_writes_run_between_a_restores_layer_groups_and_both_stay_exact(drives, arena, io_engine):
    """between_groups: with later layer groups still in flight, another batch (a write, as the daemon
    runs one in a layer's slack) goes through the same engine; the reads and the writes are exact."""
    config = make_config(drives, engine=io_engine, read_extent_bytes=LAYER_BYTES)  # one group per layer
    tier, _ = open_tier(config)
    restored = {slot: 300 + slot for slot in range(10)}
    assert write(tier, arena, restored) == [True] * 10
    calls = []

    def between(first: int, stop: int) -> None:
        slot = 20 + len(calls)
        calls.append((first, stop))
        assert write(tier, arena, {slot: 700 + slot}) == [True]

    assert read(tier, arena, list(restored), between_groups=between).tolist() == [True] * 10
    assert calls == [(layer, layer + 1) for layer in range(LAYERS - 1)]  # not after the last group
    for i, seed in enumerate(restored.values()):
        assert host_bytes(arena, 32 + i) == expected_bytes(seed)
    written = [20 + i for i in range(len(calls))]
    assert read(tier, arena, written, first_host_slot=48).tolist() == [True] * len(written)
    for i, slot in enumerate(written):
        assert host_bytes(arena, 48 + i) == expected_bytes(700 + slot)
    tier.verify()
    tier.close()


def test_chunks_are_written_pipelined_and_stop_ends_the_run_between_chunks(drives, arena, io_engine):
    """write_chunks: chunk k+1 goes to the drive before chunk k is journalled (two batches in
    flight), every chunk it wrote reads back exact; stop() ends the run before the next chunk, and
    the chunks not started stay unwritten. A chunk that fails its checks mid-run still waits for
    the one in flight."""
    config = make_config(drives, engine=io_engine)
    tier, _ = open_tier(config)
    chunks = []
    for chunk in range(4):
        items = []
        for i in range(3):
            host_slot = chunk * 3 + i
            fill(arena, host_slot, 500 + host_slot)
            items.append((key(500 + host_slot), b"", host_slot, arena_address(arena, host_slot)))
        chunks.append(items)
    in_flight = []
    submit = tier._state.submit

    def counting_submit(*args, **kwargs):
        in_flight.append(len(tier._state.owners))  # records journalled when each batch went out
        return submit(*args, **kwargs)

    tier._state.submit = counting_submit
    asked = []
    done = tier.write_chunks(NAMESPACE, LAYER_BYTES, LAYERS, chunks, stop=lambda: asked.append(1) or len(asked) == 3)
    assert done == [[True] * 3] * 3  # stopped before the fourth chunk
    assert in_flight == [0, 0, 3]  # chunk 1 went out before chunk 0 was journalled, chunk 2 before chunk 1
    assert sorted(records_by_slot(tier)) == list(range(9))
    assert read(tier, arena, list(range(9))).all()
    for slot in range(9):
        assert host_bytes(arena, 32 + slot) == expected_bytes(500 + slot)
    bad = [[(key(900), b"", 20, arena_address(arena, 0))], [(key(901), b"", 20, arena_address(arena, 1))] * 2]
    with pytest.raises(InvariantError, match="a slot appears twice"):
        tier.write_chunks(NAMESPACE, LAYER_BYTES, LAYERS, bad)
    assert 20 in records_by_slot(tier)  # the first chunk was finished and journalled all the same
    tier.verify()
    tier.close()


def test_a_chunk_that_fails_to_finish_leaves_no_later_chunk_at_the_drive(drives, arena, io_engine, monkeypatch):
    """Finishing chunk k raises while chunk k+1 is in flight: write_chunks still waits for chunk
    k+1 (its source memory is not read after the call returns) and does not finish chunk k twice."""
    tier, _ = open_tier(make_config(drives, engine=io_engine))
    chunks = []
    for chunk in range(2):
        fill(arena, chunk, 600 + chunk)
        chunks.append([(key(600 + chunk), b"", chunk, arena_address(arena, chunk))])
    finishing = []
    sync = tier._writer.sync_data

    def failing_first(ok, drives, files):  # inside BlockWriter._finish, after its chunk's batch was waited
        finishing.append(len(finishing))
        if len(finishing) == 1:
            raise OSError("injected: finishing chunk 0 failed")
        return sync(ok, drives, files)

    monkeypatch.setattr(tier._writer, "sync_data", failing_first)
    with pytest.raises(OSError, match="injected"):
        tier.write_chunks(NAMESPACE, LAYER_BYTES, LAYERS, chunks)
    assert finishing == [0, 1]  # chunk 1 was finished (waited for), chunk 0 not finished twice
    assert sorted(records_by_slot(tier)) == [1]
    assert tier.engine.batches_in_flight == 0
    tier.close()


@pytest.mark.parametrize("extent_layers", [1, 2, LAYERS])
def test_round_trip_is_bit_exact_through_a_host_arena(drives, arena, io_engine, extent_layers):
    config = make_config(drives, engine=io_engine, read_extent_bytes=extent_layers * LAYER_BYTES)
    tier, recovery = open_tier(config)
    assert recovery.created_drives == [0, 1] and recovery.block_count == 0
    blocks = {slot: 100 + slot for slot in range(10)}
    assert write(tier, arena, blocks) == [True] * 10
    layers_seen = []
    ok = read(tier, arena, list(blocks), on_layer=lambda layer, mask: layers_seen.append((layer, mask.tolist())))
    assert ok.tolist() == [True] * 10
    for i, seed in enumerate(blocks.values()):
        assert host_bytes(arena, 32 + i) == expected_bytes(seed)
    assert layers_seen == [(layer, [True] * 10) for layer in range(LAYERS)]
    # One write batch, and one read batch per group of extent_layers
    # layers: O(L), not O(N*L).
    groups = -(-LAYERS // extent_layers)
    assert tier.stats.submissions == 1 + groups
    assert tier.stats.bytes_written == tier.stats.bytes_read == 10 * BLOCK_BYTES
    engine_stats = disk_ops.engine_stats(tier)
    assert engine_stats["entries"] == 10 + 10 * groups
    assert engine_stats["checksum_chunks"] == 10 * LAYERS  # every layer checksummed by the engine
    tier.verify()
    tier.close()


@pytest.mark.parametrize("read_ahead", [64 << 20, 0], ids=["read-ahead", "two-groups"])
def test_layer_groups_are_read_ahead_within_the_byte_budget(drives, arena, io_engine, monkeypatch, read_ahead):
    """One layer per group (3 groups): all three are in flight at once while they fit in READ_AHEAD_BYTES;
    with no budget, two at a time (the floor). The bytes are bit-exact either way."""
    monkeypatch.setattr(reads_module, "READ_AHEAD_BYTES", read_ahead)
    config = make_config(drives, engine=io_engine, read_extent_bytes=LAYER_BYTES)
    tier, _ = open_tier(config)
    blocks = {slot: 300 + slot for slot in range(6)}
    assert write(tier, arena, blocks) == [True] * 6
    engine, most = tier.engine, []
    submit = engine.submit

    def counting_submit(*args, **kwargs):
        batch = submit(*args, **kwargs)
        most.append(engine.batches_in_flight)
        return batch

    monkeypatch.setattr(engine, "submit", counting_submit)
    assert read(tier, arena, list(blocks)).tolist() == [True] * 6
    assert max(most) == (LAYERS if read_ahead else 2) and len(most) == LAYERS
    for i, seed in enumerate(blocks.values()):
        assert host_bytes(arena, 32 + i) == expected_bytes(seed)
    tier.close()


def test_a_corrupt_layer_inside_an_extent_fails_its_block_from_that_layer_on(drives, arena, io_engine):
    """Layer 1 of a block is bad, read in one extent with layers 0 and 2:
    on_layer reports the block good for layer 0 and bad from layer 1."""
    config = make_config(drives, engine=io_engine, read_extent_bytes=LAYERS * LAYER_BYTES)
    tier, _ = open_tier(config)
    assert write(tier, arena, {slot: 7 + slot for slot in range(4)}) == [True] * 4
    path, offset = segment_path(config, 2)
    with open(path, "r+b") as handle:
        handle.seek(offset + LAYER_BYTES + 123)
        byte = handle.read(1)
        handle.seek(offset + LAYER_BYTES + 123)
        handle.write(bytes([byte[0] ^ 0x01]))
    layers_seen = []
    failures = np.zeros(4, dtype=np.int8)
    ok = read(tier, arena, [0, 1, 2, 3], failures=failures,
              on_layer=lambda layer, mask: layers_seen.append((layer, mask.tolist())))
    assert ok.tolist() == [True, True, False, True]
    assert failures.tolist() == [ReadFailure.NONE, ReadFailure.NONE, ReadFailure.CHECKSUM, ReadFailure.NONE]
    assert layers_seen[0] == (0, [True, True, True, True])
    assert all(mask == [True, True, False, True] for layer, mask in layers_seen[1:])
    assert tier.stats.checksum_failures == 1
    tier.close()


def test_consecutive_slots_alternate_drives(drives, arena):
    config = make_config(drives)
    tier, _ = open_tier(config)
    blocks = {slot: 7 + slot for slot in range(6)}
    assert all(write(tier, arena, blocks))
    tier.close()
    for slot, seed in blocks.items():
        place = locate(config, slot)
        assert place.drive == slot % 2 and place.offset == (slot // 2) * SLOT_BYTES
        assert raw_block(config, slot) == expected_bytes(seed)
    # Slot 128 is local slot 64 of drive 0: the first slot of its second segment.
    assert locate(config, 128).segment == 1 and locate(config, 128).offset == 0


def test_reopen_recovers_exactly_the_written_blocks(drives, arena):
    config = make_config(drives)
    tier, _ = open_tier(config)
    parent = key(999)
    assert all(write(tier, arena, {slot: 200 + slot for slot in range(0, 16, 3)}, parent=parent))
    assert all(write(tier, arena, {40: 240, 41: 241}))
    assert tier.remove_blocks(NAMESPACE, [(key(203), 3), (key(240), 40)]) == [True, True]
    before = records_by_slot(tier)
    tier.close()

    tier, recovery = open_tier(config)
    assert recovery.dropped.total == 0 and recovery.truncated_bytes == 0
    assert recovery.created_drives == [] and recovery.missing_segments == []
    recovered = {record.location: record for record in recovery.blocks[NAMESPACE]}
    assert recovered == before
    assert sorted(recovered) == [0, 6, 9, 12, 15, 41]
    assert recovered[0].parent_key == parent and recovered[41].parent_key == bytes(32)
    # The namespace registry came back too, decoded, before anyone registered it.
    assert recovery.namespaces[NAMESPACE].spec == SPEC
    slots = sorted(recovered)
    assert read(tier, arena, slots).all()
    for i, slot in enumerate(slots):
        assert host_bytes(arena, 32 + i) == expected_bytes(recovered[slot].key[0] | recovered[slot].key[1] << 8)
    tier.verify()
    tier.close()


def test_a_removed_slot_takes_a_new_block(drives, arena):
    for policy in FsyncPolicy:
        config = make_config([d / policy.value for d in drives], policy=policy)
        for directory in config.directories:
            directory.parent.mkdir(exist_ok=True)
        tier, _ = open_tier(config)
        assert all(write(tier, arena, {4: 1, 5: 2}))
        with pytest.raises(InvariantError, match="not removed"):
            write(tier, arena, {4: 3})
        assert tier.remove_blocks(NAMESPACE, [(key(1), 4)]) == [True]
        errors_before = tier.stats.errors.copy()
        assert write(tier, arena, {4: 3}) == [True]
        assert tier.stats.errors == errors_before
        assert read(tier, arena, [4, 5]).all() and host_bytes(arena, 32) == expected_bytes(3)
        tier.close()
        tier, recovery = open_tier(config)
        assert {r.location: r.key for r in recovery.blocks[NAMESPACE]} == {4: key(3), 5: key(2)}
        tier.close()


def test_group_policy_syncs_a_removal_before_reusing_its_slot(drives, arena):
    config = make_config(drives, policy=FsyncPolicy.GROUP)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {2: 1, 3: 2}))
    manifest = tier._state.manifests[0]
    assert manifest.unsynced_bytes > 0  # GROUP leaves the PUTs to sync()
    tier.sync()
    assert manifest.unsynced_bytes == 0
    tier.remove_blocks(NAMESPACE, [(key(1), 2)])
    assert manifest.unsynced_bytes > 0
    assert write(tier, arena, {2: 5}) == [True]
    # The REMOVE was made durable before new bytes went into slot 2; only
    # the new PUT waits for the timer.
    assert manifest.unsynced_bytes == len(records_by_slot(tier)[2].encode())
    tier.close()


def test_accepts_says_why_not():
    from kvd.tiers.disk.layout import DiskConfig

    config = DiskConfig(("/nonexistent-a",), capacity_bytes=SEGMENT_BYTES, slot_bytes=SLOT_BYTES,
                        segment_bytes=SEGMENT_BYTES)
    tier = DiskTier(config)
    assert tier.accepts(SPEC)
    odd = NamespaceSpec("m", num_layers=2, num_kv_heads=3, head_dim=10, block_tokens=4, kv_dtype=DType.FLOAT16)
    verdict = tier.accepts(odd)
    assert not verdict and "not a multiple of 4096" in verdict.reason
    big = NamespaceSpec("m", num_layers=64, num_kv_heads=8, head_dim=128, block_tokens=16)
    verdict = tier.accepts(big)
    assert not verdict and "does not fit" in verdict.reason


def test_register_namespace_checks_the_digest(drives):
    tier, _ = open_tier(make_config(drives))
    other = NamespaceSpec("other", num_layers=1, num_kv_heads=1, head_dim=1024, block_tokens=1)
    with pytest.raises(InvalidArgument, match="not the digest"):
        tier.register_namespace(NAMESPACE, other.encode())
    with pytest.raises(InvalidArgument, match="cannot register"):
        tier.register_namespace(NAMESPACE, SPEC.encode()[:-3])
    tier.register_namespace(other.namespace_id(), other.encode())
    tier.register_namespace(other.namespace_id(), other.encode())  # idempotent
    tier.close()
    tier, recovery = open_tier(make_config(drives))
    assert {entry.spec for entry in recovery.namespaces.values()} == {SPEC, other}
    assert all(r.records == 2 for r in recovery.registries)  # each drive, once each
    tier.close()


def test_using_an_unregistered_namespace_is_a_programmer_error(drives, arena):
    tier, _ = open_tier(make_config(drives))
    with pytest.raises(InvariantError, match="before register_namespace"):
        disk_ops.write_blocks(tier, bytes(32), LAYER_BYTES, LAYERS, [(key(1), b"", 0, arena_address(arena, 0))])
    with pytest.raises(InvariantError, match="aligned"):
        disk_ops.write_blocks(tier, NAMESPACE, LAYER_BYTES, LAYERS, [(key(1), b"", 0, arena_address(arena, 0) + 512)])
    tier.close()


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


def _log_syncs(tier: DiskTier) -> list[str]:
    """Record, in order, each segment fdatasync ("data <file>") and manifest sync ("manifest <drive>")."""
    events: list[str] = []
    fdatasync = tier._state.fdatasync

    def logged_fdatasync(index: int) -> int:
        events.append(f"data {index}")
        return fdatasync(index)

    tier._state.fdatasync = logged_fdatasync
    for drive, manifest in enumerate(tier._state.manifests):
        def logged_sync(*, force: bool = False, sync=manifest.sync, drive=drive) -> None:
            if manifest.unsynced_bytes or force:
                events.append(f"manifest {drive}")
            sync(force=force)

        manifest.sync = logged_sync
    return events


def test_group_policy_flushes_the_data_at_the_group_commit_before_the_records(drives, arena):
    """Under group the data of a batch is not fdatasynced with the batch:
    the group commit flushes every segment file written since the last one,
    and only then the manifest that points into them."""
    config = make_config(drives, policy=FsyncPolicy.GROUP)
    tier, _ = open_tier(config)
    events = _log_syncs(tier)
    opened = tier.stats.fsyncs  # (opening syncs what it found)
    assert all(write(tier, arena, {0: 1, 1: 2, 2: 3}))
    assert events == [] and tier.stats.fsyncs == opened
    tier.sync()
    files = sorted({locate(config, slot).file_index for slot in (0, 1, 2)})
    data = [f"data {index}" for index in files]
    assert sorted(event for event in events if event.startswith("data")) == data
    for drive in (0, 1):
        drive_files = {f"data {locate(config, slot).file_index}" for slot in (0, 1, 2)
                       if locate(config, slot).drive == drive}
        assert all(events.index(f) < events.index(f"manifest {drive}") for f in drive_files)
    events.clear()
    tier.sync()
    assert events == []  # nothing written since: nothing to flush
    tier.close()


def test_none_policy_fdatasyncs_the_data_only_when_forced(drives, arena):
    """Under none nothing is synced by a write or a plain sync; a forced one (a
    client waiting for durability, a Delete) flushes the data, then the records."""
    config = make_config(drives, policy=FsyncPolicy.NONE)
    tier, _ = open_tier(config)
    events = _log_syncs(tier)
    opened = tier.stats.fsyncs
    assert all(write(tier, arena, {0: 1, 1: 2}))
    tier.sync()
    assert tier.stats.fsyncs == opened and events == []
    tier.sync(force=True)
    files = sorted({f"data {locate(config, slot).file_index}" for slot in (0, 1)})
    assert sorted(event for event in events if event.startswith("data")) == files
    for slot in (0, 1):
        place = locate(config, slot)
        assert events.index(f"data {place.file_index}") < events.index(f"manifest {place.drive}")
    tier.close()
    tier, recovery = open_tier(config)  # a process restart keeps what the kernel was handed
    assert sorted(r.location for r in recovery.blocks[NAMESPACE]) == [0, 1]
    tier.close()


def test_opening_syncs_what_a_killed_run_left_unsynced(drives, arena):
    """A run killed under none left its writes in the page cache only; the
    next open makes them durable before anything is served as durable."""
    config = make_config(drives, policy=FsyncPolicy.NONE)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {0: 1, 1: 2}))
    tier.close()
    synced: list[str] = []
    tier = DiskTier(config)
    fdatasync = tier._state.fdatasync
    tier._state.fdatasync = lambda index: synced.append(index) or fdatasync(index)
    tier.open()
    assert {locate(config, slot).file_index for slot in (0, 1)} <= set(synced)
    assert all(manifest.unsynced_bytes == 0 for manifest in tier._state.manifests)
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


def test_compaction_keeps_exactly_the_live_blocks(drives, arena):
    config = make_config(drives)
    tier, _ = open_tier(config)
    for round_number in range(5):
        assert all(write(tier, arena, {slot: 10 * round_number + slot for slot in range(4)}))
        if round_number < 4:
            tier.remove_blocks(NAMESPACE, [(key(10 * round_number + slot), slot) for slot in range(4)])
    sizes = tier.manifest_bytes()
    assert tier.compact_if_needed(max(sizes) + 1) == 0
    assert tier.compact_if_needed(0) == 2
    assert all(after < before for after, before in zip(tier.manifest_bytes(), sizes, strict=True))
    live = records_by_slot(tier)
    tier.close()
    tier, recovery = open_tier(config)
    assert {r.location: r for r in recovery.blocks[NAMESPACE]} == live
    assert read(tier, arena, list(range(4))).all()
    tier.close()


class Spy:
    """Records the order of engine and manifest operations of one write."""

    def __init__(self, events: list, engine) -> None:
        self._events = events
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit(self, op, *arrays):
        self._events.append(("submit", Op(op).name))
        return self._engine.submit(op, *arrays)

    def wait(self, batch):
        self._events.append(("wait", None))
        return self._engine.wait(batch)

    def fsync(self, index, datasync=True):
        self._events.append(("fdatasync", index))
        return self._engine.fsync(index, datasync=datasync)


class SpyFs(OsFileSystem):
    def __init__(self, events: list) -> None:
        self._events = events

    def append(self, path, data):
        self._events.append(("append", path.parent.name))
        super().append(path, data)

    def fsync(self, path):
        self._events.append(("fsync", path.parent.name))
        super().fsync(path)


def test_data_is_durable_before_the_record_that_points_to_it(drives, arena):
    from kvd.io import open_engine

    events: list = []
    config = make_config(drives)
    engine = open_engine("fallback")
    tier, _ = open_tier(config, engine=Spy(events, engine), fs=SpyFs(events))
    events.clear()
    assert all(write(tier, arena, {0: 1, 1: 2, 2: 3, 130: 4}))  # 130: drive 0, segment 1
    assert events == [
        ("submit", "WRITE"),
        ("wait", None),
        ("fdatasync", 0),  # drive 0 segment 0
        ("fdatasync", 1),  # drive 0 segment 1
        ("fdatasync", 2),  # drive 1 segment 0
        ("append", "nvme0"),
        ("fsync", "nvme0"),  # STRICT: synced before write_blocks returns
        ("append", "nvme1"),
        ("fsync", "nvme1"),
    ]
    tier.close()
    engine.close()


def test_records_of_slots_are_looked_up_for_reads(drives, arena):
    tier, _ = open_tier(make_config(drives))
    assert all(write(tier, arena, {9: 4}))
    record = disk_ops.record_of(tier, 9)
    assert tier.key_of(9) == key(4) == record.key
    assert tier.layer_checksums_of(9) == record.layer_checksums and record.layer_count == LAYERS
    assert disk_ops.record_of(tier, 8) is None
    with pytest.raises(InvariantError, match="does not hold"):
        tier.read_blocks(NAMESPACE, LAYER_BYTES, LAYERS, [(key(5), 9, arena_address(arena, 40), record.layer_checksums)])
    tier.close()


def test_a_failing_layer_callback_leaves_no_read_in_flight(drives, arena):
    tier, _ = open_tier(make_config(drives))
    assert all(write(tier, arena, {0: 1, 1: 2}))

    def give_up(layer, mask):
        raise RuntimeError("consumer went away")

    with pytest.raises(RuntimeError):
        read(tier, arena, [0, 1], on_layer=give_up)
    assert tier.engine.batches_in_flight == 0  # the next layer's batch was waited
    assert read(tier, arena, [0, 1]).all()
    tier.close()


def test_a_compaction_syncs_the_data_of_its_records_before_it_publishes_them(drives, arena, monkeypatch):
    """Under GROUP a PUT's data waits for the timer's sync; a compaction's snapshot is durable at once,
    so the segments its records point at are synced before it is published, never after."""
    config = make_config(drives, policy=FsyncPolicy.GROUP)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {slot: 40 + slot for slot in range(4)}))
    events: list[str] = []
    fdatasync, compacts = tier._state.fdatasync, [manifest.compact for manifest in tier._state.manifests]
    monkeypatch.setattr(tier._state, "fdatasync", lambda index: events.append(f"data {index}") or fdatasync(index))
    for drive, manifest in enumerate(tier._state.manifests):
        monkeypatch.setattr(manifest, "compact", lambda drive=drive: events.append(f"publish {drive}")
                            or compacts[drive]())
    written = [sorted(pending) for pending in tier._state.unsynced_data]
    assert any(written), "GROUP left no data unsynced: nothing to check"
    assert tier.compact_if_needed(0) == len(drives)
    for drive, indexes in enumerate(written):
        published = events.index(f"publish {drive}")
        assert all(events.index(f"data {index}") < published for index in indexes), events
    assert not any(tier._state.unsynced_data)
    tier.close()
