"""Power loss for a whole disk tier: records on CrashFs, segment data on real files.

CrashFs (kvd.testing.crashfs) forgets manifest and registry bytes that
were not fsynced. `UnsyncedData` does the same for segment data, which
goes through the I/O engine to real files with O_DIRECT: it wraps the
tier's engine and keeps, per segment file, the bytes each write replaced
since that file's last successful fdatasync. `PowerLoss.capture` then
takes what the drives would hold if power went now, without disturbing
the running tier: the surviving metadata (a CrashFs of its own) and every
segment file's contents with each unsynced write either kept or undone, as
a drive's cache may or may not have flushed it. `restore` puts that on the
drives once the tier is closed, for a new tier to open.

Call `capture` on the tier's I/O thread, between jobs, so that no write is
half submitted.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvd.io.engine import Op
from kvd.testing.crashfs import CrashFs


class UnsyncedData:
    """An I/O engine that remembers what each segment file's unsynced writes replaced."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self._fds: list[int] = []
        self._readers: dict[int, int] = {}  # file index -> a buffered descriptor of the same file
        self.pending: dict[int, list[tuple[int, bytes]]] = {}  # file index -> (offset, bytes before)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def register_files(self, fds: Sequence[int]) -> None:
        self._inner.register_files(fds)
        self._fds = [int(fd) for fd in fds]

    def _reader(self, index: int) -> int:
        if index not in self._readers:
            self._readers[index] = os.open(f"/proc/self/fd/{self._fds[index]}", os.O_RDONLY | os.O_CLOEXEC)
        return self._readers[index]

    def submit(self, op: Op, file_index: Any, offset: Any, length: Any, address: Any, **kwargs: Any) -> int:
        if op == Op.WRITE:
            files, offsets, lengths = np.broadcast_arrays(file_index, offset, length)
            for index, start, size in zip(files.tolist(), offsets.tolist(), lengths.tolist()):
                before = os.pread(self._reader(index), size, start)
                self.pending.setdefault(index, []).append((start, before.ljust(size, b"\0")))
        return self._inner.submit(op, file_index, offset, length, address, **kwargs)

    def fsync(self, file_index: int, *, datasync: bool = True) -> None:
        self._inner.fsync(file_index, datasync=datasync)
        self.pending.pop(file_index, None)

    def path_of(self, index: int) -> Path:
        return Path(os.readlink(f"/proc/self/fd/{self._fds[index]}"))

    def close(self) -> None:
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()
        self._inner.close()


@dataclass
class PowerLoss:
    """What the drives hold after a power loss at the moment of `capture`."""

    fs: CrashFs
    segments: dict[Path, bytes]

    @classmethod
    def capture(cls, fs: CrashFs, data: UnsyncedData, rng: random.Random) -> PowerLoss:
        segments: dict[Path, bytearray] = {}
        for index in range(len(data._fds)):
            path = data.path_of(index)
            if path.name.startswith("seg-"):
                segments[path] = bytearray(path.read_bytes())
        for index, writes in data.pending.items():
            image = segments[data.path_of(index)]
            for start, before in reversed(writes):  # newest first: the oldest undone write wins
                if rng.random() < 0.5:
                    image[start:start + len(before)] = before
        return cls(fs.survivor(), {path: bytes(image) for path, image in segments.items()})

    def restore(self) -> None:
        for path, image in self.segments.items():
            with open(path, "r+b") as file:
                file.write(image)
                file.truncate(len(image))
                os.fsync(file.fileno())
