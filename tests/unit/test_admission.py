"""The disk admission filter (kvd.core.policy.admission) on its own: exact
counts, the blocks a batch makes admissible, aging, bounded memory and the
rate of false admissions."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from kvd.core.policy.admission import AdmissionFilter
from kvd.invariants import InvariantError
from kvd.testing import core_ops


def key(number: int, salt: bytes = b"") -> bytes:
    # Block keys are SHA-256 digests.
    return hashlib.sha256(salt + number.to_bytes(8, "little")).digest()


def test_min_hits_1_is_off_admits_everything_and_allocates_nothing():
    admission = AdmissionFilter(1)
    assert not admission.active and core_ops.memory_bytes(admission) == 0
    assert admission.record(key(0)) and admission.admits(key(0))
    assert admission.estimate(key(0)) == 0
    assert admission.record_many([key(0), key(1)]) == []
    assert admission.sightings == 0
    admission.verify()


def test_min_hits_2_needs_two_sightings():
    admission = AdmissionFilter(2, width=1 << 12)
    a, b = key(1), key(2)
    assert not admission.record(a) and not admission.admits(a)
    assert admission.record(a) and admission.admits(a)
    assert not admission.admits(b)
    assert (admission.estimate(a), admission.estimate(b)) == (2, 0)
    admission.verify()


def test_record_many_reports_the_keys_that_just_qualified():
    admission = AdmissionFilter(3, width=1 << 12)
    keys = [key(n) for n in range(4)]
    admission.record(keys[0])
    admission.record(keys[0])
    admission.record(keys[1])
    assert admission.record_many(keys) == [0]  # 2 -> 3; key 1 only reaches 2
    assert admission.record_many(keys) == [1]  # key 0 qualified already
    assert [admission.estimate(k) for k in keys] == [4, 3, 2, 2]
    assert admission.record_many([]) == []
    assert admission.sightings == 11


def test_one_key_and_batches_count_in_the_same_counters():
    single, batch = AdmissionFilter(2, width=1 << 10), AdmissionFilter(2, width=1 << 10)
    keys = [key(n) for n in range(60)]
    for _ in range(3):
        for k in keys:
            single.record(k)
            batch.record_many([k])
    assert np.array_equal(single._table, batch._table)
    assert single.agings == batch.agings == 0 and single.sightings == batch.sightings == 180
    assert [single.estimate(k) for k in keys] == [batch.estimate(k) for k in keys]


def test_counters_saturate_instead_of_wrapping():
    admission = AdmissionFilter(255, width=1 << 12)
    for _ in range(300):
        admission.record(key(0))
    admission.record_many([key(0)] * 1)
    assert admission.estimate(key(0)) == 255
    assert admission.admits(key(0))


def test_estimates_are_never_below_the_true_count():
    """Even where two keys of one batch share a counter (raised once)."""
    admission = AdmissionFilter(2, width=1 << 10)
    rng = random.Random(7)
    truth = {key(n): rng.randint(0, 4) for n in range(120)}
    rounds = [[k for k, count in truth.items() if count > round_] for round_ in range(4)]
    for keys in rounds:
        rng.shuffle(keys)
        admission.record_many(keys)
    assert admission.agings == 0  # fewer sightings than one aging interval
    assert all(admission.estimate(k) >= count for k, count in truth.items())
    first_row = [admission._cells_of(k)[0] for k in rounds[0]]
    assert len(set(first_row)) < len(first_row)  # keys of one batch did share counters


def test_aging_halves_every_counter_each_quarter_width_of_sightings():
    admission = AdmissionFilter(2, width=1 << 10)
    assert admission.aging_interval == 256
    hot = key(0)
    admission.record(hot)
    admission.record(hot)
    admission.record_many([key(n, b"other") for n in range(253)])
    assert admission.agings == 0 and admission.estimate(hot) == 2 and admission.admits(hot)
    admission.record(key(0, b"last"))  # the 256th sighting
    assert admission.agings == 1 and admission.sightings == 0
    # Seen twice, but long ago: it must be seen again to be admitted.
    assert admission.estimate(hot) == 1 and not admission.admits(hot)
    assert admission.record(hot)


def test_memory_is_fixed_and_false_admissions_stay_rare():
    admission = AdmissionFilter.for_slots(2, 1000)
    assert admission.width == 8192 and core_ops.memory_bytes(admission) == 4 * 8192
    # 200,000 blocks, each seen once: the window keeps moving.
    for batch in range(400):
        admission.record_many([key(n, b"stream%d" % batch) for n in range(500)])
    assert core_ops.memory_bytes(admission) == 4 * 8192
    assert admission.agings == 200_000 // admission.aging_interval
    admission.verify()
    fresh = [key(n, b"fresh") for n in range(2000)]
    admitted = sum(admission.record(k) for k in fresh)
    assert admitted / len(fresh) < 0.05


def test_for_slots_sizes_the_sketch_within_bounds():
    assert AdmissionFilter.for_slots(2, 1).width == 1 << 10
    assert AdmissionFilter.for_slots(2, 8192).width == 1 << 16
    assert AdmissionFilter.for_slots(2, 8193).width == 1 << 17
    assert AdmissionFilter.for_slots(2, 10**8).width == 1 << 22
    assert core_ops.memory_bytes(AdmissionFilter.for_slots(1, 10**8)) == 0


@pytest.mark.parametrize(("min_hits", "width"), [(0, 1024), (256, 1024), (2, 1000), (2, 8)])
def test_bad_arguments_are_refused(min_hits, width):
    with pytest.raises(InvariantError):
        AdmissionFilter(min_hits, width)
