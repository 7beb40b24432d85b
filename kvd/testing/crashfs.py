"""An in-memory file system that forgets what was not synced, for crash tests.

It models what a real file system guarantees after power loss, and no more:

  * file contents survive up to the last fsync of that file; of the bytes
    appended after it, any prefix may survive (a torn write);
  * a name survives only if the directory was fsynced after it was created
    or renamed (otherwise the old name binding, if any, comes back);
  * `crash_after` makes the N-th operation raise `Crash` before it happens,
    so a test can stop the code at every step of a protocol.

It implements kvd.tiers.disk.fs.FileSystem.
"""

from __future__ import annotations

import copy
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path


class Crash(Exception):
    """The simulated machine lost power here."""


@dataclass
class _Inode:
    data: bytearray = field(default_factory=bytearray)
    durable: bytes = b""


class CrashFs:
    def __init__(self, seed: int = 0) -> None:
        self._random = random.Random(seed)
        self._inode_ids = itertools.count(1)
        self._inodes: dict[int, _Inode] = {}
        self._names: dict[Path, int] = {}  # what a reader sees now
        self._durable_names: dict[Path, int] = {}  # what survives a crash
        self.operations = 0
        self.crash_at: int | None = None

    # -- crash control ----------------------------------------------------

    def crash_after(self, operations: int | None) -> None:
        """Raise Crash when the operation numbered `operations` (from now) starts."""
        self.crash_at = None if operations is None else self.operations + operations

    def _step(self) -> None:
        if self.crash_at is not None and self.operations >= self.crash_at:
            self.crash_at = None
            raise Crash(f"crash before operation {self.operations}")
        self.operations += 1

    def crash(self, torn: bool = True) -> None:
        """Lose power: keep what was durable, plus a random prefix of unsynced appends."""
        survivors: dict[int, _Inode] = {}
        for inode_id in set(self._durable_names.values()):
            inode = self._inodes[inode_id]
            kept = inode.durable
            pending = bytes(inode.data)
            if torn and pending.startswith(kept) and len(pending) > len(kept):
                kept = pending[: self._random.randint(len(kept), len(pending))]
            survivors[inode_id] = _Inode(bytearray(kept), kept)
        self._inodes = survivors
        self._names = dict(self._durable_names)
        self.crash_at = None

    def survivor(self, torn: bool = True) -> CrashFs:
        """What a power loss now would leave, as a file system of its own (this one goes on)."""
        twin = copy.deepcopy(self)
        twin.crash(torn)
        return twin

    # -- FileSystem ---------------------------------------------------------

    def _inode(self, path: Path) -> _Inode | None:
        inode_id = self._names.get(Path(path))
        return None if inode_id is None else self._inodes[inode_id]

    def read(self, path: Path) -> bytes | None:
        self._step()
        inode = self._inode(path)
        return None if inode is None else bytes(inode.data)

    def write_new(self, path: Path, data: bytes) -> None:
        self._step()
        inode_id = next(self._inode_ids)
        self._inodes[inode_id] = _Inode(bytearray(data), b"")
        self._names[Path(path)] = inode_id

    def append(self, path: Path, data: bytes) -> None:
        self._step()
        inode = self._inode(path)
        if inode is None:
            raise FileNotFoundError(path)
        inode.data += data

    def truncate(self, path: Path, size: int) -> None:
        self._step()
        inode = self._inode(path)
        if inode is None:
            raise FileNotFoundError(path)
        del inode.data[size:]

    def fsync(self, path: Path) -> None:
        self._step()
        inode = self._inode(path)
        if inode is None:
            raise FileNotFoundError(path)
        inode.durable = bytes(inode.data)

    def fsync_directory(self, path: Path) -> None:
        self._step()
        directory = Path(path)
        for name in [name for name in self._durable_names if name.parent == directory]:
            if name not in self._names:
                del self._durable_names[name]
        for name, inode_id in self._names.items():
            if name.parent == directory:
                self._durable_names[name] = inode_id

    def rename(self, source: Path, target: Path) -> None:
        self._step()
        inode_id = self._names.pop(Path(source), None)
        if inode_id is None:
            raise FileNotFoundError(source)
        self._names[Path(target)] = inode_id

    def remove(self, path: Path) -> None:
        self._step()
        self._names.pop(Path(path), None)

    def list(self, directory: Path) -> list[str]:
        self._step()
        return sorted(name.name for name in self._names if name.parent == Path(directory))
