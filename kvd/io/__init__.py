"""kvd.io: batched file I/O for the disk tier (io_uring, or a thread-pool fallback).

Below kvd.tiers; imports only kvd.errors, kvd.invariants, numpy and the
standard library (and its own C extension, kvd._native). See engine.py.
"""

from kvd.io.engine import (
    DIRECT_IO_ALIGN_BYTES,
    STATS_KEYS,
    EngineOptions,
    IoEngine,
    Op,
    address_of,
    aligned_empty,
    open_engine,
    uring_unavailable_reason,
)

__all__ = [
    "DIRECT_IO_ALIGN_BYTES",
    "STATS_KEYS",
    "EngineOptions",
    "IoEngine",
    "Op",
    "address_of",
    "aligned_empty",
    "open_engine",
    "uring_unavailable_reason",
]
