"""A Put stream for daemon crash tests: blocks anyone can re-derive from their key.

Every block's bytes are a function of its key alone (`block_bytes_for`), so
a test can check any block that comes back without keeping a copy of what
was written.

Run as a process (`python -m kvd.testing.put_stream CONTROL_DIR WRITER_ID
SEED`), it streams durable Puts in rounds driven by files in CONTROL_DIR:

  go-<round>     holds the daemon's target; the writer connects and starts
  stop-<round>   the writer finishes the Put in hand, logs "done", waits
  exit           the writer returns

It logs to CONTROL_DIR/writer-<id>.jsonl, one JSON object per line, each
flushed at once: "try" before the Put is sent, "ack" or "err" once put()
has returned or raised, so a reader never sees an acknowledgement that was
not received:

  {"e": "try", "r": round, "id": n, "keys": [hex...], "new": k, "t": time}
      a Put of `keys`, the last k of which this writer has never had
      acknowledged (the others are an acknowledged chain it extends)
  {"e": "ack", "r": round, "id": n, "durable": d, "t": time}
      put(durable=True) returned d: all d = len(keys) keys are durable (a
      put that cannot make every key durable raises: "err")
  {"e": "err", "r": round, "id": n, "code": "UNAVAILABLE", "detail": "...", "t": time}
  {"e": "done", "r": round}

`read_log` skips a torn last line (a writer killed while writing it).
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import random
import signal
import sys
import time
from pathlib import Path

import grpc
import numpy as np

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec

# Two layers of 4 KiB (each one aligned extent on disk): 8 KiB blocks.
SPEC = NamespaceSpec(
    model_id="crash-model", num_layers=2, num_kv_heads=1, head_dim=32, block_tokens=16, kv_dtype=DType.FLOAT32
)
MAX_NEW_BLOCKS = 8
MAX_CHAIN_BLOCKS = 24
EXTEND_PROBABILITY = 0.3
RPC_TIMEOUT_S = 20.0
POLL_S = 0.01


def block_bytes_for(key: bytes, block_bytes: int = SPEC.block_bytes) -> bytes:
    """The content of the block stored under `key`: the key, then bytes seeded by it."""
    seed = int.from_bytes(hashlib.sha256(b"kvd-crash-block" + key).digest()[:8], "little")
    return key + np.random.default_rng(seed).bytes(block_bytes - len(key))


def blocks_for(keys: list[bytes], spec: NamespaceSpec = SPEC) -> np.ndarray:
    """(len(keys), *block_shape) float32 blocks; block i is block_bytes_for(keys[i])."""
    raw = b"".join(block_bytes_for(key, spec.block_bytes) for key in keys)
    return np.frombuffer(raw, dtype=np.float32).reshape(len(keys), *spec.block_shape).copy()


def read_log(path: Path) -> list[dict]:
    """The complete lines of a writer log (a torn last line is dropped)."""
    if not path.exists():
        return []
    text = path.read_text()
    lines = text.split("\n")
    return [json.loads(line) for line in lines[:-1] if line]


class _Log:
    def __init__(self, file) -> None:
        self._file = file

    def write(self, **record) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()


def _wait_for(path: Path, exit_path: Path) -> bool:
    """Wait until `path` exists (True) or `exit_path` does (False)."""
    while not path.exists():
        if exit_path.exists():
            return False
        time.sleep(POLL_S)
    return True


def _round(client, namespace, log: _Log, rng: random.Random, acked: list[list[bytes]], round_: int,
           stop_path: Path, next_id: int) -> int:
    while not stop_path.exists():
        base: list[bytes] = []
        if acked and rng.random() < EXTEND_PROBABILITY:
            # Extend a chain acknowledged earlier (maybe in an earlier round,
            # so its blocks may be on disk only by now).
            candidate = rng.choice(acked)
            if len(candidate) < MAX_CHAIN_BLOCKS:
                base = candidate
        new = rng.randint(1, min(MAX_NEW_BLOCKS, MAX_CHAIN_BLOCKS - len(base)))
        tokens = [rng.randrange(1 << 31) for _ in range(new * SPEC.block_tokens)]
        keys = base + namespace.keys(tokens, parent=base[-1] if base else None)
        next_id += 1
        log.write(e="try", r=round_, id=next_id, keys=[key.hex() for key in keys], new=new, t=time.time())
        try:
            durable = client.put(namespace, keys, blocks_for(keys), durable=True)
        except grpc.RpcError as error:
            log.write(e="err", r=round_, id=next_id, code=error.code().name, detail=str(error.details())[:300],
                      t=time.time())
            time.sleep(POLL_S)
            continue
        log.write(e="ack", r=round_, id=next_id, durable=durable, t=time.time())
        acked.append(keys)
    return next_id


def main(argv: list[str]) -> int:
    control, writer_id, seed = Path(argv[0]), int(argv[1]), int(argv[2])
    # SIGUSR1 prints every thread's stack: how a test shows where a writer hangs.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    rng = random.Random(seed * 1_000_003 + writer_id)
    with open(control / f"writer-{writer_id}.jsonl", "a") as file:
        return _run(control, writer_id, rng, _Log(file))


def _run(control: Path, writer_id: int, rng: random.Random, log: _Log) -> int:
    exit_path = control / "exit"
    acked: list[list[bytes]] = []
    next_id = writer_id * 10**9
    round_ = 0
    while _wait_for(control / f"go-{round_}", exit_path):
        target = (control / f"go-{round_}").read_text().strip()
        stop_path = control / f"stop-{round_}"
        try:
            with Client(target, timeout_s=RPC_TIMEOUT_S) as client:
                namespace = client.register_namespace(SPEC)
                next_id = _round(client, namespace, log, rng, acked, round_, stop_path, next_id)
        except grpc.RpcError as error:
            # The daemon died before this writer had registered.
            log.write(e="err", r=round_, id=-1, code=error.code().name, detail=str(error.details())[:300],
                      t=time.time())
        _wait_for(stop_path, exit_path)
        log.write(e="done", r=round_)
        round_ += 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
