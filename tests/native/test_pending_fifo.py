"""The pending FIFO after a failed io_uring_enter (issue 35, item 5).

Batches whose entries are not all in the kernel yet wait in a FIFO of
slots. A non-transient enter failure fails the waited batch's entries the
kernel was not given; when that batch stood behind a partly prepared one,
its slot used to stay in the FIFO after the slot was freed. The next batch
took the slot and was prepared at the stale, earlier position: an fsync
(IOSQE_IO_DRAIN) reached the kernel ahead of writes submitted before it,
and returned while they were still unwritten.

These tests drive kvd._native.Ring directly (their own results arrays,
filled with a sentinel) on a real O_DIRECT file, queue depth 4: batch A
has more entries than the queue holds, B and C wait behind it.
"""

from __future__ import annotations

import errno

import numpy as np
import pytest

from kvd.io import Op, address_of, aligned_empty
from kvd.io.uring import _load_native
from tests.native.conftest import require_uring

BLOCK = 4096
QUEUE_DEPTH = 4
MAX_BATCHES = 8
UNSET = -(1 << 40)  # never a byte count or -errno


class Rig:
    """A raw ring over one registered file, and the batches it has in flight."""

    def __init__(self, fd: int, memory: np.ndarray) -> None:
        self.ring = _load_native().Ring(QUEUE_DEPTH, MAX_BATCHES)
        self.ring.register_files(np.array([fd], dtype=np.int32))
        self.memory = memory
        self.results: dict[int, np.ndarray] = {}

    def write(self, first_block: int, count: int) -> int:
        """Writes blocks [first_block, first_block + count) from the same blocks of memory."""
        blocks = np.arange(first_block, first_block + count)
        results = np.full(count, UNSET, dtype=np.int64)
        batch = self.ring.submit(int(Op.WRITE), np.zeros(count, dtype=np.int32), (blocks * BLOCK).astype(np.int64),
                                 np.full(count, BLOCK, dtype=np.uint32),
                                 np.uint64(address_of(self.memory)) + (blocks * BLOCK).astype(np.uint64), results)
        self.results[batch] = results
        return batch

    def wait(self, batch: int) -> list[int]:
        self.ring.wait(batch)
        return self.results.pop(batch).tolist()


@pytest.fixture
def rig(make_files):
    require_uring()
    rng = np.random.default_rng(35)
    initial = rng.integers(0, 256, 64 * BLOCK, dtype=np.uint8).tobytes()
    files = make_files("fifo", [initial])
    memory = aligned_empty(64 * BLOCK)
    memory[:] = rng.integers(0, 256, memory.size, dtype=np.uint8)
    made = Rig(files.fds[0], memory)
    yield made, files, initial
    made.ring.close()


def start_three(rig: Rig, code: int) -> tuple[int, int, int]:
    """A (32 writes, partly prepared), B (4) and C (16) behind it; B's wait
    meets a non-transient enter failure while A still holds the queue."""
    a = rig.write(0, 32)
    b = rig.write(32, 4)
    c = rig.write(36, 16)
    assert rig.ring.pending_batches == (a, b, c)
    rig.ring.fail_enters(code, 1)
    assert rig.wait(b) == [-code] * 4  # none of B was in the kernel: A was ahead of it
    return a, b, c


def unset(rig: Rig, *batches: int) -> int:
    """Entries of these batches not reaped yet."""
    return sum(int((rig.results[batch] == UNSET).sum()) for batch in batches)


def expected_file(initial: bytes, memory: np.ndarray, written: list[range]) -> bytes:
    content = bytearray(initial)
    for blocks in written:
        span = slice(blocks.start * BLOCK, blocks.stop * BLOCK)
        content[span] = memory[span].tobytes()
    return bytes(content)


@pytest.mark.parametrize("code", [errno.EIO, errno.EBADF])
def test_fsync_behind_a_failed_batch_waits_for_every_earlier_write(rig, code):
    rig, files, initial = rig
    a, _, c = start_three(rig, code)
    assert rig.ring.fsync(0, True) == 0
    # The fsync is drained: every entry submitted before it completed first,
    # so their results were reaped by the time it returned.
    assert unset(rig, a, c) == 0, (rig.results[a].tolist(), rig.results[c].tolist())
    assert rig.ring.pending_batches == ()
    assert rig.wait(a) == [BLOCK] * 32
    assert rig.wait(c) == [BLOCK] * 16
    assert rig.ring.batches_in_flight == 0
    assert files.contents()[0] == expected_file(initial, rig.memory, [range(32), range(36, 52)])


@pytest.mark.parametrize("code", [errno.EIO, errno.EBADF])
def test_a_freed_slot_is_not_reused_from_its_old_place_in_the_fifo(rig, code):
    rig, files, initial = rig
    a, _, c = start_three(rig, code)
    # B left the FIFO with its failure; A and C keep their order.
    assert rig.ring.pending_batches == (a, c)
    d = rig.write(52, 4)  # takes B's freed slot: it must queue behind C, once
    assert rig.ring.pending_batches == (a, c, d)
    assert rig.wait(d) == [BLOCK] * 4
    # D went to the kernel after every entry of A and C: when it is done,
    # at most a queue's worth of theirs can still be there.
    assert unset(rig, a, c) <= QUEUE_DEPTH, (rig.results[a].tolist(), rig.results[c].tolist())
    assert rig.ring.pending_batches == ()
    assert rig.wait(c) == [BLOCK] * 16
    assert rig.wait(a) == [BLOCK] * 32
    # The ring goes on: more failures than slots leave nothing behind in the FIFO.
    for round_ in range(MAX_BATCHES + 2):
        a, _, c = start_three(rig, code)
        assert rig.ring.fsync(0, True) == 0, round_
        assert (rig.wait(c), rig.wait(a)) == ([BLOCK] * 16, [BLOCK] * 32), round_
        assert rig.ring.pending_batches == () and rig.ring.batches_in_flight == 0, round_
    written = [range(32), range(36, 56)]
    assert files.contents()[0] == expected_file(initial, rig.memory, written)
