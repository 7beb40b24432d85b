"""crc32c of many equal chunks of memory in one call.

The disk tier checksums every layer of every block it writes; doing that
with one Python call per layer would cost N x L calls per write batch. The
native version (kvd._native.crc32c_chunks, Intel ISA-L underneath) takes
the whole batch's addresses at once and runs with the GIL released. Where
the extension cannot load, the same values come from the `crc32c` package,
one call per chunk; the values are identical (standard crc32c).
"""

from __future__ import annotations

import ctypes

import crc32c
import numpy as np

from kvd.errors import InvalidArgument

try:
    from kvd._native import crc32c_chunks as _native_chunks
except ImportError:  # not built: the fallback engine's world
    _native_chunks = None


def crc32c_chunks(addresses: np.ndarray, chunk: int, chunks: int) -> np.ndarray:
    """(len(addresses), chunks) uint32: crc32c of `chunk` bytes at address + j * chunk.

    The memory must stay mapped for the call; nothing here can check that.
    """
    if chunk <= 0 or chunks < 0:
        raise InvalidArgument(f"chunk must be positive and chunks non-negative, got {chunk}, {chunks}")
    addresses = np.ascontiguousarray(addresses, dtype=np.uint64)
    out = np.empty((len(addresses), chunks), dtype=np.uint32)
    if _native_chunks is not None:
        _native_chunks(addresses, chunk, chunks, out.reshape(-1))
        return out
    chunk_type = ctypes.c_char * chunk
    for i, address in enumerate(addresses.tolist()):
        for j in range(chunks):
            out[i, j] = crc32c.crc32c(chunk_type.from_address(address + j * chunk))
    return out


def crc32c_of_buffers(buffers, chunk: int, chunks: int) -> np.ndarray:
    """crc32c_chunks over bytes-like objects (each at least chunk * chunks bytes), in one call."""
    views = [np.frombuffer(buffer, dtype=np.uint8) for buffer in buffers]
    if any(len(view) < chunk * chunks for view in views):
        raise InvalidArgument(f"every buffer must hold {chunks} chunks of {chunk} bytes")
    addresses = np.array([view.ctypes.data for view in views], dtype=np.uint64)
    return crc32c_chunks(addresses, chunk, chunks)  # `views` keeps the buffers alive until here
