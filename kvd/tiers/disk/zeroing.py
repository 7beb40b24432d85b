"""Writing zeros over new segment files (disk.zero_segments).

posix_fallocate reserves a segment's space as unwritten extents; the first
O_DIRECT write into each then also converts it in the file system (on ext4
a journalled metadata change per write, paid when the write completes).
Zeroing the file once when it is created makes every later write an
overwrite, so a tier's first fill stores as fast as one that has run a
while. Zeros are what an unwritten extent reads as, so no reader can tell
the two apart: a slot of zeros holds no record.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from kvd.invariants import check
from kvd.io.engine import aligned_empty
from kvd.tiers.disk.layout import ALIGN_BYTES

CHUNK_BYTES = 8 << 20  # one O_DIRECT write


def zero_range(path: Path, start: int, stop: int) -> None:
    """Write zeros over bytes [start, stop) of `path` (both 4 KiB aligned), O_DIRECT, then fdatasync."""
    check(0 <= start <= stop and start % ALIGN_BYTES == 0 and stop % ALIGN_BYTES == 0,
          "zeroing needs a 4 KiB aligned range, got [{}, {})", start, stop)
    if start == stop:
        return
    zeros = aligned_empty(min(CHUNK_BYTES, stop - start))
    zeros[:] = 0
    fd = os.open(path, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
    try:
        offset = start
        while offset < stop:
            length = min(len(zeros), stop - offset)
            written = os.pwrite(fd, memoryview(zeros)[:length], offset)
            if written != length:  # the drive's doing, not ours: the caller reports it as a failed preallocation
                raise OSError(errno.EIO, f"short write zeroing {path} at {offset}: {written} of {length} bytes")
            offset += length
        os.fdatasync(fd)
    finally:
        os.close(fd)
