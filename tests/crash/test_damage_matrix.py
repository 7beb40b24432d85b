"""The damage and restart matrix (issue 10): every kind of metadata and
segment damage, on one drive of two, after deletes, durable retries and
restarts in two orders, through real daemons, `kvd fsck` and `kvd fsck
--repair`.

Each scenario:

1. history: chains stored durably, one chain deleted, one Put first
   without durability and then retried with it; the daemon stopped by
   SIGKILL ("kill"), or killed after the Puts and restarted for the delete
   and the retry, then stopped by SIGTERM ("restart-term");
2. the drive each block sits on is read off the manifests (read-only);
3. one damage (kvd.testing.damage) on one drive;
4. `kvd fsck` (read-only): exit 1 exactly when the damage lost something,
   naming the damaged file;
5. a daemon starts (never a traceback, never exit 1) and serves: no wrong
   byte, the deleted chain never, every chain whose blocks all sit on the
   other drive whole, the damaged drive quarantined exactly when its
   metadata cannot be read; a new durable Put works;
6. SIGKILL, `kvd fsck --repair`, `kvd fsck` exits 0, and a last daemon
   serves everything the previous one did, the deleted chain still never,
   every drive in service.

`make test` runs one scenario per damage (drive and history alternate);
`make damage-long` (KVD_DAMAGE_MATRIX=all) runs every damage on both drives
after both histories.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kvd import cli
from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec
from kvd.testing.damage import DAMAGES, Expect
from kvd.testing.daemon import DaemonProcess, log_problems, run_daemon, start_daemon
from kvd.testing.put_stream import blocks_for
from kvd.tiers.disk.fsck import config_from_directories
from kvd.tiers.disk.tier import DiskTier

SPEC = NamespaceSpec(model_id="damage-model", num_layers=2, num_kv_heads=1, head_dim=32, block_tokens=16,
                     kv_dtype=DType.FLOAT32)
OTHER_SPEC = NamespaceSpec(model_id="damage-model-2", num_layers=2, num_kv_heads=1, head_dim=32, block_tokens=16,
                           kv_dtype=DType.FLOAT32)
SLOT_BYTES = 8 << 10
CHAIN_LENGTHS = (1, 1, 2, 3, 1, 2, 3, 1, 1, 2)
DELETED, RETRIED = 3, 10  # chain indices: one deleted, one Put twice (the second time durably)
HISTORIES = ("kill", "restart-term")
# Damages whose loss the daemon can count at start (a zeroed manifest, say,
# leaves nothing that tells how many blocks it held; a flipped segment byte
# is found when the block is read, not at start).
COUNTED_LOSSES = {
    "current_garbage", "current_empty", "current_deleted", "current_names_a_missing_manifest",
    "identity_deleted", "identity_garbage", "identity_field_edited", "segment_deleted", "segment_truncated",
    "manifest_byte_flipped_in_the_middle", "manifest_garbage_inserted",
}


def config(tmp_path: Path) -> dict:
    return {
        "host": {"capacity_bytes": 64 * SLOT_BYTES, "slot_bytes": SLOT_BYTES},
        "disk": {"directories": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")], "capacity_bytes": 2 << 20,
                 "slot_bytes": SLOT_BYTES, "segment_bytes": 1 << 20, "fsync": "strict", "write_mode": "back"},
    }


def scenarios() -> list[tuple[str, int, str]]:
    if os.environ.get("KVD_DAMAGE_MATRIX") == "all":
        return list(itertools.product(DAMAGES, (0, 1), HISTORIES))
    return [(name, index % 2, HISTORIES[(index // 2) % 2]) for index, name in enumerate(DAMAGES)]


@dataclass
class Store:
    """What the clients were told, and where the blocks went."""

    chains: list[list[bytes]] = field(default_factory=list)  # every chain, the deleted one too
    drive_of: dict[bytes, int] = field(default_factory=dict)  # key -> drive, read off the manifests
    extra: list[list[bytes]] = field(default_factory=list)  # chains Put durably after the damage

    def live(self) -> list[list[bytes]]:
        return [chain for index, chain in enumerate(self.chains) if index != DELETED] + self.extra

    def on(self, drive: int) -> list[list[bytes]]:
        """Live chains whose every block sits on `drive`."""
        return [chain for chain in self.live() if all(self.drive_of.get(key) == drive for key in chain)]


def chain_keys(namespace, index: int, length: int) -> list[bytes]:
    return namespace.keys(np.arange(length * 16) + index * 1000)


def run_history(directory: Path, settings: dict, history: str) -> Store:
    store = Store()
    daemon = start_daemon(directory, config=settings)
    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        store.chains = [chain_keys(namespace, index, length) for index, length in enumerate(CHAIN_LENGTHS)]
        for chain in store.chains:
            assert client.put(namespace, chain, blocks_for(chain, SPEC), durable=True) == len(chain)
        retried = chain_keys(namespace, RETRIED, 3)
        store.chains.append(retried)
        assert client.put(namespace, retried, blocks_for(retried, SPEC)) == 3  # host memory only
    if history == "restart-term":
        assert daemon.stop(signal.SIGKILL) == -signal.SIGKILL
        daemon = start_daemon(directory, config=settings)
    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        deleted = store.chains[DELETED]
        assert client.delete(namespace, deleted[:1]) == (len(deleted), 0)
        if history == "kill" or client.lookup(namespace, retried).matched == 3:
            client.put(namespace, retried, blocks_for(retried, SPEC), durable=True)  # the retry
        else:  # the restart lost the blocks that were only in host memory: Put anew
            assert client.put(namespace, retried, blocks_for(retried, SPEC), durable=True) == 3
    assert daemon.stop(signal.SIGKILL if history == "kill" else signal.SIGTERM) in (0, -signal.SIGKILL)
    store.drive_of = drives_of_blocks(settings)
    assert set(store.drive_of) == {key for chain in store.live() for key in chain}
    return store


def drives_of_blocks(settings: dict) -> dict[bytes, int]:
    disk = config_from_directories([Path(directory) for directory in settings["disk"]["directories"]])
    with DiskTier(disk, read_only=True) as tier:
        tier.open()
        return {record.key: record.location % disk.drive_count for record in tier.live_records()}


def kvd(*arguments: str) -> tuple[int, str]:
    """`kvd ARGUMENTS...` in this process (the CLI's own entry point): exit code and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main(list(arguments))
    return code, out.getvalue()


def check_served(daemon: DaemonProcess, store: Store, whole: list[list[bytes]]) -> dict[bytes, int]:
    """Every chain: a bit-exact prefix or nothing; the deleted one nothing; `whole` whole.
    Returns the blocks served per chain's first key."""
    served = {}
    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        for index, chain in enumerate(store.chains + store.extra):
            got = client.get_numpy(namespace, chain)
            expected = blocks_for(chain, SPEC)[: got.shape[0]]
            assert got.tobytes() == expected.tobytes(), f"wrong bytes served for chain {index}"
            served[chain[0]] = got.shape[0]
        deleted = store.chains[DELETED]
        assert served[deleted[0]] == 0 and client.lookup(namespace, deleted).matched == 0, "a deleted chain came back"
        for chain in whole:
            assert served[chain[0]] == len(chain), "a chain on the sound drive is not served whole"
    return served


def drive_states(daemon: DaemonProcess) -> dict[int, str]:
    samples = daemon.metric_samples("kvd_disk_drive_state")
    states = {}
    for line, value in samples.items():
        if value == 1:
            labels = dict(part.split("=") for part in line[line.index("{") + 1:-1].split(","))
            states[int(labels["drive"].strip('"'))] = labels["state"].strip('"')
    return states


@pytest.mark.parametrize(("damage", "drive", "history"), scenarios(), ids=lambda value: str(value))
def test_damage_on_one_drive(tmp_path, damage, drive, history):
    settings = config(tmp_path)
    directory = tmp_path / "daemon"
    drives = [Path(path) for path in settings["disk"]["directories"]]
    store = run_history(directory, settings, history)
    other = 1 - drive
    damage_drive, expect = DAMAGES[damage]
    damage_drive(drives[drive])

    # fsck, read-only: exit 1 exactly when the damage lost something; changes nothing.
    before = {path: path.read_bytes() for path in drives[drive].iterdir() if not path.name.startswith("seg-")}
    code, report = kvd("fsck", *map(str, drives))
    assert code == (0 if expect == Expect.NONE else 1), report
    assert {path: path.read_bytes() for path in drives[drive].iterdir() if not path.name.startswith("seg-")} == before
    if expect == Expect.QUARANTINE:
        assert f"quarantined: drive {drive}: " in report, report

    # A daemon starts on the damaged set and serves what it can, never a wrong byte.
    with run_daemon(directory, config=settings, check_clean_exit=False) as daemon:
        whole = store.on(other) if expect != Expect.NONE else store.live()
        served = check_served(daemon, store, whole)
        states = drive_states(daemon)
        assert states[other] == "ok"
        assert states[drive] == ("quarantined" if expect == Expect.QUARANTINE else "ok")
        lost = daemon.metric("kvd_disk_recovery_lost_blocks")
        if expect == Expect.NONE:
            assert lost == 0
        elif damage in COUNTED_LOSSES:
            assert lost > 0, "the loss went uncounted"
        if damage.startswith("manifest_") and expect == Expect.SERVE:
            lost = [chain for chain in store.live() if served[chain[0]] < len(chain)]
            assert len(lost) <= 1, f"one damaged record cost {len(lost)} chains"
        with Client(daemon.unix_target) as client:
            namespace = client.register_namespace(SPEC)
            fresh = chain_keys(namespace, 50, 2)
            assert client.put(namespace, fresh, blocks_for(fresh, SPEC), durable=True) == 2
            store.extra.append(fresh)
            served[fresh[0]] = len(fresh)
            # A namespace new to the drives, registered with one of them out of service.
            other_model = client.register_namespace(OTHER_SPEC)
            other_keys = other_model.keys(np.arange(2 * 16))
            assert client.put(other_model, other_keys, blocks_for(other_keys, OTHER_SPEC), durable=True) == 2
        problems = [line for line in log_problems(daemon.log()) if "quarantined" not in line]
        assert "Traceback" not in daemon.log() and problems == [], problems[:3]
        daemon.stop(signal.SIGKILL)

    # Repaired, the set is clean, and a last daemon serves all of that again.
    code, report = kvd("fsck", "--repair", *map(str, drives))
    assert code in (0, 1), report
    code, report = kvd("fsck", *map(str, drives))
    assert code == 0, report
    with run_daemon(directory, config=settings) as daemon:
        whole = [chain for chain in store.live() if served.get(chain[0]) == len(chain)]
        check_served(daemon, store, whole)
        assert set(drive_states(daemon).values()) == {"ok"}
        assert log_problems(daemon.log()) == []
