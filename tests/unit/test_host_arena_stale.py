"""Which shared-memory arenas a starting daemon removes as stale."""

from __future__ import annotations

import os
import subprocess
import sys

from kvd.tiers.host import SHM_DIR, SHM_PREFIX, ArenaLayout, HostArena, remove_stale_segments


def make_segment(name: str) -> os.PathLike:
    path = SHM_DIR / name
    path.write_bytes(b"\0" * 4096)
    return path


def test_an_arena_with_our_own_pid_but_no_lock_is_stale_and_a_locked_one_is_not():
    """In a container every kvd is pid 1: the name's pid cannot tell a dead
    predecessor's arena from a live one; the flock can."""
    live = HostArena(ArenaLayout(4096, 2), prefault=False)
    left_behind = make_segment(f"{SHM_PREFIX}{os.getpid()}-deadbeefdeadbeef")
    try:
        removed = remove_stale_segments()
        assert left_behind.name in removed and not left_behind.exists()
        assert live.path.exists() and live.shm_name not in removed
    finally:
        left_behind.unlink(missing_ok=True)
        live.close()
    assert not live.path.exists()


def test_an_unlocked_arena_of_another_live_process_is_kept_and_of_a_dead_one_removed():
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
    alive = make_segment(f"{SHM_PREFIX}{sleeper.pid}-0000000000000001")
    dead = make_segment(f"{SHM_PREFIX}{int(finished.stdout)}-0000000000000002")
    try:
        removed = remove_stale_segments()
        assert dead.name in removed and not dead.exists()
        assert alive.exists()  # an older daemon that holds no lock, still running
    finally:
        sleeper.kill()
        sleeper.wait()
        alive.unlink(missing_ok=True)
        dead.unlink(missing_ok=True)
