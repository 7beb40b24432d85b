"""The io_uring engine against the thread-pool oracle, on real O_DIRECT files.

Each seed drives both engines through the same steps. A step submits one
to three batches (reads and writes), keeps them all in flight, then waits
them in a random order; sometimes a fault rule is injected into both
engines first. Both sides start from identical files and identical memory,
so after every step the results arrays and the memory must match exactly,
and at the end the files must match byte for byte.

Entries in one step never overlap, in memory or in a file, so the order in
which the kernel runs them cannot change the outcome. They do cover the
awkward cases: reads past the end of a file (short or empty), writes that
extend a file, an end of file that is not block aligned, zero-length
entries, misaligned O_DIRECT entries (-EINVAL), batches larger than the
queue depth, registered buffers (odd seeds), and every fault kind (EIO,
ENOSPC, short transfers aligned or not, short to zero bytes). Read batches
whose lengths allow it often ask for per-4 KiB checksums; both engines'
cells must match each other and an independent crc32c of what was read.

Memory is compared where its value is defined: bytes [0, result) of every
read, and every byte no read covers (those must still hold what the step
started with). The rest of a read's buffer is not: a failed O_DIRECT read
may have written some of it (on ext4 a misaligned read over a hole or past
the end of the file zeroes that part, then fails with EINVAL), as may a
read cut short by the end of the file.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

import crc32c
import numpy as np
import pytest

from kvd.io import Op, address_of, aligned_empty


def random_bytes(rng: np.random.Generator, nbytes: int) -> bytes:
    return rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()

FILES = 3
CHUNK_BYTES = 64 << 10       # an entry stays inside one chunk of a file...
CHUNKS_PER_FILE = 20         # ...and chunks reach past every file's end
INITIAL_SIZES = [1 << 20, (1 << 20) - 1000, 256 << 10]  # file 1 ends mid-block
MAX_STEP_ENTRIES = 48
ARENA_BYTES = MAX_STEP_ENTRIES * CHUNK_BYTES + 4096  # a slot per entry, +slack for misalignment
STEPS = 24
CHECKSUM_CHUNK = 4096
UNTOUCHED = 0xDEADBEEF  # cells of entries not read in full must keep it


@dataclass
class Side:
    engine: object
    files: object
    arena: np.ndarray

    @property
    def base(self) -> int:
        return address_of(self.arena)


def plan_step(rng: np.random.Generator, sizes: list[int]) -> list[tuple[Op, dict[str, np.ndarray]]]:
    """One to three non-overlapping batches, as (op, arrays with arena-relative addresses).

    `sizes` are the files' sizes before the step. The end of a file is
    shared state: a read reaching past it returns more or less depending
    on whether a concurrent write extended the file first. So when a step
    extends a file, its reads of that file stay below the old end.
    """
    entry_count = int(rng.integers(1, MAX_STEP_ENTRIES + 1))
    pairs = rng.choice(FILES * CHUNKS_PER_FILE, size=entry_count, replace=False)
    file_index = (pairs // CHUNKS_PER_FILE).astype(np.int32)
    chunk = pairs % CHUNKS_PER_FILE
    blocks = rng.integers(0, CHUNK_BYTES // 4096 + 1, size=entry_count)        # 0..16 blocks
    start_block = rng.integers(0, CHUNK_BYTES // 4096 - blocks + 1)
    length = blocks * 4096
    offset = chunk * CHUNK_BYTES + start_block * 4096
    memory = np.arange(entry_count) * CHUNK_BYTES  # slot i of the arena
    # A few entries break O_DIRECT alignment in one of three ways.
    broken = rng.random(entry_count) < 0.08
    how = rng.integers(0, 3, size=entry_count)
    offset = np.where(broken & (how == 0), offset + 1, offset)
    memory = np.where(broken & (how == 1), memory + 1, memory)
    length = np.where(broken & (how == 2) & (length > 0), length - 100, length)

    batch_count = int(rng.integers(1, 4))
    cuts = np.sort(rng.choice(np.arange(1, entry_count), size=min(batch_count - 1, entry_count - 1), replace=False))
    parts = np.split(np.arange(entry_count), cuts)
    ops = [Op.WRITE if rng.random() < 0.5 else Op.READ for _ in parts]
    end = offset + length
    size = np.asarray(sizes)[file_index]
    extended = {int(f) for part, op in zip(parts, ops) if op == Op.WRITE
                for f in file_index[part][end[part] > size[part]]}
    batches = []
    for part, op in zip(parts, ops, strict=True):
        if op == Op.READ:
            racy = np.isin(file_index[part], list(extended)) & (end[part] > size[part])
            part = part[~racy]
        batches.append((op, {
            "file_index": file_index[part], "offset": offset[part].astype(np.int64),
            "length": length[part].astype(np.int64), "memory": memory[part].astype(np.uint64),
        }))
    return batches


def random_fault(rng: np.random.Generator) -> dict:
    op = [Op.READ, Op.WRITE][int(rng.integers(0, 2))]
    fault: dict = {"count": int(rng.integers(1, 4))}
    if rng.random() < 0.5:
        fault["file_index"] = int(rng.integers(0, FILES))
    if rng.random() < 0.5:
        begin = int(rng.integers(0, CHUNKS_PER_FILE)) * CHUNK_BYTES
        fault["offset_range"] = (begin, begin + int(rng.integers(1, 6)) * CHUNK_BYTES)
    kind = int(rng.integers(0, 5))
    if kind == 0:
        fault["errno"] = errno.EIO
    elif kind == 1:
        fault["errno"] = errno.ENOSPC
    elif kind == 2:
        fault["short_bytes"] = int(rng.integers(0, 16)) * 4096      # aligned: a real short transfer
    elif kind == 3:
        fault["short_bytes"] = 0
    else:
        fault["short_bytes"] = int(rng.integers(1, 4096))           # misaligned: the kernel says -EINVAL
    return {"op": op, **fault}


def check_checksums(arena: np.ndarray, arrays: dict[str, np.ndarray], results: np.ndarray,
                    cells: np.ndarray) -> None:
    """Cells of full reads hold the crc32c of each chunk read; others are untouched."""
    first = 0
    for memory, length, result in zip(arrays["memory"].tolist(), arrays["length"].tolist(), results.tolist(),
                                      strict=True):
        count = length // CHECKSUM_CHUNK
        if result == length:
            expected = [crc32c.crc32c(arena[memory + j * CHECKSUM_CHUNK:memory + (j + 1) * CHECKSUM_CHUNK])
                        for j in range(count)]
        else:
            expected = [UNTOUCHED] * count
        assert cells[first:first + count].tolist() == expected
        first += count


def defined_bytes(batches: list[tuple[Op, dict[str, np.ndarray]]], results: list[np.ndarray]) -> np.ndarray:
    """Arena bytes whose value is defined after the step: not in any read's buffer, or read."""
    mask = np.ones(ARENA_BYTES, dtype=bool)
    for (op, arrays), got in zip(batches, results, strict=True):
        if op != Op.READ:
            continue
        for memory, length, result in zip(arrays["memory"].tolist(), arrays["length"].tolist(), got.tolist(),
                                          strict=True):
            mask[memory:memory + length] = False
            mask[memory:memory + max(result, 0)] = True
    return mask


@pytest.mark.parametrize("seed", range(8))
def test_random_batches_match_the_oracle(seed, make_engine, make_files):
    rng = np.random.default_rng(seed)
    queue_depth = int(rng.choice([1, 4, 32]))
    initial_files = [random_bytes(rng, size) for size in INITIAL_SIZES]
    initial_arena = rng.integers(0, 256, ARENA_BYTES, dtype=np.uint8)
    sides = []
    for kind in ("uring", "fallback"):
        side = Side(make_engine(kind, queue_depth), make_files(kind, initial_files), aligned_empty(ARENA_BYTES))
        side.arena[:] = initial_arena
        side.engine.register_files(side.files.fds)
        if seed % 2:  # half the seeds through READ_FIXED/WRITE_FIXED
            side.engine.register_buffers([(side.base, ARENA_BYTES)])
        sides.append(side)
    native, oracle = sides

    for step in range(STEPS):
        if rng.random() < 0.3:
            fault = random_fault(rng)
            for side in sides:
                side.engine.inject_fault(**fault)
        # Writes take their bytes from the arena: fresh ones each step.
        fresh = rng.integers(0, 256, ARENA_BYTES, dtype=np.uint8)
        for side in sides:
            side.arena[:] = fresh
        sizes = [os.fstat(fd).st_size for fd in oracle.files.fds]
        assert sizes == [os.fstat(fd).st_size for fd in native.files.fds]
        batches = plan_step(rng, sizes)
        wanted = [op == Op.READ and not np.any(arrays["length"] % CHECKSUM_CHUNK) and rng.random() < 0.7
                  for op, arrays in batches]
        # Each side's own cells, written by its engine until the batch is waited.
        cells = [[np.full(int((arrays["length"] // CHECKSUM_CHUNK).sum()), UNTOUCHED, dtype=np.uint32)
                  if want else None for (_, arrays), want in zip(batches, wanted, strict=True)] for _ in sides]
        ids = [[side.engine.submit(op, arrays["file_index"], arrays["offset"], arrays["length"],
                                   arrays["memory"] + np.uint64(side.base), checksums=out,
                                   checksum_chunk=CHECKSUM_CHUNK if out is not None else 0)
                for (op, arrays), out in zip(batches, side_cells, strict=True)]
               for side, side_cells in zip(sides, cells, strict=True)]
        order = rng.permutation(len(batches))
        results: list[np.ndarray] = [np.empty(0)] * len(batches)
        for position in order:
            got = results[position] = native.engine.wait(ids[0][position])
            want = oracle.engine.wait(ids[1][position])
            np.testing.assert_array_equal(got, want, err_msg=f"seed {seed} step {step} batch {position}")
            if wanted[position]:
                np.testing.assert_array_equal(cells[0][position], cells[1][position],
                                              err_msg=f"seed {seed} step {step} batch {position}: checksums")
                check_checksums(native.arena, batches[position][1], got, cells[0][position])
        assert native.engine.batches_in_flight == oracle.engine.batches_in_flight == 0
        defined = defined_bytes(batches, results)
        assert np.array_equal(native.arena[defined], oracle.arena[defined]), f"seed {seed} step {step}: read bytes differ"
        covered = defined_bytes(batches, [np.zeros_like(got) for got in results])
        assert np.array_equal(native.arena[covered], fresh[covered]), f"seed {seed} step {step}: memory no read covers changed"

    assert native.files.contents() == oracle.files.contents()
    native_stats, oracle_stats = native.engine.stats, oracle.engine.stats
    # The system-call counts differ by design (that is the point); the I/O does not.
    for key in ("entries", "batches", "bytes_read", "bytes_written", "errors", "short_transfers", "faults_injected",
                "checksum_chunks"):
        assert native_stats[key] == oracle_stats[key], key
    assert native_stats["submit_calls"] <= oracle_stats["submit_calls"]
    assert (native_stats["fixed_buffer_entries"] > 0) == bool(seed % 2)
