"""The worker's copies on a CPU engine: one native call per layer part, on the worker's copy thread.

A layer's loaded bytes must be in the engine when its wait_layer returns (its attention runs next),
and a save's bytes must be copied before finish_step commits them; the native path must move exactly
the bytes torch's indexed copy moves, and refuse an engine block outside the cache.
"""

from __future__ import annotations

import json
import os
import threading

import pytest
import torch

from kvd.connectors.vllm import copies, worker as worker_module
from kvd.connectors.vllm.layout import paged_layout
from kvd.connectors.vllm.metadata import KvdConnectorMetadata, LoadOrder, SaveOrder
from tests.integration.test_vllm_worker import BLOCKS, chain, kv_caches, step, worker_for


def test_each_layer_is_in_the_engine_when_its_wait_returns(daemon):
    engine_a, engine_b = kv_caches(seed=3), kv_caches(seed=None)
    keys = chain(4, seed=7)
    saver, loader = worker_for(daemon, engine_a), worker_for(daemon, engine_b)
    try:
        step(saver, engine_a, KvdConnectorMetadata(saves=[SaveOrder("a", [keys], [[0, 1, 2, 3]])]))
        loader.start(KvdConnectorMetadata(loads=[LoadOrder("b", [keys], 0, [[8, 9, 10, 11]], False)]))
        assert loader._copier is not None, "a CPU engine copies on the worker's copy thread"
        for name in engine_b:
            loader.wait_layer(name)
            assert torch.equal(engine_b[name][[8, 9, 10, 11]], engine_a[name][[0, 1, 2, 3]]), name
            loader.save_layer(name)
        loader.finish_step()
        assert loader.load_errors() == set() and loader.counters.loaded_blocks == 4
    finally:
        saver.close()
        loader.close()


def test_a_save_is_committed_only_after_its_copies_ran(daemon, monkeypatch):
    """The save copies are gated until a commit happens (or 0.5 s pass): with finish_step draining the
    copy thread first, every copy ends before the commit; without, the commit would come first."""
    order: list[str] = []
    committed = threading.Event()
    copy = worker_module.copy_layer

    def gated_copy(*args, into_engine: bool) -> None:
        if not into_engine:
            committed.wait(0.5)
        copy(*args, into_engine=into_engine)
        order.append("copy")

    monkeypatch.setattr(worker_module, "copy_layer", gated_copy)
    engine = kv_caches(seed=4)
    saver = worker_for(daemon, engine)
    commit = saver.link.commit

    def recorded_commit(*args, **kwargs):
        order.append("commit")
        committed.set()
        return commit(*args, **kwargs)

    saver.link.commit = recorded_commit
    try:
        step(saver, engine, KvdConnectorMetadata(saves=[SaveOrder("a", [chain(2, seed=9)], [[4, 5]])]))
    finally:
        saver.close()
    assert order == ["copy"] * len(engine) + ["commit"]
    assert saver.counters.saved_blocks == 2


@pytest.mark.parametrize("into_engine", [True, False])
def test_the_native_copy_moves_what_an_indexed_copy_moves(monkeypatch, into_engine):
    caches = kv_caches(seed=5)
    layout = paged_layout(caches, BLOCKS)
    # random bits: compared as integers below (as floats some are NaNs, which never compare equal)
    arena = torch.randint(-2**62, 2**62, (20, layout.layer_bytes * len(caches) // 8), dtype=torch.int64)
    slots, blocks = torch.tensor([17, 2, 9]), torch.tensor([11, 0, 6])
    results = []
    for native in (True, False):
        monkeypatch.setattr(copies, "native_copies", lambda native=native: native)
        engine_copy = {name: tensor.clone() for name, tensor in caches.items()}
        arena_copy = arena.clone()
        copied = paged_layout(engine_copy, BLOCKS)
        for layer in range(len(caches)):
            copies.copy_layer(arena_copy, copied, layer, slots, blocks, into_engine=into_engine)
        results.append((engine_copy, arena_copy))
    (native_engine, native_arena), (torch_engine, torch_arena) = results
    assert torch.equal(native_arena, torch_arena)
    assert all(torch.equal(bits(native_engine[name]), bits(torch_engine[name])) for name in caches)
    changed = native_engine if into_engine else {"arena": native_arena}
    original = caches if into_engine else {"arena": arena}
    assert any(not torch.equal(bits(changed[name]), bits(original[name])) for name in changed), "nothing was copied"


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.int32)


def test_an_engine_block_outside_the_cache_is_refused_not_copied():
    caches = kv_caches(seed=6)
    layout = paged_layout(caches, BLOCKS)
    arena = torch.zeros(4, layout.layer_bytes * len(caches) // 8, dtype=torch.int64)
    before = {name: tensor.clone() for name, tensor in caches.items()}
    with pytest.raises(IndexError, match=r"row index outside \[0, 12\)"):
        copies.copy_layer(arena, layout, 0, torch.tensor([1]), torch.tensor([BLOCKS]), into_engine=True)
    assert all(torch.equal(before[name], caches[name]) for name in caches)


def test_the_timeline_shows_each_layer_landed_and_copied_before_its_wait_ends(daemon, tmp_path):
    from kvd.connectors.vllm.config import ConnectorConfig
    from kvd.connectors.vllm.transfer import local_namespace
    from kvd.connectors.vllm.worker import WorkerSide
    from tests.integration.test_vllm_worker import SPEC

    engine_a, engine_b = kv_caches(seed=8), kv_caches(seed=None)
    keys = chain(3, seed=11)
    saver = worker_for(daemon, engine_a)
    config = ConnectorConfig(target=daemon.unix_target, timeline=str(tmp_path / "timeline"))
    loader = WorkerSide(config, paged_layout(engine_b, BLOCKS), local_namespace(SPEC), shard=0)
    try:
        step(saver, engine_a, KvdConnectorMetadata(saves=[SaveOrder("a", [keys], [[0, 1, 2]])]))
        step(loader, engine_b, KvdConnectorMetadata())  # a step without kvd work writes no line
        step(loader, engine_b, KvdConnectorMetadata(loads=[LoadOrder("b", [keys], 0, [[3, 4, 5]], False)],
                                                     saves=[SaveOrder("b", [keys + chain(1, seed=12)], [[3, 4, 5, 6]])]))
    finally:
        saver.close()
        loader.close()
    lines = (tmp_path / "timeline" / "worker0.jsonl").read_text().splitlines()
    assert len(lines) == 1
    events = json.loads(lines[0])["events"]
    spans = {(what, layer): (t0, t1) for what, layer, t0, t1 in events}
    assert {what for what, *_ in events} >= {"open", "landed", "wait", "copy_in", "reserve", "drain", "close", "commit"}
    for layer in range(len(engine_b)):
        assert spans[("landed", layer)][0] <= spans[("copy_in", layer)][0]
        assert spans[("copy_in", layer)][1] <= spans[("wait", layer)][1]
    assert all(t0 <= t1 for _, _, t0, t1 in events)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to keep one for the model")
def test_the_copy_thread_leaves_the_cpus_the_model_thread_is_bound_to(daemon):
    """vLLM's CPU backend binds the model's thread (which builds the worker) to its OpenMP cores: the
    copy thread takes the others, so copies run beside the compute rather than taking turns with it.
    A worker built by a thread bound to nothing keeps every CPU for its copies."""
    everything = os.sched_getaffinity(0)
    model_core = {min(everything)}
    seen: dict[str, set[int]] = {}

    def build(name: str, cpus: set[int]) -> None:
        os.sched_setaffinity(0, cpus)  # this thread only, as vLLM binds its model thread
        worker = worker_for(daemon, kv_caches(seed=None))
        try:
            seen[name] = worker._copier.submit(os.sched_getaffinity, 0).result()
        finally:
            worker.close()

    for name, cpus in (("bound", model_core), ("unbound", everything)):
        thread = threading.Thread(target=build, args=(name, cpus))
        thread.start()
        thread.join()
    assert seen == {"bound": everything - model_core, "unbound": everything}
