"""Fault injection, identical in both engines: every kind, matching and limits."""

from __future__ import annotations

import errno

import numpy as np
import pytest

from kvd.errors import InvalidArgument, ResourceExhausted
from kvd.io import Op, address_of, aligned_empty
from kvd.io.engine import MAX_FAULT_RULES
from tests.native.conftest import ENGINE_KINDS

BLOCK = 4096


@pytest.fixture(params=ENGINE_KINDS)
def rig(request, make_engine, make_files):
    """Engine (queue depth 4), two registered 256 KiB files of known bytes, 1 MiB of random memory."""
    kind = request.param
    rng = np.random.default_rng(11)
    initial = [rng.integers(0, 256, 256 << 10, dtype=np.uint8).tobytes() for _ in range(2)]
    files = make_files(kind, initial)
    engine = make_engine(kind, queue_depth=4)
    engine.register_files(files.fds)
    memory = aligned_empty(1 << 20)
    memory[:] = rng.integers(0, 256, memory.size, dtype=np.uint8)
    return engine, files, initial, memory


def entries(file_index, block_offset, length=BLOCK, memory_block=None, base=0):
    file_index = np.asarray(file_index, dtype=np.int32)
    count = len(file_index)
    memory_block = np.arange(count) if memory_block is None else np.asarray(memory_block)
    return (file_index, np.asarray(block_offset) * BLOCK, np.full(count, length),
            np.uint64(base) + (memory_block * 16 * BLOCK).astype(np.uint64))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO])
def test_errno_fault_fails_matching_writes_without_io(rig, code):
    engine, files, initial, memory = rig
    engine.inject_fault(Op.WRITE, file_index=1, errno=code, count=2)
    results = engine.wait(engine.submit(Op.WRITE, *entries([0, 1, 0, 1, 1], [0, 1, 2, 3, 4], base=address_of(memory))))
    assert results.tolist() == [BLOCK, -code, BLOCK, -code, BLOCK]
    content = files.contents()[1]
    assert content[BLOCK: 2 * BLOCK] == initial[1][BLOCK: 2 * BLOCK]          # not written
    assert content[3 * BLOCK: 4 * BLOCK] == initial[1][3 * BLOCK: 4 * BLOCK]  # not written
    assert content[4 * BLOCK: 5 * BLOCK] == memory[4 * 16 * BLOCK: (4 * 16 + 1) * BLOCK].tobytes()  # rule spent
    stats = engine.stats
    assert (stats["faults_injected"], stats["errors"], stats["bytes_written"]) == (2, 2, 3 * BLOCK)


def test_eio_read_leaves_memory_untouched(rig):
    engine, _, initial, memory = rig
    before = memory.copy()
    engine.inject_fault(Op.READ, errno=errno.EIO)
    results = engine.wait(engine.submit(Op.READ, *entries([0, 0], [5, 6], base=address_of(memory))))
    assert results.tolist() == [-errno.EIO, BLOCK]
    assert np.array_equal(memory[:BLOCK], before[:BLOCK])
    assert memory[16 * BLOCK: 17 * BLOCK].tobytes() == initial[0][6 * BLOCK: 7 * BLOCK]


def test_short_read_moves_only_the_short_bytes(rig):
    engine, _, initial, memory = rig
    before = memory.copy()
    engine.inject_fault(Op.READ, short_bytes=BLOCK)
    results = engine.wait(engine.submit(Op.READ, *entries([0], [8], length=4 * BLOCK, base=address_of(memory))))
    assert results.tolist() == [BLOCK]
    assert memory[:BLOCK].tobytes() == initial[0][8 * BLOCK: 9 * BLOCK]
    assert np.array_equal(memory[BLOCK: 4 * BLOCK], before[BLOCK: 4 * BLOCK])
    assert engine.stats["short_transfers"] == 1


def test_short_write_writes_only_the_short_bytes(rig):
    engine, files, initial, memory = rig
    engine.inject_fault(Op.WRITE, short_bytes=2 * BLOCK)
    results = engine.wait(engine.submit(Op.WRITE, *entries([0], [0], length=4 * BLOCK, base=address_of(memory))))
    assert results.tolist() == [2 * BLOCK]
    content = files.contents()[0]
    assert content[: 2 * BLOCK] == memory[: 2 * BLOCK].tobytes()
    assert content[2 * BLOCK: 4 * BLOCK] == initial[0][2 * BLOCK: 4 * BLOCK]


def test_short_to_zero_and_misaligned_short(rig):
    engine, _, _, memory = rig
    engine.inject_fault(Op.READ, short_bytes=0)
    engine.inject_fault(Op.READ, short_bytes=100)  # not a whole block: O_DIRECT refuses it
    results = engine.wait(engine.submit(Op.READ, *entries([0, 0, 0], [0, 1, 2], base=address_of(memory))))
    assert results.tolist() == [0, -errno.EINVAL, BLOCK]


def test_offset_range_and_file_select_entries(rig):
    engine, _, _, memory = rig
    # [4 blocks, 6 blocks) of file 0 only, up to 10 hits.
    engine.inject_fault(Op.READ, file_index=0, offset_range=(4 * BLOCK, 6 * BLOCK), errno=errno.EIO, count=10)
    results = engine.wait(engine.submit(
        Op.READ, *entries([0, 0, 0, 0, 1, 1], [3, 4, 5, 6, 4, 5], base=address_of(memory))))
    assert results.tolist() == [BLOCK, -errno.EIO, -errno.EIO, BLOCK, BLOCK, BLOCK]


def test_op_must_match(rig):
    engine, _, _, memory = rig
    engine.inject_fault(Op.WRITE, errno=errno.ENOSPC)
    assert engine.wait(engine.submit(Op.READ, *entries([0], [0], base=address_of(memory)))).tolist() == [BLOCK]
    assert engine.stats["faults_injected"] == 0


def test_rules_match_at_submit_in_entry_order(rig):
    engine, _, _, memory = rig
    base = address_of(memory)
    engine.inject_fault(Op.READ, errno=errno.EIO, count=3)
    first = engine.submit(Op.READ, *entries([0, 0], [0, 1], base=base))
    second = engine.submit(Op.READ, *entries([0, 0], [2, 3], memory_block=[2, 3], base=base))
    # Waited in reverse: the hits still went to the first-submitted entries.
    assert engine.wait(second).tolist() == [-errno.EIO, BLOCK]
    assert engine.wait(first).tolist() == [-errno.EIO, -errno.EIO]


def test_first_matching_rule_wins(rig):
    engine, _, _, memory = rig
    engine.inject_fault(Op.READ, file_index=1, errno=errno.ENOSPC)
    engine.inject_fault(Op.READ, errno=errno.EIO, count=5)
    results = engine.wait(engine.submit(Op.READ, *entries([1, 1, 0], [0, 1, 2], base=address_of(memory))))
    assert results.tolist() == [-errno.ENOSPC, -errno.EIO, -errno.EIO]


def test_fsync_fault_raises(rig):
    engine, _, _, _ = rig
    engine.inject_fault(Op.FSYNC, file_index=1, errno=errno.EIO)
    engine.fsync(0)
    with pytest.raises(OSError) as raised:
        engine.fsync(1)
    assert raised.value.errno == errno.EIO
    engine.fsync(1)  # the rule is spent
    assert engine.stats["faults_injected"] == 1


def test_rule_table_limits(rig):
    engine, _, _, memory = rig
    for _ in range(MAX_FAULT_RULES):
        engine.inject_fault(Op.WRITE, errno=errno.EIO)
    with pytest.raises(ResourceExhausted):
        engine.inject_fault(Op.WRITE, errno=errno.EIO)
    # A spent rule frees its place.
    engine.wait(engine.submit(Op.WRITE, *entries([0], [0], base=address_of(memory))))
    engine.inject_fault(Op.READ, errno=errno.EIO)
    engine.clear_faults()
    assert engine.wait(engine.submit(Op.READ, *entries([0], [0], base=address_of(memory)))).tolist() == [BLOCK]


@pytest.mark.parametrize("arguments", [
    {},                                             # neither errno nor short_bytes
    {"errno": errno.EIO, "short_bytes": 0},         # both
    {"errno": 0},
    {"short_bytes": -1},
    {"errno": errno.EIO, "count": 0},
    {"errno": errno.EIO, "offset_range": (10, 5)},
    {"errno": errno.EIO, "file_index": -1},
])
def test_bad_fault_arguments(rig, arguments):
    engine, _, _, _ = rig
    with pytest.raises(InvalidArgument):
        engine.inject_fault(Op.READ, **arguments)


def test_fsync_cannot_be_short(rig):
    engine, _, _, _ = rig
    with pytest.raises(InvalidArgument):
        engine.inject_fault(Op.FSYNC, short_bytes=0)
