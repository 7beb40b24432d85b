"""io_uring_enter failing under the ring (issue 10, item 8).

A failed io_uring_enter used to leave its batch's slot in use (and fsync
never freed its slot), so max_batches failures made every later submit
-EAGAIN for good; EAGAIN and EBUSY were retried in a busy spin. Now every
wait completes its batch: entries the kernel was not given carry the
errno, those it holds their real results, and the slot is free again.
"""

from __future__ import annotations

import errno

import numpy as np
import pytest

from kvd.io import Op, address_of, aligned_empty
from kvd.io.uring import _load_native

BLOCK = 4096
MAX_BATCHES = 4
QUEUE_DEPTH = 4


@pytest.fixture
def rig(make_engine, make_files):
    rng = np.random.default_rng(5)
    initial = [rng.integers(0, 256, 256 << 10, dtype=np.uint8).tobytes()]
    files = make_files("uring", initial)
    engine = make_engine("uring", queue_depth=QUEUE_DEPTH, max_batches=MAX_BATCHES)
    engine.register_files(files.fds)
    memory = aligned_empty(64 * BLOCK)
    return engine, initial[0], memory


def read_batch(engine, memory, count: int):
    return engine.submit(Op.READ, np.zeros(count, dtype=np.int32), np.arange(count) * BLOCK,
                         np.full(count, BLOCK), address_of(memory) + np.arange(count, dtype=np.uint64) * BLOCK)


@pytest.mark.parametrize("code", [errno.EIO, errno.EBADF])
def test_more_failed_enters_than_batches_leave_the_ring_usable(rig, code):
    engine, initial, memory = rig
    for round_ in range(MAX_BATCHES + 3):
        engine.fail_enters(code, 1)
        results = engine.wait(read_batch(engine, memory, 16)).tolist()
        # The entries the kernel had when enter failed (at least the first
        # queue-depth) complete for real, in order; the rest were never
        # given to it and carry -errno.
        done = results.index(-code)
        assert QUEUE_DEPTH <= done and results == [BLOCK] * done + [-code] * (16 - done), (round_, results)
        assert memory[: done * BLOCK].tobytes() == initial[: done * BLOCK]
        engine.fail_enters(code, 1)
        engine.fsync(0, datasync=True)  # no error: its entry was with the kernel, and completed
    engine.fail_enters(code, 0)  # an fsync reaped without entering the kernel leaves its failure unused
    stats = engine.stats
    # Every read batch entered (16 entries, queue depth 4): each met its failure.
    assert stats["enter_errors"] == stats["faults_injected"] >= MAX_BATCHES + 3
    results = engine.wait(read_batch(engine, memory, 16))
    assert results.tolist() == [BLOCK] * 16
    assert memory[: 16 * BLOCK].tobytes() == initial[: 16 * BLOCK]


@pytest.mark.parametrize("code", [errno.EAGAIN, errno.EBUSY, errno.EINTR, errno.ENOMEM])
def test_transient_enter_failures_are_retried_and_lose_nothing(rig, code):
    engine, initial, memory = rig
    engine.fail_enters(code, 50)
    results = engine.wait(read_batch(engine, memory, 16))
    assert results.tolist() == [BLOCK] * 16
    assert memory[: 16 * BLOCK].tobytes() == initial[: 16 * BLOCK]
    assert engine.stats["enter_errors"] == (0 if code == errno.EINTR else 50)


def test_addresses_outside_registered_buffers(rig):
    """Debug and sanitizer builds (`make native-debug`, `make native-sanitize`)
    refuse an entry outside every registered buffer (EFAULT) before any I/O;
    release builds take it as a plain, unregistered read."""
    engine, initial, memory = rig
    engine.register_buffers([(address_of(memory), 8 * BLOCK)])
    inside = read_batch(engine, memory, 8)
    assert engine.wait(inside).tolist() == [BLOCK] * 8
    if _load_native().CHECKS_ADDRESSES:
        with pytest.raises(OSError) as raised:
            read_batch(engine, memory, 9)  # the 9th block lies past the registered 8
        assert raised.value.errno == errno.EFAULT
    else:
        assert engine.wait(read_batch(engine, memory, 9)).tolist() == [BLOCK] * 9
        assert memory[: 9 * BLOCK].tobytes() == initial[: 9 * BLOCK]
