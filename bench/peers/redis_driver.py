#!/usr/bin/env python3
"""Redis as a host-memory contender of bench_peers.py (redis-server from Debian, redis-py with hiredis).

    .venv/bin/python bench/peers/redis_driver.py '<Workload JSON>'

A throwaway redis-server on loopback holds one value per block; a Get is
pipelined GETs (PIPELINE_BLOCKS at a time) and a copy of each value into
the caller's buffer; a lookup is one pipeline of EXISTS, one per key.
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import protocol  # noqa: E402
from _common import RedisServer, redis_info  # noqa: E402

PIPELINE_BYTES = 64 << 20  # values per pipeline: at most this many bytes in flight


def key_of(index: int, salt: bytes = b"") -> bytes:
    return hashlib.blake2b(salt + index.to_bytes(8, "little"), digest_size=32).digest()


class RedisContender:
    def __init__(self, workload: protocol.Workload, client) -> None:
        self.workload = workload
        self.client = client
        self.buffer = protocol.aligned_buffer(workload.total_bytes)
        protocol.fill(self.buffer, workload.seed)
        self.rows = self.buffer.reshape(workload.blocks, workload.block_bytes)
        self.keys = [key_of(i) for i in range(workload.blocks)]
        self.per_pipeline = max(1, PIPELINE_BYTES // workload.block_bytes)

    def _batches(self):
        for start in range(0, len(self.keys), self.per_pipeline):
            yield start, self.keys[start:start + self.per_pipeline]

    def put_memory(self, command: dict) -> dict:
        for start, keys in self._batches():
            pipe = self.client.pipeline(transaction=False)
            for offset, key in enumerate(keys):
                pipe.set(key, memoryview(self.rows[start + offset]))
            pipe.execute()
        return {"ok": True}

    def _get_all(self) -> None:
        for start, keys in self._batches():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.get(key)
            for offset, value in enumerate(pipe.execute()):
                self.rows[start + offset] = np.frombuffer(value, dtype=np.uint8)

    def get_memory(self, command: dict) -> dict:
        protocol.scramble(self.buffer)
        seconds, _ = protocol.timed(self._get_all)
        ok = protocol.check(self.buffer, self.workload.seed)
        return {"seconds": seconds, "ok": bool(ok), "pipeline_blocks": self.per_pipeline}

    def lookup(self, command: dict) -> dict:
        count, repeats = int(command["keys"]), int(command.get("repeats", 20))
        keys = [key_of(i, b"lookup") for i in range(count)]
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.set(key, b"1")
        pipe.execute()

        def ask() -> list:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            return pipe.execute()

        latencies, ok = [], True
        for _ in range(repeats):
            seconds, answers = protocol.timed(ask)
            latencies.append(seconds)
            ok = ok and sum(answers) == count
        return {"latencies_s": latencies, "ok": ok}

    def handlers(self) -> dict:
        return {"put_memory": self.put_memory, "get_memory": self.get_memory, "lookup": self.lookup}


def main() -> None:
    workload = protocol.Workload.from_json(sys.argv[1])
    info = redis_info()
    with tempfile.TemporaryDirectory(prefix="kvd-peers-redis-") as scratch, RedisServer(Path(scratch)) as server:
        contender = RedisContender(workload, server.client())
        protocol.serve("redis", f"{info.get('redis_server_version', '?')}; redis-py {info.get('redis_py_version')}",
                       contender.handlers())


if __name__ == "__main__":
    main()
