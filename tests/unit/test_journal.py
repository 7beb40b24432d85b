"""The disk tier's manifest: framing, replay, compaction, and crashes."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import pytest

from kvd.testing.crashfs import Crash, CrashFs
from kvd.tiers.disk.frames import FRAME_HEADER, RecordType, decode_frames, encode_frame
from kvd.tiers.disk.journal import CURRENT, FsyncPolicy, Manifest, MetadataDamage
from kvd.tiers.disk.records import ROOT_PARENT, PutRecord, RemoveRecord

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
    scan = decode_frames(data)
    assert scan.valid_end == len(data) and scan.damaged == []
    assert [kind for kind, _ in scan.frames] == [RecordType.PUT, RecordType.REMOVE, RecordType.SNAPSHOT_BEGIN]
    assert PutRecord.decode(scan.frames[0][1]) == record
    assert RemoveRecord.decode(scan.frames[1][1]) == removal


def _records_and_boundaries():
    records = [PutRecord(n, NAMESPACE, key(n), key(n - 1), n, struct.pack("<I", n) * (n % 4)) for n in range(1, 9)]
    encoded = [record.encode() for record in records]
    boundaries = [0]
    for frame in encoded:
        boundaries.append(boundaries[-1] + len(frame))
    return records, b"".join(encoded), boundaries


def test_every_truncation_yields_a_prefix_of_the_records_and_a_torn_tail():
    records, data, boundaries = _records_and_boundaries()
    for cut in range(len(data) + 1):
        scan = decode_frames(data[:cut])
        assert scan.valid_end == max(b for b in boundaries if b <= cut)
        assert scan.damaged == []  # a cut is a torn tail, never damage
        assert [PutRecord.decode(payload) for _, payload in scan.frames] == records[: len(scan.frames)]


def test_every_single_byte_flip_costs_only_the_record_it_hit():
    """Issue 10: one flipped byte in a manifest used to drop every record
    after it. Every byte position, every bit: only the hit record is lost,
    the damage is reported where it is, and nothing else changes."""
    records, data, boundaries = _records_and_boundaries()
    for position in range(len(data)):
        hit = max(index for index, b in enumerate(boundaries[:-1]) if b <= position)
        for bit in range(8):
            damaged = bytearray(data)
            damaged[position] ^= 1 << bit
            scan = decode_frames(bytes(damaged))
            decoded = [PutRecord.decode(payload) for _, payload in scan.frames]
            assert decoded == records[:hit] + records[hit + 1:], (position, bit)
            if hit == len(records) - 1:
                assert scan.damaged == [] and scan.valid_end == boundaries[hit]  # the last one: a torn tail
            else:
                assert scan.damaged == [(boundaries[hit], boundaries[hit + 1])]
                assert scan.valid_end == len(data)


def test_garbage_between_records_is_skipped_and_reported():
    records, data, boundaries = _records_and_boundaries()
    rng = random.Random(3)
    for length in (1, 9, 100, 4096, 70_000):
        garbage = bytes(rng.randrange(256) for _ in range(length)) if length < 5000 else bytes(length)
        mixed = data[: boundaries[3]] + garbage + data[boundaries[3]:]
        scan = decode_frames(mixed)
        assert [PutRecord.decode(payload) for _, payload in scan.frames] == records
        assert scan.damaged == [(boundaries[3], boundaries[3] + length)]


def test_oversized_or_unknown_frames_are_skipped_not_trusted():
    good = encode_frame(RecordType.REMOVE, RemoveRecord(1, NAMESPACE, key(1)).encode()[FRAME_HEADER.size:])
    bad_type = FRAME_HEADER.pack(0, 0, 99)
    huge = FRAME_HEADER.pack(1 << 30, 0, RecordType.PUT)
    wrong_length = FRAME_HEADER.pack(5, 0, RecordType.REMOVE) + bytes(5)
    for tail in (bad_type, huge, wrong_length):
        scan = decode_frames(good + tail + good)
        assert len(scan.frames) == 2 and scan.damaged == [(len(good), len(good) + len(tail))]


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


def test_unreadable_current_is_damage_that_names_the_file(tmp_path):
    manifest = Manifest(tmp_path)
    manifest.open()
    manifest.append([put(manifest, n) for n in range(3)])
    for content, problem in ((b"../../etc/passwd\n", "does not name a manifest"), (b"", "does not name a manifest"),
                             (b"\xff\x00garbage", "does not name a manifest"),
                             (b"MANIFEST-000009\n", "is missing")):
        (tmp_path / CURRENT).write_bytes(content)
        with pytest.raises(MetadataDamage) as raised:
            Manifest(tmp_path).open()
        assert problem in raised.value.problem
        assert raised.value.blocks == 3  # what the newest manifest describes, for the report
    (tmp_path / CURRENT).unlink()
    with pytest.raises(MetadataDamage, match="CURRENT: is missing, but MANIFEST-000001 holds 3 blocks"):
        Manifest(tmp_path).open()
    assert (tmp_path / "MANIFEST-000001").exists()  # left as it was, for repair


def test_a_zeroed_or_emptied_manifest_is_damage(tmp_path):
    manifest = Manifest(tmp_path)
    manifest.open()
    manifest.append([put(manifest, n) for n in range(3)])
    size = manifest.path.stat().st_size
    for content in (bytes(size), b""):
        manifest.path.write_bytes(content)
        with pytest.raises(MetadataDamage, match="holds no valid record"):
            Manifest(tmp_path).open()


def test_no_current_and_an_empty_snapshot_is_a_new_drive(tmp_path):
    """A first open cut short after writing MANIFEST-000001 (an empty
    snapshot) but before CURRENT: nothing was ever stored, so it starts anew."""
    Manifest(tmp_path).open()
    (tmp_path / CURRENT).unlink()
    report = Manifest(tmp_path).open()
    assert report.live_blocks == 0 and (tmp_path / CURRENT).read_text() == "MANIFEST-000001\n"


def test_no_current_is_damage_unless_the_drive_is_new(tmp_path):
    """Without CURRENT only an interrupted first open starts anew: a zeroed
    manifest, or a drive whose segments exist, never passes for a new drive
    (its blocks would be dropped in silence)."""
    manifest = Manifest(tmp_path)
    manifest.open()
    (tmp_path / CURRENT).unlink()
    with pytest.raises(MetadataDamage, match="the drive is not new"):
        Manifest(tmp_path).open(in_use=True)
    (tmp_path / "MANIFEST-000001").write_bytes(bytes(64))
    with pytest.raises(MetadataDamage, match="the drive is not new"):
        Manifest(tmp_path).open()
    assert (tmp_path / "MANIFEST-000001").read_bytes() == bytes(64)  # left for repair


def test_damage_inside_a_manifest_is_counted_and_costs_only_its_records(tmp_path):
    manifest = Manifest(tmp_path)
    manifest.open()
    manifest.append([put(manifest, n) for n in range(10)])
    manifest.compact()  # a snapshot of ten
    manifest.append([put(manifest, n) for n in range(10, 20)])
    manifest.append([remove(manifest, n) for n in range(0, 4)])
    data = bytearray(manifest.path.read_bytes())
    scan = decode_frames(bytes(data))
    # Flip a byte in the 3rd snapshot PUT and in the 5th appended PUT.
    snapshot_put = scan.positions[3]
    appended_put = scan.positions[1 + 10 + 1 + 4]
    data[snapshot_put + 20] ^= 0x40
    data[appended_put + 20] ^= 0x40
    manifest.path.write_bytes(bytes(data))
    reopened = Manifest(tmp_path)
    report = reopened.open()
    assert report.damaged_regions == 2 and report.lost_records == 2 and report.damaged
    assert sorted(int.from_bytes(k, "little") for _, k in reopened.live) == [
        n for n in range(4, 20) if n not in (2, 14)]
    assert reopened.next_sequence == manifest.next_sequence
    assert report.truncated_bytes == 0


def test_a_snapshot_short_of_its_count_is_reported(tmp_path):
    manifest = Manifest(tmp_path)
    manifest.open()
    manifest.append([put(manifest, n) for n in range(6)])
    manifest.compact()
    data = bytearray(manifest.path.read_bytes())
    scan = decode_frames(bytes(data))
    start, end = scan.positions[2], scan.positions[4]
    manifest.path.write_bytes(bytes(data[:start]) + bytes(end - start) + bytes(data[end:]))  # two PUTs zeroed
    report = Manifest(tmp_path).open()
    assert report.damaged_regions == 1 and report.lost_records == 2


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
