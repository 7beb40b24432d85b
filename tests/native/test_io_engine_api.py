"""The I/O engine interface, run against both engines with exact outcomes."""

from __future__ import annotations

import errno
import mmap
import os
import threading
import time

import numpy as np
import pytest

from kvd.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvd.io import STATS_KEYS, Op, address_of, aligned_empty, open_engine
from tests.native.conftest import ENGINE_KINDS

BLOCK = 4096


@pytest.fixture(params=ENGINE_KINDS)
def kind(request) -> str:
    return request.param


@pytest.fixture
def rig(kind, make_engine, make_files):
    """An engine (queue depth 4) with two registered 1 MiB files of known bytes, and 4 MiB of memory."""
    rng = np.random.default_rng(7)
    initial = [rng.integers(0, 256, 1 << 20, dtype=np.uint8).tobytes() for _ in range(2)]
    files = make_files(kind, initial)
    engine = make_engine(kind, queue_depth=4)
    engine.register_files(files.fds)
    memory = aligned_empty(4 << 20)
    memory[:] = rng.integers(0, 256, memory.size, dtype=np.uint8)
    return engine, files, initial, memory


def blocks(count: int, *, file: int = 0, first_block: int = 0, memory_block: int = 0, base: int = 0):
    """Arrays for `count` consecutive 4 KiB entries."""
    index = np.arange(count)
    return (
        np.full(count, file, dtype=np.int32),
        (first_block + index) * BLOCK,
        np.full(count, BLOCK),
        np.uint64(base) + ((memory_block + index) * BLOCK).astype(np.uint64),
    )


def test_write_then_read_round_trip(rig):
    engine, files, initial, memory = rig
    base = address_of(memory)
    results = engine.wait(engine.submit(Op.WRITE, *blocks(8, file=1, first_block=10, base=base)))
    assert results.tolist() == [BLOCK] * 8
    results = engine.wait(engine.submit(Op.READ, *blocks(8, file=1, first_block=10, memory_block=100, base=base)))
    assert results.tolist() == [BLOCK] * 8
    assert np.array_equal(memory[100 * BLOCK: 108 * BLOCK], memory[: 8 * BLOCK])
    content = files.contents()[1]
    assert content[10 * BLOCK: 18 * BLOCK] == memory[: 8 * BLOCK].tobytes()
    assert content[: 10 * BLOCK] == initial[1][: 10 * BLOCK]
    stats = engine.stats
    assert (stats["entries"], stats["batches"], stats["bytes_read"], stats["bytes_written"]) == (16, 2, 8 * BLOCK,
                                                                                                8 * BLOCK)


def test_batch_larger_than_the_queue_depth(rig):
    engine, files, _, memory = rig
    base = address_of(memory)
    count = 200  # queue depth 4
    assert engine.wait(engine.submit(Op.WRITE, *blocks(count, base=base))).tolist() == [BLOCK] * count
    assert files.contents()[0][: count * BLOCK] == memory[: count * BLOCK].tobytes()
    assert engine.wait(engine.submit(Op.READ, *blocks(count, memory_block=300, base=base))).tolist() == [BLOCK] * count
    assert np.array_equal(memory[300 * BLOCK: (300 + count) * BLOCK], memory[: count * BLOCK])


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
def test_several_batches_in_flight_waited_in_any_order(rig, order):
    engine, files, initial, memory = rig
    base = address_of(memory)
    # Sizes straddle the queue depth (4): later batches queue behind earlier ones.
    layout = [(0, 10), (20, 3), (40, 9)]  # (first block, count), disjoint in file and memory
    writes = [engine.submit(Op.WRITE, *blocks(count, first_block=first, memory_block=first, base=base))
              for first, count in layout]
    reads = [engine.submit(Op.READ, *blocks(count, file=1, first_block=first, memory_block=500 + first, base=base))
             for first, count in layout]
    assert engine.batches_in_flight == 6
    for position in order:
        assert engine.wait(reads[position]).tolist() == [BLOCK] * layout[position][1]
        assert engine.wait(writes[position]).tolist() == [BLOCK] * layout[position][1]
    assert engine.batches_in_flight == 0
    content = files.contents()[0]
    for first, count in layout:
        span = slice(first * BLOCK, (first + count) * BLOCK)
        assert content[span] == memory[span].tobytes()
        assert memory[(500 + first) * BLOCK: (500 + first + count) * BLOCK].tobytes() == initial[1][span]


def test_misaligned_entries_fail_alone_with_einval(rig):
    engine, _, initial, memory = rig
    base = address_of(memory)
    results = engine.wait(engine.submit(
        Op.READ,
        [0, 0, 0, 0, 0],
        [0, BLOCK + 1, 2 * BLOCK, 3 * BLOCK, 4 * BLOCK],   # entry 1: offset
        [BLOCK, BLOCK, BLOCK, BLOCK - 100, BLOCK],         # entry 3: length
        [base, base + BLOCK, base + 2 * BLOCK + 1, base + 3 * BLOCK, base + 4 * BLOCK],  # entry 2: address
    ))
    assert results.tolist() == [BLOCK, -errno.EINVAL, -errno.EINVAL, -errno.EINVAL, BLOCK]
    assert memory[:BLOCK].tobytes() == initial[0][:BLOCK]
    assert memory[4 * BLOCK: 5 * BLOCK].tobytes() == initial[0][4 * BLOCK: 5 * BLOCK]
    assert engine.stats["errors"] == 3


def test_reads_past_the_end_are_short_not_retried(kind, make_engine, make_files):
    files = make_files(kind, [bytes(range(256)) * 23 + b"x" * 112])  # 6000 bytes: ends mid-block
    engine = make_engine(kind)
    engine.register_files(files.fds)
    memory = aligned_empty(4 * BLOCK)
    base = address_of(memory)
    results = engine.wait(engine.submit(Op.READ, [0, 0, 0], [0, 2 * BLOCK, 0], [2 * BLOCK, BLOCK, 0],
                                        [base, base + 2 * BLOCK, base + 3 * BLOCK]))
    assert results.tolist() == [6000, 0, 0]
    assert memory[:6000].tobytes() == files.contents()[0]
    assert engine.stats["short_transfers"] == 2  # the zero-length entry asked for nothing


def test_empty_batch(rig):
    engine, _, _, _ = rig
    results = engine.wait(engine.submit(Op.READ, [], [], [], []))
    assert results.dtype == np.int64 and results.size == 0


def test_wait_on_an_unknown_batch_raises(rig):
    engine, _, _, memory = rig
    with pytest.raises(NotFound):
        engine.wait(12345)
    batch = engine.submit(Op.READ, *blocks(2, base=address_of(memory)))
    engine.wait(batch)
    with pytest.raises(NotFound):
        engine.wait(batch)


def test_use_after_close_raises(rig):
    engine, files, _, memory = rig
    engine.close()
    engine.close()  # idempotent
    assert engine.closed
    for call in (
        lambda: engine.submit(Op.READ, *blocks(1, base=address_of(memory))),
        lambda: engine.wait(1),
        lambda: engine.register_files(files.fds),
        lambda: engine.register_buffers([]),
        lambda: engine.fsync(0),
        lambda: engine.inject_fault(Op.READ, errno=errno.EIO),
        lambda: engine.clear_faults(),
    ):
        with pytest.raises(FailedPrecondition):
            call()
    assert tuple(engine.stats) == STATS_KEYS  # counters stay readable


def test_close_drains_batches_in_flight(rig):
    engine, files, initial, memory = rig
    base = address_of(memory)
    first = engine.submit(Op.WRITE, *blocks(100, base=base))  # 100 entries at queue depth 4
    engine.submit(Op.READ, *blocks(50, file=1, memory_block=200, base=base))
    engine.close()
    with pytest.raises(FailedPrecondition):
        engine.wait(first)
    # Once close returns, nothing may still write into caller memory.
    snapshot = memory.copy()
    time.sleep(0.05)
    assert np.array_equal(memory, snapshot)
    # Every block was either written whole or not at all (cancelled).
    content = files.contents()[0]
    for block in range(100):
        span = slice(block * BLOCK, (block + 1) * BLOCK)
        assert content[span] in (initial[0][span], memory[span].tobytes())


def test_context_manager_closes(kind, make_engine):
    if kind == "uring":
        make_engine("uring").close()  # skips or fails here when io_uring is unavailable
    with open_engine(kind, queue_depth=2) as engine:
        assert engine.kind == kind and engine.queue_depth == 2 and not engine.closed
    assert engine.closed


def test_bad_batches_raise_before_anything_is_submitted(rig):
    engine, _, _, memory = rig
    base = address_of(memory)
    good = blocks(2, base=base)
    bad_batches = [
        (Op.READ, good[0][:1], *good[1:]),                                   # lengths differ
        (Op.READ, good[0], -good[1] - 1, *good[2:]),                         # negative offset
        (Op.READ, good[0] + 2, *good[1:]),                                   # file not registered
        (Op.READ, good[0].astype(float), *good[1:]),                         # not integers
        (Op.READ, good[0].reshape(1, 2), *good[1:]),                         # not 1-D
        (Op.FSYNC, *good),                                                   # not a batch op
        (Op.READ, *good[:3], np.zeros(2, dtype=np.uint64)),                  # address 0
        (Op.READ, good[0], good[1], np.full(2, 1 << 31), good[3]),           # length over the limit
    ]
    for op, *arrays in bad_batches:
        with pytest.raises(InvalidArgument):
            engine.submit(op, *arrays)
    assert engine.batches_in_flight == 0 and engine.stats["entries"] == 0


def test_submit_before_register_files(kind, make_engine):
    engine = make_engine(kind)
    memory = aligned_empty(BLOCK)
    with pytest.raises(FailedPrecondition):
        engine.submit(Op.READ, [0], [0], [BLOCK], [address_of(memory)])


def test_max_batches_in_flight(kind, make_engine, make_files):
    files = make_files(kind, [b"\0" * (1 << 16)])
    engine = make_engine(kind, queue_depth=4, max_batches=2)
    engine.register_files(files.fds)
    memory = aligned_empty(1 << 16)
    arrays = blocks(1, base=address_of(memory))
    first = engine.submit(Op.READ, *arrays)
    engine.submit(Op.READ, *blocks(1, memory_block=1, base=address_of(memory)))
    with pytest.raises(ResourceExhausted):
        engine.submit(Op.READ, *blocks(1, memory_block=2, base=address_of(memory)))
    engine.wait(first)
    engine.submit(Op.READ, *blocks(1, memory_block=2, base=address_of(memory)))


def test_tables_change_only_when_idle(rig):
    engine, files, _, memory = rig
    batch = engine.submit(Op.READ, *blocks(2, base=address_of(memory)))
    with pytest.raises(FailedPrecondition):
        engine.register_files(files.fds)
    with pytest.raises(FailedPrecondition):
        engine.register_buffers([(address_of(memory), memory.size)])
    engine.wait(batch)
    engine.register_files(files.fds[::-1])  # now file index 0 is the second file
    engine.register_buffers([(address_of(memory), memory.size)])


def test_registered_buffers(rig):
    engine, files, initial, memory = rig
    base = address_of(memory)
    with pytest.raises(InvalidArgument):
        engine.register_buffers([(base, 2 * BLOCK), (base + BLOCK, BLOCK)])  # overlap
    with pytest.raises(InvalidArgument):
        engine.register_buffers([(base, 0)])
    engine.register_buffers([(base, 64 * BLOCK), (base + 128 * BLOCK, 64 * BLOCK)])
    outside = aligned_empty(4 * BLOCK)
    if engine.kind == "uring" and _native_checks_addresses():
        # Debug builds refuse what is not inside one registered buffer
        # (tests/native/test_enter_failures.py has the rest of that case).
        with pytest.raises(OSError):
            engine.submit(Op.READ, [0], [0], [2 * BLOCK], [base + 191 * BLOCK])
        return
    # Inside region 0, inside region 1, straddling region 1's end, and memory of its own.
    results = engine.wait(engine.submit(
        Op.READ, [0, 0, 0, 0], [0, BLOCK, 2 * BLOCK, 3 * BLOCK], [BLOCK, BLOCK, 2 * BLOCK, BLOCK],
        [base, base + 128 * BLOCK, base + 191 * BLOCK, address_of(outside)],
    ))
    assert results.tolist() == [BLOCK, BLOCK, 2 * BLOCK, BLOCK]
    assert memory[:BLOCK].tobytes() == initial[0][:BLOCK]
    assert memory[128 * BLOCK: 129 * BLOCK].tobytes() == initial[0][BLOCK: 2 * BLOCK]
    assert memory[191 * BLOCK: 193 * BLOCK].tobytes() == initial[0][2 * BLOCK: 4 * BLOCK]
    assert outside[:BLOCK].tobytes() == initial[0][3 * BLOCK: 4 * BLOCK]
    assert engine.stats["fixed_buffer_entries"] == (2 if engine.kind == "uring" else 0)
    engine.register_buffers([])


def test_fsync(rig):
    engine, files, _, memory = rig
    engine.submit(Op.WRITE, *blocks(4, base=address_of(memory)))
    batch = engine.submit(Op.WRITE, *blocks(4, file=1, base=address_of(memory)))
    engine.fsync(0)                   # covers the writes submitted before it, waited or not
    engine.fsync(1, datasync=False)
    assert engine.wait(batch).tolist() == [BLOCK] * 4
    with pytest.raises(InvalidArgument):
        engine.fsync(2)
    assert engine.stats["fsyncs"] == 2


def test_address_helpers():
    array = aligned_empty(3 * BLOCK)
    assert address_of(array) % BLOCK == 0 and array.size == 3 * BLOCK
    assert address_of(array[BLOCK:]) == address_of(array) + BLOCK
    with pytest.raises(InvalidArgument):
        address_of(array[::2])
    mapping = mmap.mmap(-1, BLOCK)
    assert address_of(mapping) % BLOCK == 0
    mapping.close()  # address_of kept no export of it
    address_of(bytearray(10))
    with pytest.raises(InvalidArgument):
        address_of(memoryview(bytearray(10))[::2])


def test_open_engine_rejects_bad_options():
    with pytest.raises(InvalidArgument):
        open_engine("fallback", queue_depth=0)
    with pytest.raises(InvalidArgument):
        open_engine("fallback", max_batches=10**6)
    with pytest.raises(InvalidArgument):
        open_engine("disk")  # type: ignore[arg-type]


def test_stats_have_the_same_keys(rig):
    engine, _, _, _ = rig
    assert tuple(engine.stats) == STATS_KEYS


def test_uring_wait_releases_the_gil(make_engine, make_files):
    """Another thread runs Python while one thread waits for a long batch."""
    files = make_files("gil", [b"\1" * (16 << 20)])
    engine = make_engine("uring", queue_depth=1)
    engine.register_files(files.fds)
    memory = aligned_empty(16 << 20)
    batch = engine.submit(Op.READ, *blocks(256, base=address_of(memory)))
    window: list[float] = []

    def waiter() -> None:
        window.append(time.perf_counter())
        engine.wait(batch)
        window.append(time.perf_counter())

    thread = threading.Thread(target=waiter)
    ticks: list[float] = []
    thread.start()
    while thread.is_alive():
        ticks.append(time.perf_counter())
    thread.join()
    inside = [tick for tick in ticks if window[0] < tick < window[1]]
    # With the GIL held for the whole wait, no tick could land inside it.
    assert len(inside) > 10, (len(ticks), window[1] - window[0])


def test_os_errors_reach_the_results(kind, make_engine, tmp_path):
    read_only = tmp_path / "read-only.bin"
    read_only.write_bytes(b"\0" * BLOCK)
    fd = os.open(read_only, os.O_RDONLY | os.O_DIRECT)
    try:
        engine = make_engine(kind)
        engine.register_files([fd])
        memory = aligned_empty(BLOCK)
        results = engine.wait(engine.submit(Op.WRITE, [0], [0], [BLOCK], [address_of(memory)]))
        assert results.tolist() == [-errno.EBADF]
    finally:
        os.close(fd)


def test_read_checksums_per_chunk(rig):
    """Two entries of 3 and 1 blocks, checksummed per 4 KiB: cells follow entry order."""
    import crc32c

    engine, files, initial, memory = rig
    base = address_of(memory)
    cells = np.zeros(4, dtype=np.uint32)
    file_index = np.array([0, 1], dtype=np.int32)
    offset = np.array([5 * BLOCK, 9 * BLOCK])
    length = np.array([3 * BLOCK, BLOCK])
    address = np.uint64(base) + np.array([0, 8 * BLOCK], dtype=np.uint64)
    results = engine.wait(engine.submit(Op.READ, file_index, offset, length, address,
                                        checksums=cells, checksum_chunk=BLOCK))
    assert results.tolist() == [3 * BLOCK, BLOCK]
    expected = [crc32c.crc32c(initial[0][(5 + j) * BLOCK:(6 + j) * BLOCK]) for j in range(3)]
    expected.append(crc32c.crc32c(initial[1][9 * BLOCK:10 * BLOCK]))
    assert cells.tolist() == expected
    assert engine.stats["checksum_chunks"] == 4


def test_bad_checksum_requests_raise_before_anything_is_submitted(rig):
    engine, _, _, memory = rig
    arrays = blocks(2, base=address_of(memory))
    bad = [
        ({"checksums": np.zeros(2, dtype=np.uint32)}, "checksum_chunk must be"),  # no chunk
        ({"checksum_chunk": BLOCK}, "without a checksums array"),
        ({"checksums": np.zeros(1, dtype=np.uint32), "checksum_chunk": BLOCK}, "needs 2"),
        ({"checksums": np.zeros(2, dtype=np.int64), "checksum_chunk": BLOCK}, "uint32"),
        ({"checksums": np.zeros(2, dtype=np.uint32), "checksum_chunk": 3000}, "multiple of checksum_chunk"),
    ]
    for kwargs, message in bad:
        with pytest.raises(InvalidArgument, match=message):
            engine.submit(Op.READ, *arrays, **kwargs)
    with pytest.raises(InvalidArgument, match="only read batches"):
        engine.submit(Op.WRITE, *arrays, checksums=np.zeros(2, dtype=np.uint32), checksum_chunk=BLOCK)
    assert engine.batches_in_flight == 0 and engine.stats["entries"] == 0


def _native_checks_addresses() -> bool:
    from kvd.io.uring import _load_native

    return bool(_load_native().CHECKS_ADDRESSES)
