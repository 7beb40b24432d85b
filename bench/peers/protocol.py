"""The line protocol between bench_peers.py and one contender's driver.

Every contender (kvd, vLLM's FS tier, LMCache, Mooncake, Redis, memcpy) runs
as a long-lived process in its own virtual environment, so that each peer
gets the Python packages it was built for, and so that rounds can be
interleaved without paying any start-up inside a timed section. This module
is imported by the orchestrator and by every driver, so it uses only the
standard library and numpy.

The driver is started as ``<venv>/bin/python bench/peers/<driver>.py`` with
the workload as one JSON object in argv[1] (see `Workload`). It prints one
JSON line ``{"ready": true, "name": ..., "version": ...}`` on stdout, then
answers one JSON line per command read from stdin:

    {"op": "store", "sync": false}   write every block to the peer's disk
                                     store; with "sync", also make it durable
                                     (fsync/syncfs) inside the timed section
    {"op": "clear"}                  remove what was stored (not timed)
    {"op": "cold"}                   drop every in-memory copy the peer holds,
                                     so that the next restore reads the disk
                                     (the orchestrator then drops the page cache)
    {"op": "restore"}                read every block into the caller's
                                     buffer; timed; then checked (not timed)
    {"op": "put_memory"}             put every block into the peer's memory
                                     tier (not timed)
    {"op": "get_memory"}             get every block from the memory tier
                                     into the caller's buffer; timed; checked
    {"op": "lookup", "keys": n, "repeats": r}
                                     after put_memory: ask r times whether the
                                     first n block keys are present, in one
                                     call each where the peer can; answers
                                     "latencies_s" (one per repeat)
    {"op": "quit"}

A driver whose peer cannot be built on this host prints instead
``{"ready": false, "could_not_run": "<Type>: <message>", "raised_at": ...}``
(see `refuse`) and exits; the orchestrator keeps that as the contender's row.

Each answer is ``{"seconds": s, "ok": bool, ...}``; extra keys are kept in
the results. An op the driver does not support answers
``{"unsupported": true}``; a failure answers ``{"error": "..."}``.

All drivers hold the same bytes: `fill` writes a pattern that depends on the
seed and the byte position only, and `check` verifies a buffer against it,
so each driver proves its restore returned exactly what it stored without
any driver keeping a second copy of the data.
"""

from __future__ import annotations

import json
import mmap
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_CHECK_CHUNK = 64 << 20


@dataclass(frozen=True)
class Workload:
    """What every contender stores and restores: `blocks` blocks of `layers` layer objects."""

    dir: str  # a fresh directory on the file system under test, one per driver
    layers: int
    layer_bytes: int
    blocks: int
    seed: int = 1
    threads: int = 2  # threads a peer may use where it has the knob

    @property
    def block_bytes(self) -> int:
        return self.layers * self.layer_bytes

    @property
    def total_bytes(self) -> int:
        return self.blocks * self.block_bytes

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Workload:
        return cls(**json.loads(text))


def aligned_buffer(nbytes: int) -> np.ndarray:
    """A page-aligned, prefaulted uint8 buffer (O_DIRECT needs the alignment;
    first-touch faults would otherwise land in the first timed round)."""
    buffer = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    buffer[::mmap.PAGESIZE] = 0
    return buffer


def _pattern(start_word: int, words: int, seed: int) -> np.ndarray:
    index = np.arange(start_word, start_word + words, dtype=np.uint64)
    return (index * _GOLDEN) ^ np.uint64(seed)


def fill(buffer: np.ndarray, seed: int) -> None:
    """Write the pattern of `seed` into a uint8 buffer whose length is a multiple of 8."""
    words = buffer.view(np.uint64)
    for start in range(0, words.size, _CHECK_CHUNK // 8):
        count = min(_CHECK_CHUNK // 8, words.size - start)
        words[start:start + count] = _pattern(start, count, seed)


def check(buffer: np.ndarray, seed: int) -> bool:
    """True when a uint8 buffer holds exactly the pattern `fill` wrote."""
    words = buffer.view(np.uint64)
    for start in range(0, words.size, _CHECK_CHUNK // 8):
        count = min(_CHECK_CHUNK // 8, words.size - start)
        if not np.array_equal(words[start:start + count], _pattern(start, count, seed)):
            return False
    return True


def scramble(buffer: np.ndarray) -> None:
    """Overwrite the caller's buffer before a timed read, so a no-op read fails its check."""
    buffer.view(np.uint64)[:] = np.uint64(0xDEADBEEFDEADBEEF)


def timed(action: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def timed_restore(buffer: np.ndarray, seed: int, action: Callable[[], object]) -> dict:
    """A timed restore into `buffer` (scrambled first, checked after), then the pattern put back:
    the buffer is also the source of the next store."""
    scramble(buffer)
    seconds, _ = timed(action)
    ok = check(buffer, seed)
    fill(buffer, seed)
    return {"seconds": seconds, "ok": bool(ok)}


def serve(name: str, version: str, handlers: dict[str, Callable[[dict], dict]], notes: dict | None = None) -> None:
    """Answer commands from stdin until quit; the driver's handlers return the answer dicts.
    `notes` (what the driver found at its start) go into the hello line and the results."""
    out = sys.stdout
    hello = {"ready": True, "name": name, "version": version, **({"notes": notes} if notes else {})}
    print(json.dumps(hello), file=out, flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        if op == "quit":
            break
        handler = handlers.get(op)
        try:
            answer = {"unsupported": True} if handler is None else handler(command)
        except Exception as error:  # reported to the orchestrator, which decides
            traceback.print_exc(file=sys.stderr)
            answer = {"error": f"{type(error).__name__}: {error}"}
        print(json.dumps(answer), file=out, flush=True)


def raised_at(error: BaseException, package: str) -> dict[str, str]:
    """Where `error` was raised: the innermost frame inside `package` (a top-level package name,
    as a path under site-packages) and the innermost frame of all."""
    frames = traceback.extract_tb(error.__traceback__)
    marker = os.sep + package + os.sep

    def where(frame: traceback.FrameSummary) -> str:
        path = frame.filename
        cut = path.rfind("site-packages" + os.sep)
        return f"{path[cut + len('site-packages') + 1:] if cut >= 0 else path}:{frame.lineno}"

    inside = [frame for frame in frames if marker in frame.filename]
    return {"raised_at": where(inside[-1]) if inside else "?", "raised_in": where(frames[-1]) if frames else "?"}


def refuse(name: str, error: BaseException, package: str) -> None:
    """Tell the orchestrator this peer cannot run here: the exception, word for word, and where."""
    traceback.print_exception(error, file=sys.stderr)
    hello = {"ready": False, "name": name, "could_not_run": f"{type(error).__name__}: {error}",
             **raised_at(error, package)}
    print(json.dumps(hello), file=sys.stdout, flush=True)


def syncfs(directory: str) -> None:
    """Write back every dirty page of the file system holding `directory`."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.syncfs(fd) if hasattr(os, "syncfs") else os.sync()
    finally:
        os.close(fd)
