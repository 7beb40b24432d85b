"""The disk tier's manifest: framing, replay, compaction, and crashes."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

from kvd.testing.crashfs import Crash, CrashFs
from kvd.tiers.disk.journal import (
    CURRENT,
    FRAME_HEADER,
    ROOT_PARENT,
    FsyncPolicy,
    Manifest,
    PutRecord,
    RecordType,
    RemoveRecord,
    decode_frames,
    encode_frame,
)

DIRECTORY = Path("/drive0")
NAMESPACE = bytes(range(32))


def key(number: int) -> bytes:
    return number.to_bytes(32, "little")


def put(manifest: Manifest, number: int, layers: int = 3) -> PutRecord:
    return PutRecord(
        manifest.sequence(), NAMESPACE, key(number), ROOT_PARENT if number == 0 else key(number - 1),
        location=number * 7, layer_checksums=struct.pack(f"<{layers}I", *range(number, number + layers)),
    )


def remove(manifest: Manifest, number: int) -> RemoveRecord:
    return RemoveRecord(manifest.sequence(), NAMESPACE, key(number))


# ----------------------------------------------------------------------
# Framing


def test_frames_round_trip_and_records_decode():
    record = PutRecord(5, NAMESPACE, key(1), key(0), location=(1 << 56) | (2 << 32) | 3, layer_checksums=struct.pack("<3I", 1, 2, 2**32 - 1))
    removal = RemoveRecord(6, NAMESPACE, key(1))
    data = record.encode() + removal.encode() + encode_frame(RecordType.SNAPSHOT_BEGIN, b"\0" * 8)
    frames, valid = decode_frames(data)
    assert valid == len(data)
    assert [kind for kind, _ in frames] == [RecordType.PUT, RecordType.REMOVE, RecordType.SNAPSHOT_BEGIN]
    assert PutRecord.decode(frames[0][1]) == record
    assert RemoveRecord.decode(frames[1][1]) == removal


def test_every_truncation_and_bit_flip_yields_a_prefix_of_the_records():
    """A damaged log never yields a record that was not written, in order."""
    records = [PutRecord(n, NAMESPACE, key(n), key(n - 1), n, struct.pack("<I", n) * (n % 4)) for n in range(1, 9)]
    encoded = [record.encode() for record in records]
    data = b"".join(encoded)
    boundaries = [0]
    for frame in encoded:
        boundaries.append(boundaries[-1] + len(frame))
    for cut in range(len(data) + 1):
        frames, valid = decode_frames(data[:cut])
        assert valid == max(b for b in boundaries if b <= cut)
        assert [PutRecord.decode(payload) for _, payload in frames] == records[: len(frames)]
    rng = random.Random(7)
    for _ in range(400):
        damaged = bytearray(data)
        position = rng.randrange(len(data))
        damaged[position] ^= 1 << rng.randrange(8)
        frames, valid = decode_frames(bytes(damaged))
        decoded = [PutRecord.decode(payload) for _, payload in frames]
        # Everything before the damaged frame survives; nothing after it does.
        damaged_frame = max(index for index, b in enumerate(boundaries[:-1]) if b <= position)
        assert decoded == records[:damaged_frame]
        assert valid == boundaries[damaged_frame]


def test_oversized_or_unknown_frames_end_the_log():
    good = encode_frame(RecordType.REMOVE, RemoveRecord(1, NAMESPACE, key(1)).encode()[FRAME_HEADER.size:])
    bad_type = FRAME_HEADER.pack(0, 0, 99)
    huge = FRAME_HEADER.pack(1 << 30, 0, RecordType.PUT)
    for tail in (bad_type, huge):
        frames, valid = decode_frames(good + tail + good)
        assert len(frames) == 1 and valid == len(good)


# ----------------------------------------------------------------------
# Manifest on the real file system


def test_manifest_replays_edits_after_reopen(tmp_path):
    manifest = Manifest(tmp_path)
    report = manifest.open()
    assert report.records == 0 and (tmp_path / CURRENT).read_text() == "MANIFEST-000001\n"
    manifest.append([put(manifest, n) for n in range(5)])
    manifest.append([remove(manifest, 3)])
    reopened = Manifest(tmp_path)
    report = reopened.open()
    assert report.records == 2 + 6  # snapshot begin/end, five puts, one remove
    assert sorted(record.key for record in reopened.records()) == [key(0), key(1), key(2), key(4)]
    assert reopened.live == manifest.live
    assert reopened.next_sequence == manifest.next_sequence


def test_torn_tail_is_truncated_and_counted(tmp_path):
    manifest = Manifest(tmp_path)
    manifest.open()
    manifest.append([put(manifest, 0), put(manifest, 1)])
    size = manifest.path.stat().st_size
    with open(manifest.path, "ab") as handle:
        handle.write(put(manifest, 2).encode()[:-3])  # a write cut short
    reopened = Manifest(tmp_path)
    report = reopened.open()
    assert report.truncated_bytes > 0
    assert reopened.path.stat().st_size == size
    assert sorted(reopened.live) == [(NAMESPACE, key(0)), (NAMESPACE, key(1))]
    # New appends follow the valid frames.
    reopened.append([put(reopened, 5)])
    again = Manifest(tmp_path)
    assert again.open().truncated_bytes == 0 and (NAMESPACE, key(5)) in again.live


def test_compaction_switches_current_and_drops_the_old_manifest(tmp_path):
    manifest = Manifest(tmp_path)
    manifest.open()
    manifest.append([put(manifest, n) for n in range(10)])
    manifest.append([remove(manifest, n) for n in range(0, 10, 2)])
    before = manifest.path.stat().st_size
    manifest.compact()
    assert (tmp_path / CURRENT).read_text() == "MANIFEST-000002\n"
    assert not (tmp_path / "MANIFEST-000001").exists()
    assert manifest.path.stat().st_size < before
    reopened = Manifest(tmp_path)
    reopened.open()
    assert reopened.live == manifest.live and len(reopened.live) == 5


def test_current_naming_garbage_is_refused(tmp_path):
    (tmp_path / CURRENT).write_text("../../etc/passwd\n")
    with pytest.raises(ValueError, match="not a manifest"):
        Manifest(tmp_path).open()
    (tmp_path / CURRENT).write_text("MANIFEST-000009\n")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Manifest(tmp_path).open()


# ----------------------------------------------------------------------
# Crashes: every acknowledged edit survives, nothing unwritten appears


def run_until_crash(fs: CrashFs, rng: random.Random, state: dict) -> None:
    """Random appends and compactions until the file system crashes.

    state["acknowledged"]: live PUTs after every append that returned;
    state["puts"]: every PUT ever attempted; state["in_flight"]: the batch
    being appended when the crash hit (any prefix of it may survive).
    """
    acknowledged = state["acknowledged"]
    manifest = Manifest(DIRECTORY, FsyncPolicy.STRICT, fs)
    manifest.open()
    while True:
        if rng.random() < 0.15:
            manifest.compact()
            continue
        batch = []
        for _ in range(rng.randint(1, 4)):
            if acknowledged and rng.random() < 0.3:
                victim = rng.choice(sorted(acknowledged))
                batch.append(remove(manifest, int.from_bytes(victim[1], "little")))
            else:
                record = put(manifest, state["next_key"])
                state["next_key"] += 1
                state["puts"][(record.namespace_id, record.key)] = record
                batch.append(record)
        state["in_flight"] = batch
        manifest.append(batch)  # under STRICT: durable once this returns
        state["in_flight"] = []
        for record in batch:
            if isinstance(record, PutRecord):
                acknowledged[(record.namespace_id, record.key)] = record
            else:
                acknowledged.pop((record.namespace_id, record.key), None)


@pytest.mark.parametrize("seed", range(40))
def test_crash_anywhere_loses_nothing_acknowledged(seed):
    rng = random.Random(seed)
    fs = CrashFs(seed)
    state: dict = {"acknowledged": {}, "puts": {}, "in_flight": [], "next_key": 0}
    for _ in range(6):
        fs.crash_after(rng.randint(1, 60))
        with pytest.raises(Crash):
            run_until_crash(fs, rng, state)
        fs.crash(torn=True)
        recovered = Manifest(DIRECTORY, FsyncPolicy.STRICT, fs)
        recovered.open()
        # A removal that was being appended may or may not have survived.
        maybe_removed = {(r.namespace_id, r.key) for r in state["in_flight"] if isinstance(r, RemoveRecord)}
        for identity, record in state["acknowledged"].items():
            if identity not in maybe_removed:
                assert recovered.live.get(identity) == record, f"acknowledged {identity[1][:4].hex()} lost"
        for identity, record in recovered.live.items():
            # Nothing that was never written comes back, and what comes back
            # is exactly what was written.
            assert state["puts"][identity] == record
        # What survived is the new truth for the next round.
        state["acknowledged"] = dict(recovered.live)
        state["in_flight"] = []
