"""A namespace's blocks per tier (kvd.core.namespace_usage) and its deletion (kvd.core.deletes):
exact counts over host memory and the disk, Delete's rule for pinned blocks, steps that the engine's
changes interleave with, and the loop time of each step with 100,000 blocks."""

from __future__ import annotations

import time

import pytest

from kvd.core.block import BlockState
from kvd.core.engine import Engine, TierId
from kvd.core.events import EventKind
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.requests import CommitRequest, KeysRequest
from kvd.server.handlers.admin import DELETE_STEP_BLOCKS, USAGE_STEP_BLOCKS
from kvd.testing import engine_ops

# Blocks of 16 bytes.
SPEC = NamespaceSpec(model_id="admin-test", num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=1)
OTHER = NamespaceSpec(model_id="other", num_layers=1, num_kv_heads=1, head_dim=4, block_tokens=1)
HOST_SLOT = 4096  # the smaller of the host's two slot classes
DISK_SLOT = 64
LONG = 10_000


def K(spec: NamespaceSpec, chain: str) -> list[bytes]:
    return chain_keys(spec, [ord(ch) for ch in chain])


def put(engine: Engine, namespace_id: bytes, keys: list[bytes], parent_key: bytes = b"") -> None:
    result = engine.reserve(KeysRequest(namespace_id, "w", keys, LONG, 0, parent_key=parent_key))
    engine.commit(CommitRequest(namespace_id, "w", result.lease.lease_id, 0))


def flush(engine: Engine) -> None:
    """Write every queued block to the disk, and journal the removals, as the disk plane does."""
    writes = engine.pick_writes(1000)
    engine.finish_writes(writes, [True] * len(writes))
    journal(engine)


def journal(engine: Engine) -> list[bytes]:
    removals = engine.take_disk_removals()
    engine.disk_removals_journalled([slot for _, _, slot in removals])
    return [key for _, key, _ in removals]


@pytest.fixture
def engine(engine_factory) -> Engine:
    # Host pages of 8 KiB carved into slots down to 4 KiB: a 16 B block takes 4 KiB there, 64 B on disk.
    engine = engine_factory(16, 2 * HOST_SLOT, disk_slot_count=32, disk_slot_bytes=DISK_SLOT,
                            host_min_slot_bytes=HOST_SLOT)
    for spec in (SPEC, OTHER):
        engine.enable_disk(engine.register_namespace(spec).namespace_id)
    return engine


def usage(engine: Engine, spec: NamespaceSpec, step_blocks: int = 1000) -> dict[TierId, tuple[int, int, int]]:
    count = engine.namespace_usage(spec.namespace_id())
    while not count.done:
        count.step(step_blocks)
    return {tier.tier_id: (tier.blocks, tier.payload_bytes, tier.slot_bytes) for tier in count.usage}


def test_usage_counts_each_copy_in_each_tier_and_only_the_namespaces_own(engine):
    ns = SPEC.namespace_id()
    put(engine, ns, K(SPEC, "abcde"))
    put(engine, OTHER.namespace_id(), K(OTHER, "xy"))
    assert SPEC.block_bytes == 16
    assert usage(engine, SPEC) == {TierId.HOST: (5, 80, 5 * HOST_SLOT), TierId.DISK: (0, 0, 0)}
    flush(engine)
    assert usage(engine, SPEC) == {TierId.HOST: (5, 80, 5 * HOST_SLOT), TierId.DISK: (5, 80, 5 * DISK_SLOT)}
    # Demote while "ab" is pinned: c, d, e keep only their disk copies.
    held = engine_ops.acquire(engine, ns, K(SPEC, "ab"))
    engine_ops.demote_all(engine)
    for handle in held:
        handle.release()
    assert usage(engine, SPEC) == {TierId.HOST: (2, 32, 2 * HOST_SLOT), TierId.DISK: (5, 80, 5 * DISK_SLOT)}
    # In steps of one block, the same.
    assert usage(engine, SPEC, step_blocks=1) == usage(engine, SPEC)
    assert usage(engine, OTHER) == {TierId.HOST: (0, 0, 0), TierId.DISK: (2, 32, 2 * DISK_SLOT)}  # demoted too


def test_a_namespace_deletion_removes_every_block_from_every_tier_and_queues_its_removals(engine):
    ns = SPEC.namespace_id()
    put(engine, ns, K(SPEC, "abcd"))
    put(engine, ns, K(SPEC, "xyz"))
    put(engine, OTHER.namespace_id(), K(OTHER, "abc"))
    flush(engine)
    engine_ops.demote_all(engine)  # "abcd", "xyz" and OTHER's on disk only
    put(engine, ns, K(SPEC, "abcdef")[4:], parent_key=K(SPEC, "abcd")[-1])  # e, f in host memory only
    deleted_before = engine.host.counters.deleted
    deletion = engine.delete_namespace(ns)
    while not deletion.done:
        deletion.step(2)
    assert (deletion.deleted, deletion.pinned) == (9, 0)
    assert len(engine.namespace(ns).index) == 0
    assert usage(engine, SPEC) == {TierId.HOST: (0, 0, 0), TierId.DISK: (0, 0, 0)}
    assert engine.host.counters.deleted - deleted_before == 9
    # Every disk copy's REMOVE waits to be journalled; nothing of OTHER's.
    assert sorted(journal(engine)) == sorted(K(SPEC, "abcd") + K(SPEC, "xyz"))
    assert usage(engine, OTHER) == {TierId.HOST: (0, 0, 0), TierId.DISK: (3, 48, 3 * DISK_SLOT)}
    events = engine.events.read(ns, 1, 1000)
    removed = [key for event in events if event.kind == EventKind.REMOVED for key in event.keys]
    assert sorted(removed) == sorted(K(SPEC, "abcdef") + K(SPEC, "xyz"))
    # The registration stays: the namespace is used again as before.
    put(engine, ns, K(SPEC, "ab"))
    assert len(engine.lookup(ns, K(SPEC, "abc"))) == 2


def test_pinned_blocks_stay_with_their_ancestors_as_for_delete(engine):
    ns = SPEC.namespace_id()
    put(engine, ns, K(SPEC, "abcde"))
    put(engine, ns, K(SPEC, "xy"))
    held = engine.pin(engine.lookup(ns, K(SPEC, "abc"))[2])  # c pinned: a, b stay, d, e go
    writer = engine.reserve(KeysRequest(ns, "w2", K(SPEC, "xyz")[2:], LONG, 0, parent_key=K(SPEC, "xy")[-1]))
    deletion = engine.delete_namespace(ns)
    while not deletion.done:
        deletion.step(DELETE_STEP_BLOCKS)
    # z stays, its writer's (reserved, not committed), and x, y above it; so do c and a, b above it.
    assert (deletion.deleted, deletion.pinned) == (2, 6)
    assert [block.key for block in engine.lookup(ns, K(SPEC, "abcde"))] == K(SPEC, "abc")
    held.release()
    engine.commit(CommitRequest(ns, "w2", writer.lease.lease_id, 0, abort_keys=K(SPEC, "xyz")[2:]))
    again = engine.delete_namespace(ns)
    while not again.done:
        again.step(DELETE_STEP_BLOCKS)
    assert (again.deleted, again.pinned) == (5, 0) and len(engine.namespace(ns).index) == 0


def test_changes_between_steps_leave_blocks_stored_meanwhile_and_skip_those_gone(engine):
    ns = SPEC.namespace_id()
    put(engine, ns, K(SPEC, "abc"))
    put(engine, ns, K(SPEC, "xyz"))
    deletion = engine.delete_namespace(ns)
    assert deletion.step(1) == 1  # z: the newest block first
    # Meanwhile: "ab" gets a new child, and a Delete takes "x" (with its child y).
    put(engine, ns, K(SPEC, "abq")[2:], parent_key=K(SPEC, "ab")[-1])
    assert engine.delete(ns, K(SPEC, "x")) == (2, 0)
    while not deletion.done:
        deletion.step(1)
    # c went; b stays over q (stored after the deletion began, untouched), and so does a.
    assert (deletion.deleted, deletion.pinned) == (2, 2)
    assert [block.key for block in engine.lookup(ns, K(SPEC, "abq"))] == K(SPEC, "abq")
    assert all(block.state == BlockState.SEALED for block in engine.namespace(ns).index)


def _fill(engine: Engine, namespace_id: bytes, blocks: int, chain_blocks: int = 1000) -> None:
    for start in range(0, blocks, chain_blocks):
        keys = chain_keys(SPEC, list(range(start, start + chain_blocks)))
        put(engine, namespace_id, keys)


def test_steps_over_a_hundred_thousand_blocks_stay_short(engine_factory, capsys):
    """ListNamespaces' and DeleteNamespace's work at 100,000 blocks runs in steps bounded in blocks
    (what bounds their event-loop time); the steps' times are printed, not asserted: wall-clock
    bounds fail on a busy machine, and the step counts are what the code controls."""
    blocks = 100_000
    engine = engine_factory(blocks + 16, 64, disk_slot_count=blocks + 16, disk_slot_bytes=64)
    ns = engine.register_namespace(SPEC).namespace_id
    _fill(engine, ns, blocks)
    times = {"usage": [], "delete": []}
    started = time.perf_counter()
    count = engine.namespace_usage(ns)  # its snapshot of the index is part of the first step
    while not count.done:
        count.step(USAGE_STEP_BLOCKS)
        times["usage"].append(time.perf_counter() - started)
        started = time.perf_counter()
    assert count.usage[0].blocks == blocks
    started = time.perf_counter()
    deletion = engine.delete_namespace(ns)
    while not deletion.done:
        deletion.step(DELETE_STEP_BLOCKS)
        times["delete"].append(time.perf_counter() - started)
        started = time.perf_counter()
    assert (deletion.deleted, len(times["usage"]), len(times["delete"])) == (blocks, 2, -(-blocks // DELETE_STEP_BLOCKS))
    with capsys.disabled():
        print(f"\n100,000 blocks: usage steps max {max(times['usage']) * 1e3:.1f} ms, "
              f"deletion steps max {max(times['delete']) * 1e3:.1f} ms")
