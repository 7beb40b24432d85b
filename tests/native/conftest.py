"""Fixtures for the native I/O engine tests: O_DIRECT files and engines.

The io_uring engine is required here: on a machine where it cannot work
(a container whose seccomp profile blocks io_uring), set
KVD_IO_ALLOW_FALLBACK=1 to skip its tests explicitly instead of failing.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvd.io import open_engine, uring_unavailable_reason
from kvd.io.engine import EngineBase

ENGINE_KINDS = ("uring", "fallback")


def allow_fallback() -> bool:
    return os.environ.get("KVD_IO_ALLOW_FALLBACK", "") not in ("", "0")


def require_uring() -> None:
    reason = uring_unavailable_reason()
    if reason is not None:
        if allow_fallback():
            pytest.skip(f"io_uring unavailable and KVD_IO_ALLOW_FALLBACK is set: {reason}")
        pytest.fail(f"io_uring engine unavailable: {reason} (set KVD_IO_ALLOW_FALLBACK=1 to skip)")


class FileSet:
    """Files opened O_RDWR | O_DIRECT, with known initial contents."""

    def __init__(self, directory: Path, initial: list[bytes]) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.paths = [directory / f"file{index}.bin" for index in range(len(initial))]
        self.fds: list[int] = []
        for path, content in zip(self.paths, initial, strict=True):
            path.write_bytes(content)  # buffered: sizes need not be aligned
            self.fds.append(os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC))

    def contents(self) -> list[bytes]:
        # Buffered reads see O_DIRECT writes: the kernel invalidates the cache.
        return [path.read_bytes() for path in self.paths]

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []


@pytest.fixture
def make_files(tmp_path: Path) -> Iterator:
    made: list[FileSet] = []

    def build(name: str, initial: list[bytes]) -> FileSet:
        files = FileSet(tmp_path / name, initial)
        made.append(files)
        return files

    yield build
    for files in made:
        files.close()


@pytest.fixture
def make_engine() -> Iterator:
    """Open engines; each is closed at teardown. "uring" requires io_uring (see module doc)."""
    made: list[EngineBase] = []

    def build(kind: str, queue_depth: int = 8, **kwargs) -> EngineBase:
        if kind == "uring":
            require_uring()
        engine = open_engine(kind, queue_depth, **kwargs)
        made.append(engine)
        return engine

    yield build
    for engine in made:
        engine.close()
