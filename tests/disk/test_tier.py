"""DiskTier on real O_DIRECT files: round trips, striping, recovery, namespaces.

The other DiskTier tests: test_tier_corruption.py (flipped bytes, damaged
segments), test_tier_faults.py (I/O faults) and test_tier_durability.py
(sync order, compaction); the shared drives, arena and helpers are in
tests/disk/conftest.py."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.core.keys import DType, NamespaceSpec
from kvd.errors import InvalidArgument
from kvd.invariants import InvariantError
from kvd.testing import disk_ops
from kvd.tiers.disk.journal import FsyncPolicy
from kvd.tiers.disk.layout import locate
from kvd.tiers.disk import reads as reads_module
from kvd.tiers.disk.tier import DiskTier, ReadFailure
from tests.disk.conftest import (BLOCK_BYTES, LAYER_BYTES, LAYERS, NAMESPACE, SEGMENT_BYTES, SLOT_BYTES, SPEC,
    arena_address, expected_bytes, fill, host_bytes, key, make_config, open_tier, raw_block, read, records_by_slot,
    segment_path, write)


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
    # One write batch, and one read batch per group of layers (one layer first,
    # then doubling up to extent_layers): O(L), not O(N*L).
    groups = len(reads_module.layer_groups(LAYERS, extent_layers))
    assert tier.stats.submissions == 1 + groups
    assert tier.stats.bytes_written == tier.stats.bytes_read == 10 * BLOCK_BYTES
    engine_stats = disk_ops.engine_stats(tier)
    assert engine_stats["entries"] == 10 + 10 * groups
    assert engine_stats["checksum_chunks"] == 10 * LAYERS  # every layer checksummed by the engine
    tier.verify()
    tier.close()


@pytest.mark.parametrize(("layers", "width", "groups"), [
    (3, 3, [(0, 1), (1, 3)]),
    (4, 4, [(0, 1), (1, 3), (3, 4)]),
    (32, 8, [(0, 1), (1, 3), (3, 7), (7, 15), (15, 23), (23, 31), (31, 32)]),
    (5, 1, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
    (1, 1, [(0, 1)]),
])
def test_a_streamed_restore_reads_layer_zero_alone_then_doubling_extents(layers, width, groups):
    assert reads_module.layer_groups(layers, width) == groups


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
