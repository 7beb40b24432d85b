"""The host tier's bytes: one preallocated shared-memory arena.

    /dev/shm/kvd-<pid>-<instance>      mode 0600, created O_EXCL
    +----------+----------+-----+--------------+
    | slot 0   | slot 1   | ... | slot n-1     |   each slot_bytes long,
    +----------+----------+-----+--------------+   4 KiB aligned
      ^ a block occupies the first block_bytes of one slot, layer-major:
        [layer 0: K V][layer 1: K V]...

The daemon holds an exclusive flock on the segment for as long as it runs,
so a later daemon can tell a live arena from one left by a killed process
even when the pid in the name is reused (in a container kvd is always pid
1).

Which slot holds which block is decided by the engine (kvd.core.engine.
HostPool); this module only creates, maps, pre-faults and removes the
segment, and copies bytes for the inline (non-shared-memory) path.
Co-located clients map the same segment by name and read and write slots
themselves, so payload bytes never pass through the daemon.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvd.invariants import check

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "kvd-"
PAGE_BYTES = 4096
SLOT_ALIGN_BYTES = 4096


@dataclass(frozen=True, slots=True)
class ArenaLayout:
    slot_bytes: int
    slot_count: int

    @property
    def arena_bytes(self) -> int:
        return self.slot_bytes * self.slot_count

    @staticmethod
    def from_capacity(capacity_bytes: int, slot_bytes: int) -> ArenaLayout:
        check(slot_bytes > 0 and slot_bytes % SLOT_ALIGN_BYTES == 0, "slot_bytes must be a multiple of 4 KiB")
        slot_count = capacity_bytes // slot_bytes
        check(slot_count > 0, "capacity holds no slot")
        return ArenaLayout(slot_bytes, slot_count)


class HostArena:
    """Owner of the shared-memory segment; `close()` unmaps and unlinks it."""

    def __init__(self, layout: ArenaLayout, *, prefault: bool = True, huge_pages: bool = False) -> None:
        self.layout = layout
        self.instance_id = secrets.token_hex(8)
        self.shm_name = f"{SHM_PREFIX}{os.getpid()}-{self.instance_id}"
        self.path = SHM_DIR / self.shm_name
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            # Held until close() (or the process dies): "this arena is alive".
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.fchmod(fd, 0o600)  # whatever the umask said
            os.ftruncate(fd, layout.arena_bytes)
            self._mmap = mmap.mmap(fd, layout.arena_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            self.path.unlink(missing_ok=True)
            raise
        self._lock_fd = fd
        if huge_pages:
            self._advise_huge_pages()
        self.array = np.frombuffer(self._mmap, dtype=np.uint8)
        # Rows are slots: the inline path and tests copy with one numpy call.
        self.slots = self.array.reshape(layout.slot_count, layout.slot_bytes)
        if prefault:
            self.prefault()
        self._closed = False
        log.info(
            "host arena created",
            extra={"shm_name": self.shm_name, "arena_bytes": layout.arena_bytes, "slot_bytes": layout.slot_bytes},
        )

    def prefault(self) -> None:
        """Touch every page now, so the first Put does not pay page faults
        and a short /dev/shm fails at start-up instead of with SIGBUS later."""
        self.array[::PAGE_BYTES] = 0

    def _advise_huge_pages(self) -> None:
        advice = getattr(mmap, "MADV_HUGEPAGE", None)
        if advice is None:
            log.warning("huge pages requested but madvise(MADV_HUGEPAGE) is unavailable")
            return
        try:
            self._mmap.madvise(advice)
        except OSError as error:
            log.warning("huge pages requested but madvise failed: %s", error)

    def offset(self, slot: int) -> int:
        return slot * self.layout.slot_bytes

    def address(self, slot: int) -> int:
        """Virtual address of a slot in this process (for native I/O)."""
        check(0 <= slot < self.layout.slot_count, "slot out of range")
        return self.array.ctypes.data + slot * self.layout.slot_bytes

    def write(self, slot: int, payload: bytes | memoryview) -> None:
        check(len(payload) <= self.layout.slot_bytes, "payload larger than a slot")
        start = self.offset(slot)
        self._mmap[start : start + len(payload)] = payload

    def read(self, slot: int, length: int) -> bytes:
        check(length <= self.layout.slot_bytes, "read past a slot")
        start = self.offset(slot)
        return self._mmap[start : start + length]

    def close(self) -> None:
        """Idempotent: unlink the name, then drop the mapping."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self.path.unlink(missing_ok=True)
        os.close(self._lock_fd)  # releases the flock
        self.slots = self.array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            # A view still exports the buffer; the mapping goes with the process.
            log.warning("host arena still referenced at close; unmapping at exit")


def remove_stale_segments(directory: Path = SHM_DIR) -> list[str]:
    """Unlink arenas left by kvd processes that no longer run (kill -9, a crashed container).

    An arena is stale when nobody holds its flock and the pid in its name
    is gone or is this process's own (a container restarted as pid 1
    again). The pid rule keeps arenas of a live daemon from before the
    flock, which holds none.
    """
    removed = []
    uid = os.getuid()
    for path in directory.glob(f"{SHM_PREFIX}*-*"):
        pid_text = path.name[len(SHM_PREFIX) :].split("-", 1)[0]
        if not pid_text.isdigit():
            continue
        try:
            if path.stat().st_uid != uid or _locked(path):
                continue
            if int(pid_text) != os.getpid():
                os.kill(int(pid_text), 0)
                continue  # a live process that holds no lock: leave it be
        except ProcessLookupError:
            pass
        except (PermissionError, FileNotFoundError):
            continue
        path.unlink(missing_ok=True)
        removed.append(path.name)
    return removed


def _locked(path: Path) -> bool:
    """Whether a live daemon holds the arena's flock (FileNotFoundError if it is gone)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also drops the lock taken just now
    return False
