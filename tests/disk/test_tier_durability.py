"""DiskTier on real O_DIRECT files: what is synced when under each fsync
policy, data before the records that point at it, and compaction
(shared pieces: tests/disk/conftest.py)."""

from __future__ import annotations

from kvd.io import Op
from kvd.tiers.disk.fs import OsFileSystem
from kvd.tiers.disk.journal import FsyncPolicy
from kvd.tiers.disk.layout import locate
from kvd.tiers.disk.tier import DiskTier
from kvd.testing import disk_ops
from tests.disk.conftest import NAMESPACE, key, make_config, open_tier, read, records_by_slot, write


def _log_syncs(tier: DiskTier) -> list[str]:
    """Record, in order, each segment fdatasync ("data <file>") and manifest sync ("manifest <drive>")."""
    events: list[str] = []
    fdatasync = tier._state.fdatasync

    def logged_fdatasync(index: int) -> int:
        events.append(f"data {index}")
        return fdatasync(index)

    tier._state.fdatasync = logged_fdatasync
    for drive, manifest in enumerate(tier._state.manifests):
        def logged_sync(*, force: bool = False, sync=manifest.sync, drive=drive) -> None:
            if manifest.unsynced_bytes or force:
                events.append(f"manifest {drive}")
            sync(force=force)

        manifest.sync = logged_sync
    return events


def test_group_policy_flushes_the_data_at_the_group_commit_before_the_records(drives, arena):
    """Under group the data of a batch is not fdatasynced with the batch:
    the group commit flushes every segment file written since the last one,
    and only then the manifest that points into them."""
    config = make_config(drives, policy=FsyncPolicy.GROUP)
    tier, _ = open_tier(config)
    events = _log_syncs(tier)
    opened = tier.stats.fsyncs  # (opening syncs what it found)
    assert all(write(tier, arena, {0: 1, 1: 2, 2: 3}))
    assert events == [] and tier.stats.fsyncs == opened
    tier.sync()
    files = sorted({locate(config, slot).file_index for slot in (0, 1, 2)})
    data = [f"data {index}" for index in files]
    assert sorted(event for event in events if event.startswith("data")) == data
    for drive in (0, 1):
        drive_files = {f"data {locate(config, slot).file_index}" for slot in (0, 1, 2)
                       if locate(config, slot).drive == drive}
        assert all(events.index(f) < events.index(f"manifest {drive}") for f in drive_files)
    events.clear()
    tier.sync()
    assert events == []  # nothing written since: nothing to flush
    tier.close()


def test_none_policy_fdatasyncs_the_data_only_when_forced(drives, arena):
    """Under none nothing is synced by a write or a plain sync; a forced one (a
    client waiting for durability, a Delete) flushes the data, then the records."""
    config = make_config(drives, policy=FsyncPolicy.NONE)
    tier, _ = open_tier(config)
    events = _log_syncs(tier)
    opened = tier.stats.fsyncs
    assert all(write(tier, arena, {0: 1, 1: 2}))
    tier.sync()
    assert tier.stats.fsyncs == opened and events == []
    tier.sync(force=True)
    files = sorted({f"data {locate(config, slot).file_index}" for slot in (0, 1)})
    assert sorted(event for event in events if event.startswith("data")) == files
    for slot in (0, 1):
        place = locate(config, slot)
        assert events.index(f"data {place.file_index}") < events.index(f"manifest {place.drive}")
    tier.close()
    tier, recovery = open_tier(config)  # a process restart keeps what the kernel was handed
    assert sorted(r.location for r in recovery.blocks[NAMESPACE]) == [0, 1]
    tier.close()


def test_opening_syncs_what_a_killed_run_left_unsynced(drives, arena):
    """A run killed under none left its writes in the page cache only; the
    next open makes them durable before anything is served as durable."""
    config = make_config(drives, policy=FsyncPolicy.NONE)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {0: 1, 1: 2}))
    tier.close()
    synced: list[str] = []
    tier = DiskTier(config)
    fdatasync = tier._state.fdatasync
    tier._state.fdatasync = lambda index: synced.append(index) or fdatasync(index)
    tier.open()
    assert {locate(config, slot).file_index for slot in (0, 1)} <= set(synced)
    assert all(manifest.unsynced_bytes == 0 for manifest in tier._state.manifests)
    tier.close()


def test_compaction_keeps_exactly_the_live_blocks(drives, arena):
    config = make_config(drives)
    tier, _ = open_tier(config)
    for round_number in range(5):
        assert all(write(tier, arena, {slot: 10 * round_number + slot for slot in range(4)}))
        if round_number < 4:
            tier.remove_blocks(NAMESPACE, [(key(10 * round_number + slot), slot) for slot in range(4)])
    sizes = disk_ops.manifest_bytes(tier)
    assert tier.compact_if_needed(max(sizes) + 1) == 0
    assert tier.compact_if_needed(0) == 2
    assert all(after < before for after, before in zip(disk_ops.manifest_bytes(tier), sizes, strict=True))
    live = records_by_slot(tier)
    tier.close()
    tier, recovery = open_tier(config)
    assert {r.location: r for r in recovery.blocks[NAMESPACE]} == live
    assert read(tier, arena, list(range(4))).all()
    tier.close()


class Spy:
    """Records the order of engine and manifest operations of one write."""

    def __init__(self, events: list, engine) -> None:
        self._events = events
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def submit(self, op, *arrays):
        self._events.append(("submit", Op(op).name))
        return self._engine.submit(op, *arrays)

    def wait(self, batch):
        self._events.append(("wait", None))
        return self._engine.wait(batch)

    def fsync(self, index, datasync=True):
        self._events.append(("fdatasync", index))
        return self._engine.fsync(index, datasync=datasync)


class SpyFs(OsFileSystem):
    def __init__(self, events: list) -> None:
        self._events = events

    def append(self, path, data):
        self._events.append(("append", path.parent.name))
        super().append(path, data)

    def fsync(self, path):
        self._events.append(("fsync", path.parent.name))
        super().fsync(path)


def test_data_is_durable_before_the_record_that_points_to_it(drives, arena):
    from kvd.io import open_engine

    events: list = []
    config = make_config(drives)
    engine = open_engine("fallback")
    tier, _ = open_tier(config, engine=Spy(events, engine), fs=SpyFs(events))
    events.clear()
    assert all(write(tier, arena, {0: 1, 1: 2, 2: 3, 130: 4}))  # 130: drive 0, segment 1
    assert events == [
        ("submit", "WRITE"),
        ("wait", None),
        ("fdatasync", 0),  # drive 0 segment 0
        ("fdatasync", 1),  # drive 0 segment 1
        ("fdatasync", 2),  # drive 1 segment 0
        ("append", "nvme0"),
        ("fsync", "nvme0"),  # STRICT: synced before write_blocks returns
        ("append", "nvme1"),
        ("fsync", "nvme1"),
    ]
    tier.close()
    engine.close()


def test_a_compaction_syncs_the_data_of_its_records_before_it_publishes_them(drives, arena, monkeypatch):
    """Under GROUP a PUT's data waits for the timer's sync; a compaction's snapshot is durable at once,
    so the segments its records point at are synced before it is published, never after."""
    config = make_config(drives, policy=FsyncPolicy.GROUP)
    tier, _ = open_tier(config)
    assert all(write(tier, arena, {slot: 40 + slot for slot in range(4)}))
    events: list[str] = []
    fdatasync, compacts = tier._state.fdatasync, [manifest.compact for manifest in tier._state.manifests]
    monkeypatch.setattr(tier._state, "fdatasync", lambda index: events.append(f"data {index}") or fdatasync(index))
    for drive, manifest in enumerate(tier._state.manifests):
        monkeypatch.setattr(manifest, "compact", lambda drive=drive: events.append(f"publish {drive}")
                            or compacts[drive]())
    written = [sorted(pending) for pending in tier._state.unsynced_data]
    assert any(written), "GROUP left no data unsynced: nothing to check"
    assert tier.compact_if_needed(0) == len(drives)
    for drive, indexes in enumerate(written):
        published = events.index(f"publish {drive}")
        assert all(events.index(f"data {index}") < published for index in indexes), events
    assert not any(tier._state.unsynced_data)
    tier.close()
