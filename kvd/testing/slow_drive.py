"""A drive slowed down for one process: a loop device holding an ext4 file system mounted where the
daemon keeps its disk tier, and a cgroup v1 blkio group that throttles that device's reads (and,
if asked, writes) for the processes admitted to it. For tests and benchmarks of what a slow or
shared drive does to hits (issue 38); needs root, losetup, mkfs.ext4 and cgroup v1's blkio.

    with slowed_drive(tmp_path / "nvme0", size_bytes=1 << 30) as drive:
        daemon = start_daemon(..., disk directories = [drive.directory])   # nvme0/disk
        drive.admit(daemon.pid)
        drive.throttle(read_bps=16 << 20)         # 16 MiB/s from now on
        drive.throttle(read_bps=0)                # unthrottled

The loop device does direct I/O on its backing file, so the daemon's O_DIRECT reads reach the
device and are throttled there. Everything is undone on exit: the processes leave the group, the
group, the mount, the loop device and its backing file are removed.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BLKIO = Path("/sys/fs/cgroup/blkio")


@dataclass
class SlowDrive:
    directory: Path  # an empty directory on the drive (its mount point holds ext4's lost+found)
    device: str  # /dev/loopN
    numbers: str  # "major:minor"
    group: Path

    def admit(self, pid: int) -> None:
        """The process (every thread of it, its I/O workers included) is throttled from now on."""
        (self.group / "cgroup.procs").write_text(str(pid))

    def throttle(self, read_bps: int = 0, write_bps: int = 0) -> None:
        """Bytes per second the admitted processes may read from (write to) the drive; 0: no limit."""
        (self.group / "blkio.throttle.read_bps_device").write_text(f"{self.numbers} {read_bps}")
        (self.group / "blkio.throttle.write_bps_device").write_text(f"{self.numbers} {write_bps}")

    def read_bytes(self) -> int:
        """Bytes the admitted processes have read from the drive (the group's throttle statistics)."""
        total = 0
        for line in (self.group / "blkio.throttle.io_service_bytes").read_text().splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0] == self.numbers and parts[1] == "Read":
                total += int(parts[2])
        return total


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout.strip()


@contextlib.contextmanager
def slowed_drive(directory: Path, size_bytes: int = 1 << 30) -> Iterator[SlowDrive]:
    if not BLKIO.is_dir():
        raise RuntimeError(f"no cgroup v1 blkio hierarchy at {BLKIO}: a slowed drive needs one")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    image = directory.parent / f".{directory.name}.img"
    with contextlib.ExitStack() as undo:
        image.touch()
        undo.callback(image.unlink, missing_ok=True)
        os.truncate(image, size_bytes)
        device = _run("losetup", "--find", "--show", "--direct-io=on", str(image))
        undo.callback(_run, "losetup", "--detach", device)
        _run("mkfs.ext4", "-q", "-F", device)
        _run("mount", device, str(directory))
        undo.callback(_unmount, directory)
        (directory / "disk").mkdir()
        numbers = Path(f"/sys/block/{Path(device).name}/dev").read_text().strip()
        group = BLKIO / f"kvd-slow-{os.getpid()}-{Path(device).name}"
        group.mkdir()
        undo.callback(_remove_group, group)
        yield SlowDrive(directory / "disk", device, numbers, group)


def _unmount(directory: Path, attempts: int = 40) -> None:
    """Unmount, waiting while a process that had files there still exits (a daemon stopped
    mid-read on a throttled drive); detached lazily after about 20 s rather than left mounted."""
    for _ in range(attempts):
        if subprocess.run(["umount", str(directory)], capture_output=True, check=False).returncode == 0:
            return
        time.sleep(0.5)
    _run("umount", "--lazy", str(directory))


def _remove_group(group: Path) -> None:
    """Its processes go back to the root group first: a group with members cannot be removed."""
    for name in ("blkio.throttle.read_bps_device", "blkio.throttle.write_bps_device"):  # I/O in flight ends
        with contextlib.suppress(OSError):
            limits = (group / name).read_text().split()
            for numbers in limits[::2]:
                (group / name).write_text(f"{numbers} 0")
    for pid in (group / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError, OSError):
            (BLKIO / "cgroup.procs").write_text(pid)
    group.rmdir()
