"""The file operations the manifest needs, behind a seam: crash tests run the same code on a
file system that forgets unsynced writes (kvd.testing.crashfs)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

class FileSystem(Protocol):
    """The file operations the manifest needs, and nothing more."""

    def read(self, path: Path) -> bytes | None: ...

    def write_new(self, path: Path, data: bytes) -> None:
        """Create (or replace) `path` with `data`, not yet synced."""
        ...

    def append(self, path: Path, data: bytes) -> None: ...

    def truncate(self, path: Path, size: int) -> None: ...

    def fsync(self, path: Path) -> None: ...

    def fsync_directory(self, path: Path) -> None: ...

    def rename(self, source: Path, target: Path) -> None: ...

    def remove(self, path: Path) -> None: ...

    def list(self, directory: Path) -> list[str]: ...


class OsFileSystem:
    """The real one."""

    def read(self, path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def write_new(self, path: Path, data: bytes) -> None:
        with open(path, "wb") as handle:
            handle.write(data)

    def append(self, path: Path, data: bytes) -> None:
        with open(path, "ab") as handle:
            handle.write(data)

    def truncate(self, path: Path, size: int) -> None:
        os.truncate(path, size)

    def fsync(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def fsync_directory(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def rename(self, source: Path, target: Path) -> None:
        os.rename(source, target)

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def list(self, directory: Path) -> list[str]:
        return sorted(entry.name for entry in directory.iterdir())
