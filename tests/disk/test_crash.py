"""Crash safety: an acknowledged block survives, and nothing comes back wrong.

Two kinds of crash:

* power loss, simulated: manifests and registries live on CrashFs, which
  forgets every byte not fsynced (and keeps a random prefix of the rest);
  segment data is on real files, made durable by fdatasync. A seeded run of
  writes, removes and compactions is cut at a chosen file operation.
* a real process killed with SIGKILL in the middle of a write loop, which
  reports each acknowledgement through a pipe first. That is what a user
  would trust; it cannot lose the page cache, the simulation can.

The property, both ways, under FsyncPolicy.STRICT: every block whose
write_blocks returned True (and whose removal was not started) is there
after the crash, and every block that is there reads back bit-exact.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvd.testing.crashfs import Crash, CrashFs
from kvd.tiers.disk.journal import FsyncPolicy
from tests.disk.conftest import (
    NAMESPACE,
    expected_bytes,
    host_bytes,
    key,
    make_config,
    open_tier,
    read,
    write,
)

REPO = Path(__file__).parents[2]


def seed_of(block_key: bytes) -> int:
    return int.from_bytes(block_key[:4], "little")


def check_recovered(tier, arena, recovery, acked: dict[int, int], maybe: set[int]) -> None:
    """acked: slot -> seed acknowledged; maybe: slots whose fate is open."""
    recovered = {record.location: seed_of(record.key) for record in recovery.blocks.get(NAMESPACE, [])}
    for slot, seed in acked.items():
        if slot not in maybe:
            assert recovered.get(slot) == seed, f"acknowledged block in slot {slot} lost"
    for slot in recovered:
        assert slot in acked or slot in maybe, f"slot {slot} came back but was never written or was removed"
    slots = sorted(recovered)
    for start in range(0, len(slots), 16):
        chunk = slots[start : start + 16]
        assert read(tier, arena, chunk).all()
        for i, slot in enumerate(chunk):
            assert host_bytes(arena, 32 + i) == expected_bytes(recovered[slot])
    tier.verify()


@pytest.mark.parametrize("seed", range(24))
def test_power_loss_at_any_step_keeps_every_acknowledged_block(drives, arena, seed):
    rng = random.Random(seed)
    config = make_config(drives, segments=1, policy=FsyncPolicy.STRICT)
    fs = CrashFs(seed)
    tier, _ = open_tier(config, fs=fs)
    acked: dict[int, int] = {}
    next_seed = 1000 * seed
    fs.crash_after(rng.randrange(5, 120))
    maybe: set[int] = set()
    try:
        for _ in range(200):
            action = rng.random()
            if action < 0.6:
                free = [slot for slot in range(24) if slot not in acked]
                batch = {slot: next_seed + i for i, slot in enumerate(rng.sample(free, min(len(free), 4)))}
                next_seed += 4
                maybe = set(batch)
                results = write(tier, arena, batch)
                assert all(results)
                acked.update(batch)
            elif action < 0.9 and acked:
                victims = rng.sample(sorted(acked), min(len(acked), 3))
                maybe = set(victims)
                assert all(tier.remove_blocks(NAMESPACE, [(key(acked[slot]), slot) for slot in victims]))
                for slot in victims:
                    del acked[slot]
            else:
                maybe = set()
                tier.compact_if_needed(0)
            maybe = set()
    except Crash:
        pass
    else:
        pytest.fail("the crash point was never reached")
    fs.crash()
    tier.close()  # only releases the engine and files: the "machine" is gone
    tier, recovery = open_tier(config, fs=fs)
    # A write cut short may have left its PUT; a removal cut short its REMOVE.
    check_recovered(tier, arena, recovery, acked | {slot: None for slot in maybe if slot not in acked}, maybe)
    tier.close()


CHILD = textwrap.dedent(
    """
    import random, sys
    sys.path.insert(0, {repo!r})
    from tests.disk.conftest import NAMESPACE, HostArena, ArenaLayout, SLOT_BYTES, key, make_config, open_tier, write
    from kvd.tiers.disk.journal import FsyncPolicy

    directories, first_seed = sys.argv[1:3], int(sys.argv[3])
    config = make_config(directories, segments=1, policy=FsyncPolicy.STRICT)
    tier, recovery = open_tier(config)
    live = {{record.location: int.from_bytes(record.key[:4], "little") for record in recovery.blocks.get(NAMESPACE, [])}}
    arena = HostArena(ArenaLayout(SLOT_BYTES, 8), prefault=False)
    rng = random.Random(first_seed)
    next_seed = first_seed
    out = sys.stdout
    out.write("ready\\n"); out.flush()
    while True:
        if len(live) > 40 or (live and rng.random() < 0.25):
            victims = rng.sample(sorted(live), min(len(live), 3))
            out.write("R " + " ".join(map(str, victims)) + "\\n"); out.flush()
            assert all(tier.remove_blocks(NAMESPACE, [(key(live[s]), s) for s in victims]))
            for slot in victims:
                del live[slot]
            out.write("r " + " ".join(map(str, victims)) + "\\n"); out.flush()
        else:
            free = [slot for slot in range(64) if slot not in live]
            batch = {{slot: next_seed + i for i, slot in enumerate(rng.sample(free, 4))}}
            next_seed += 4
            out.write("W " + " ".join(f"{{s}}:{{v}}" for s, v in batch.items()) + "\\n"); out.flush()
            assert all(write(tier, arena, batch))
            live.update(batch)
            out.write("w " + " ".join(f"{{s}}:{{v}}" for s, v in batch.items()) + "\\n"); out.flush()
    """
)


def test_sigkill_mid_write_loop_keeps_every_acknowledged_block(drives, arena, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(repo=str(REPO)))
    config = make_config(drives, segments=1, policy=FsyncPolicy.STRICT)
    rng = random.Random(5)
    acked: dict[int, int] = {}
    for round_number in range(3):
        child_errors = tmp_path / f"child-{round_number}.stderr"
        with open(child_errors, "wb") as errors:
            child = subprocess.Popen(
                [sys.executable, str(script), *map(str, drives), str(100000 * (round_number + 1))],
                stdout=subprocess.PIPE, stderr=errors, text=True, cwd=REPO,
            )

        def next_line() -> str:
            line = child.stdout.readline()
            # An empty line means the writer died: say why, not just "unpack".
            assert line, f"writer exited early ({child.poll()}):\n{child_errors.read_text()[-3000:]}"
            return line

        maybe: set[int] = set()

        def follow(line: str) -> None:
            nonlocal maybe
            kind, *fields = line.split()
            if kind in ("W", "R"):
                maybe = {int(field.split(":")[0]) for field in fields}
            elif kind == "w":
                acked.update({int(s): int(v) for s, v in (field.split(":") for field in fields)})
                maybe = set()
            elif kind == "r":
                for field in fields:
                    del acked[int(field)]
                maybe = set()

        try:
            assert next_line() == "ready\n"
            # Kill after a random number of acknowledgements, mid-operation.
            for _ in range(rng.randrange(20, 80)):
                follow(next_line())
            os.kill(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
            # The writer ran ahead of this reader: whatever it reported
            # before it died happened, so account for it too.
            for line in child.stdout:
                if line.endswith("\n"):
                    follow(line)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
            child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        tier, recovery = open_tier(config)
        expected = dict(acked) | {slot: None for slot in maybe if slot not in acked}
        check_recovered(tier, arena, recovery, expected, maybe)
        # The next round starts from what is really on disk.
        acked = {r.location: seed_of(r.key) for r in recovery.blocks.get(NAMESPACE, [])}
        tier.close()
