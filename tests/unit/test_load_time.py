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
    meter.add(0, 1.0)
    meter.add(MIB, 0.0)  # no evidence either way
    assert meter.bytes_per_s is None
    for _ in range(20):
        meter.add(16 * MIB, 16 * MIB / 2e9)  # 2 GB/s
    assert meter.bytes_per_s == pytest.approx(2e9)
    for _ in range(4):  # 64 MiB at 0.5 GB/s: one half-life
        meter.add(16 * MIB, 16 * MIB / 0.5e9)
    slowed = meter.bytes_per_s
    assert 0.5e9 < slowed < 1.2e9  # half the weight moved to the slow transfers
    for _ in range(40):
        meter.add(16 * MIB, 16 * MIB / 0.5e9)
    assert meter.bytes_per_s == pytest.approx(0.5e9, rel=0.01)


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
