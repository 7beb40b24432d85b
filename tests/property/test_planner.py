"""The placement planner's model and search (kvd.planner): the step-latency model equals a
discrete-event simulation of layer-wise prefetch over one shared link; branch and bound finds the
same latency as exhaustive search over the pruned distances; no answer is ever over the budget."""

from __future__ import annotations

import heapq
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.planner.distance import NONE, distance_options, is_offloaded
from kvd.planner.latency import Batch, gpu_bytes, step_latency
from kvd.planner.search import branch_and_bound, exhaustive, native_step_latency


def simulate(batch: Batch, distances) -> float:
    """The same system as kvd.planner.latency, as a plain event simulation: a heap of timed events
    (a layer ends, a transfer ends, a layer tries to start), one link serving a FIFO queue."""
    layers = batch.layers
    needs = {j: {r for r, d in enumerate(distances) if is_offloaded(d, j)} for j in range(1, layers + 1)}
    asked_at = {k: [] for k in range(1, layers + 1)}
    for r, d in enumerate(distances):
        for j in range(1, layers + 1):
            if is_offloaded(d, j):
                asked_at[max(1, j - d)].append((j, r))
    events, order = [(0.0, 0, "try", 1)], itertools.count(1)
    queue, link_busy, arrived, started, ended, finish = [], False, set(), set(), {0}, 0.0

    def push(time, kind, data):
        heapq.heappush(events, (time, next(order), kind, data))

    while events:
        now, _, kind, data = heapq.heappop(events)
        if kind == "try" and data <= layers and data not in started and data - 1 in ended and \
                needs[data] <= {r for j, r in arrived if j == data}:
            started.add(data)
            queue.extend(sorted(asked_at[data]))
            push(now + batch.compute_s[data - 1], "end", data)
        elif kind == "end":
            ended.add(data)
            finish = now
            push(now, "try", data + 1)
        elif kind == "arrive":
            arrived.add(data)
            link_busy = False
            push(now, "try", min(k for k in range(1, layers + 2) if k not in started))
        if not link_busy and queue:
            j, r = queue.pop(0)
            link_busy = True
            push(now + batch.kv_bytes[r] / batch.bandwidth_bps, "arrive", (j, r))
    return finish


batches = st.builds(
    lambda compute, sizes, bandwidth: Batch(tuple(compute), tuple(sizes), bandwidth),
    st.lists(st.floats(0.1, 5.0), min_size=2, max_size=12),
    st.lists(st.integers(0, 200), min_size=1, max_size=4),
    st.floats(1.0, 500.0),
)


@given(batch=batches, data=st.data())
@settings(max_examples=400, deadline=None)
def test_the_model_equals_an_event_simulation_of_the_same_system(batch, data):
    options = distance_options(batch.layers)
    distances = [data.draw(st.sampled_from(options)) for _ in batch.kv_bytes]
    model, events = step_latency(batch, distances), simulate(batch, distances)
    assert abs(model - events) <= 1e-9 * max(1.0, events), (distances, model, events)
    # The search's own copy of the model, in native code, is the same model.
    assert abs(native_step_latency(batch, distances) - model) <= 1e-12 * max(1.0, model)


tight_batches = st.builds(
    lambda compute, sizes, bandwidth: Batch(tuple(compute), tuple(sizes), bandwidth),
    st.lists(st.floats(0.1, 5.0), min_size=4, max_size=8),
    st.lists(st.integers(1, 200), min_size=2, max_size=5),
    st.floats(1.0, 100.0),
)


@given(batch=st.one_of(batches, tight_batches), share=st.floats(0.3, 1.05))
@settings(max_examples=300, deadline=None)
def test_branch_and_bound_finds_what_exhaustive_search_finds_and_never_exceeds_the_budget(batch, share):
    budget = int(sum(batch.kv_bytes) * batch.layers * share)
    oracle, found = exhaustive(batch, budget), branch_and_bound(batch, budget)
    assert (oracle is None) == (found is None)
    if found is not None:
        assert abs(found.latency_s - oracle.latency_s) <= 1e-9 * oracle.latency_s
        assert found.gpu_bytes == gpu_bytes(batch, found.distances) <= budget
        assert abs(step_latency(batch, found.distances) - found.latency_s) <= 1e-12
        assert found.exact


@given(batch=tight_batches, share=st.floats(0.5, 1.0), nodes=st.integers(1, 5))
@settings(max_examples=100, deadline=None)
def test_a_search_cut_short_says_so_and_still_fits(batch, share, nodes):
    budget = int(sum(batch.kv_bytes) * batch.layers * share)
    whole, cut = branch_and_bound(batch, budget), branch_and_bound(batch, budget, max_nodes=nodes)
    assert cut is None or cut.gpu_bytes == gpu_bytes(batch, cut.distances) <= budget
    assert cut is None or cut.latency_s >= whole.latency_s - 1e-12
    assert cut is None or cut.bound_s <= whole.latency_s * (1 + 1e-12)
    if cut is not None and cut.exact:
        assert abs(cut.latency_s - whole.latency_s) <= 1e-12
    if whole is not None and whole.explored > nodes:
        assert cut is None or not cut.exact


def test_malformed_batches_are_refused_by_name():
    import numpy as np
    import pytest

    from kvd._native import plan_search, plan_step_latency

    compute, sizes = np.ones(4), np.ones(2)
    with pytest.raises(ValueError, match="distance 4 is neither"):
        plan_step_latency(compute, sizes, 1.0, np.array([4, -1], dtype=np.int32))
    with pytest.raises(ValueError, match="one distance per request"):
        plan_step_latency(compute, sizes, 1.0, np.array([-1], dtype=np.int32))
    with pytest.raises(ValueError, match="positive bandwidth"):
        plan_step_latency(compute, sizes, 0.0, np.array([-1, -1], dtype=np.int32))
    with pytest.raises(ValueError, match="start with -1"):
        plan_search(compute, sizes, 1.0, np.array([1], dtype=np.int32), 100.0, 0)
    with pytest.raises(ValueError, match="not a distance"):
        plan_search(compute, sizes, 1.0, np.array([-1, 0], dtype=np.int32), 100.0, 0)
    with pytest.raises(ValueError, match="kv_bytes"):
        plan_search(compute, np.ones(257), 1.0, np.array([-1], dtype=np.int32), 100.0, 0)
    with pytest.raises(ValueError, match="compute_s"):
        plan_search(np.ones(3, dtype=np.float32), sizes, 1.0, np.array([-1], dtype=np.int32), 100.0, 0)


def test_a_hand_worked_step():
    """Two requests offloading every other layer of four 1 s layers: the 2 s transfer of the second
    request holds layer 2 back to t = 3, and layer 4's pair of transfers (t = 4..7) holds it to 7."""
    batch = Batch((1.0,) * 4, (10, 20), 10.0)
    assert step_latency(batch, [NONE, NONE]) == 4.0
    assert step_latency(batch, [1, NONE]) == 4.0
    assert step_latency(batch, [1, 1]) == 8.0
    assert gpu_bytes(batch, [1, 1]) == 10 * 3 + 20 * 3


def test_the_pruned_space_keeps_the_longest_look_ahead_per_offloaded_count():
    assert distance_options(32) == (NONE, 31, 15, 9, 7, 5, 4, 3, 2, 1)
    assert len(distance_options(80)) == 16
