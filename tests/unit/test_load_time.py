"""How long a hit would take to load (kvd.planner.load_time): a rate that follows the recent
transfers, and per-block cumulative seconds from the queue ahead and each tier's rate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvd.planner.io_schedule import IoClass, IoJob, IoSchedule
from kvd.planner.load_time import RateMeter, load_seconds
from kvd.v1 import kvd_pb2

HOST, DISK, REMOTE = kvd_pb2.TIER_HOST, kvd_pb2.TIER_DISK, kvd_pb2.TIER_REMOTE
MIB = 1 << 20


def test_a_rate_is_unknown_until_measured_and_then_follows_the_recent_transfers():
    meter = RateMeter(half_life_bytes=64 * MIB)
    assert meter.bytes_per_s is None
    meter.add(0, 1.0, ended=0.0)
    meter.add(MIB, 0.0, ended=0.0)  # no evidence either way
    assert meter.bytes_per_s is None
    for _ in range(20):  # all ending at one moment: only bytes decay
        meter.add(16 * MIB, 16 * MIB / 2e9, ended=0.0)  # 2 GB/s
    assert meter.bytes_per_s == pytest.approx(2e9)
    for _ in range(4):  # 64 MiB at 0.5 GB/s: one half-life
        meter.add(16 * MIB, 16 * MIB / 0.5e9, ended=0.0)
    slowed = meter.bytes_per_s
    assert 0.5e9 < slowed < 1.2e9  # half the weight moved to the slow transfers
    for _ in range(40):
        meter.add(16 * MIB, 16 * MIB / 0.5e9, ended=0.0)
    assert meter.bytes_per_s == pytest.approx(0.5e9, rel=0.01)


def test_a_drive_that_slows_down_shows_within_seconds_though_it_moves_few_bytes():
    """256 MiB read at 512 MiB/s, then 4 s of reads at 12 MiB/s (48 MiB, far under the byte
    half-life): decayed by bytes alone the rate would still say about 60 MiB/s; the time half-life
    brings it within a third of the slow rate. Without new transfers it stays where it is."""
    meter, clock = RateMeter(half_life_bytes=256 * MIB, half_life_s=1.0), 0.0
    for _ in range(32):
        clock += 8 / 512
        meter.add(8 * MIB, 8 / 512, ended=clock)
    assert meter.bytes_per_s == pytest.approx(512 * MIB, rel=0.01)
    for _ in range(48):
        clock += 1 / 12
        meter.add(MIB, 1 / 12, ended=clock)
    assert 12 * MIB <= meter.bytes_per_s < 20 * MIB
    by_bytes = RateMeter(half_life_bytes=256 * MIB, half_life_s=1e9)
    for index in range(80):
        by_bytes.add(*((8 * MIB, 8 / 512) if index < 32 else (MIB, 1 / 12)), ended=float(index))
    assert by_bytes.bytes_per_s > 45 * MIB  # the byte half-life alone: still far too fast
    settled = meter.bytes_per_s
    assert meter.bytes_per_s == settled  # reading it changes nothing; only a transfer does


def test_load_seconds_adds_up_the_queue_ahead_and_each_block_at_its_tiers_rate():
    tiers = bytes([HOST, HOST, DISK, DISK, REMOTE])
    seconds = load_seconds(tiers, MIB, {DISK: 8 * MIB}, {DISK: MIB / 0.01, REMOTE: MIB / 0.1})
    # host blocks cost nothing; the first disk block waits for 8 MiB queued, then each takes 10 ms
    np.testing.assert_allclose(seconds, [0, 0, 0.09, 0.10, 0.20], rtol=1e-5)
    assert seconds.dtype == np.float32


def test_a_tier_not_measured_yet_makes_its_first_block_and_everything_after_unknown():
    seconds = load_seconds(bytes([HOST, DISK, DISK]), MIB, {}, {DISK: None, REMOTE: None})
    assert seconds[0] == 0 and all(math.isnan(value) for value in seconds[1:])
    assert load_seconds(b"", MIB, {}, {DISK: 1.0}).shape == (0,)


@pytest.mark.parametrize("mode", ["slack", "fifo"])
def test_the_schedule_counts_the_bytes_queued_per_class(mode):
    schedule = IoSchedule(mode)
    for io_class, nbytes in ((IoClass.RESTORE, 3 * MIB), (IoClass.PREFETCH, MIB), (IoClass.RESTORE, MIB),
                             (IoClass.WRITE, 7 * MIB)):
        schedule.push(IoJob(io_class, None, nbytes))
    assert [schedule.queued_bytes(c) for c in (IoClass.RESTORE, IoClass.PREFETCH, IoClass.WRITE)] == \
        [4 * MIB, MIB, 7 * MIB]
    schedule.pop()
    assert schedule.queued_bytes(IoClass.RESTORE) == MIB
