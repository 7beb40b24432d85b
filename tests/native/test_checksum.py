"""kvd.io.checksum: crc32c of many chunks in one call, native and pure Python."""

from __future__ import annotations

import crc32c
import numpy as np
import pytest

import kvd.io.checksum as checksum
from kvd.errors import InvalidArgument
from kvd.io import address_of, aligned_empty


@pytest.mark.parametrize("native", [True, False])
def test_chunks_match_the_crc32c_package(native, monkeypatch):
    if not native:
        monkeypatch.setattr(checksum, "_native_chunks", None)
    else:
        assert checksum._native_chunks is not None, "kvd._native is not built"
    rng = np.random.default_rng(11)
    memory = aligned_empty(1 << 20)
    memory[:] = rng.integers(0, 256, memory.size, dtype=np.uint8)
    base = address_of(memory)
    chunk, chunks = 12_288, 5  # not a power of two; 60 KiB per address
    starts = np.array([0, 61_440, 300_000, 1_000], dtype=np.uint64)
    out = checksum.crc32c_chunks(np.uint64(base) + starts, chunk, chunks)
    assert out.shape == (4, chunks) and out.dtype == np.uint32
    for i, start in enumerate(starts.tolist()):
        for j in range(chunks):
            piece = memory[start + j * chunk:start + (j + 1) * chunk]
            assert int(out[i, j]) == crc32c.crc32c(piece.tobytes()), (i, j)
    # A flipped bit changes exactly the chunk that holds it.
    memory[61_440 + 2 * chunk + 77] ^= 0x10
    again = checksum.crc32c_chunks(np.uint64(base) + starts, chunk, chunks)
    assert (again != out).sum() == 1 and again[1, 2] != out[1, 2]


def test_empty_and_bad_arguments():
    assert checksum.crc32c_chunks(np.zeros(0, dtype=np.uint64), 4096, 3).shape == (0, 3)
    with pytest.raises(InvalidArgument):
        checksum.crc32c_chunks(np.zeros(1, dtype=np.uint64), 0, 1)
