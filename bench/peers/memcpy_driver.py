#!/usr/bin/env python3
"""The memcpy reference of bench_peers.py: the bytes copied from memory into the caller's buffer.

    .venv/bin/python bench/peers/memcpy_driver.py '<Workload JSON>' THREADS

One source array (the "store") and the caller's buffer in one process; a
Get is numpy copies of equal stripes on THREADS threads (numpy releases
the GIL while copying). This is the ceiling for a host-memory Get that
copies with THREADS threads: a store that hands over the same bytes
cannot beat it.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import protocol  # noqa: E402


class MemcpyContender:
    def __init__(self, workload: protocol.Workload, threads: int) -> None:
        self.workload = workload
        self.buffer = protocol.aligned_buffer(workload.total_bytes)
        self.source = protocol.aligned_buffer(workload.total_bytes)
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads)
        bounds = [workload.total_bytes * i // threads // 4096 * 4096 for i in range(threads)] + [workload.total_bytes]
        self.stripes = list(zip(bounds, bounds[1:]))

    def put_memory(self, command: dict) -> dict:
        protocol.fill(self.source, self.workload.seed)
        return {"ok": True}

    def _copy(self) -> None:
        list(self.pool.map(lambda span: np.copyto(self.buffer[span[0]:span[1]], self.source[span[0]:span[1]]),
                           self.stripes))

    def get_memory(self, command: dict) -> dict:
        protocol.scramble(self.buffer)
        seconds, _ = protocol.timed(self._copy)
        return {"seconds": seconds, "ok": bool(protocol.check(self.buffer, self.workload.seed))}

    def handlers(self) -> dict:
        return {"put_memory": self.put_memory, "get_memory": self.get_memory}


def main() -> None:
    workload = protocol.Workload.from_json(sys.argv[1])
    threads = int(sys.argv[2])
    protocol.serve(f"memcpy x{threads}", f"numpy {np.__version__}", MemcpyContender(workload, threads).handlers())


if __name__ == "__main__":
    main()
