"""Memory on transparent huge pages, for buffers the kernel DMAs into (the I/O ring proxy's staging).

On the development VM the ring's O_DIRECT reads into staging on 4 KiB pages ran up to 3x slower than
into huge pages (bench/bench_io_ring.py, docs/GPU.md). Shared memory (a memfd, and `mmap(-1, n)` in
Python) gets huge pages only where the kernel's shmem_enabled allows, so these buffers are private.
A leaf: numpy and the standard library only.
"""

from __future__ import annotations

import mmap

import numpy as np

HUGE_PAGE = 2 << 20


def huge_page_memory(nbytes: int) -> memoryview:
    """Anonymous private memory on 2 MiB boundaries, advised into transparent huge pages and touched
    (every page faulted in now, not in the first reads)."""
    whole = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -np.frombuffer(whole, dtype=np.uint8).ctypes.data % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        whole.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    view = memoryview(whole)[start:start + nbytes]
    np.frombuffer(view, dtype=np.uint8)[::4096] = 0
    return view
