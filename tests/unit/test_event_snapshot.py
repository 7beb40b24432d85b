"""EventSnapshot built in steps (kvd.core.event_snapshot): exact whatever changes between the steps.

First over a bare prefix index and event log, where each interleaving is
made by hand (a block removed while the walk holds it, a parent sealed or
moved behind the walk, a key stored again under another parent), then
seeded random changes between every two steps; then over the engine with a
disk tier; then the daemon's handler, which must yield to the event loop
between steps. A snapshot is checked the way a router uses it: equal to
what is served when its last step ends, parents before children, and a
BlockMirror built from it plus every later event equal to what is served
at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import types

import pytest

from kvd.client.events import BlockMirror, EventSnapshot
from kvd.core.block import Block, BlockState
from kvd.core.engine import Engine, TierId
from kvd.core.event_snapshot import SnapshotBuild
from kvd.core.events import EventLog
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.radix import PrefixIndex
from kvd.core.requests import CommitRequest, KeysRequest
from kvd.errors import ResourceExhausted
from kvd.invariants import InvariantError
from kvd.testing import core_ops

HOST, DISK = int(TierId.HOST), int(TierId.DISK)
NS = b"N" * 32


def key(number: int) -> bytes:
    return number.to_bytes(32, "big")


class Namespace:
    """A prefix index whose changes are announced as the engine announces them."""

    def __init__(self) -> None:
        self.index = PrefixIndex("snapshot-test", 64, NS)
        self.events = EventLog(ring_events=1 << 20, ring_keys=1 << 22)
        self.tier: dict[bytes, int] = {}

    def tier_bytes(self, blocks) -> bytes:
        return bytes(self.tier[block.key] for block in blocks)

    def build(self, step_blocks: int) -> SnapshotBuild:
        return SnapshotBuild(self.index, self.events, self.tier_bytes, step_blocks)

    def insert(self, number: int, parent: int | None = None) -> Block:
        """A writable block (announced when sealed)."""
        return self.index.insert(key(number), None if parent is None else self.index.get(key(parent)))

    def seal(self, number: int) -> None:
        block = self.index.get(key(number))
        block.state = BlockState.SEALED
        self.tier[block.key] = HOST
        self.events.stored(NS, [block.key], b"" if block.parent is None else block.parent.key, HOST)

    def store(self, number: int, parent: int | None = None) -> None:
        self.insert(number, parent)
        self.seal(number)

    def remove(self, number: int) -> None:
        block = self.index.get(key(number))
        if block.state == BlockState.SEALED:
            self.events.removed(NS, block.key)
        self.index.remove(block)
        self.tier.pop(block.key, None)

    def move(self, number: int, tier: int) -> None:
        self.tier[key(number)] = tier
        self.events.tier_changed(NS, key(number), tier)

    def served(self) -> tuple[dict[bytes, int], dict[bytes, bytes]]:
        blocks = [block for block in self.index if block.state == BlockState.SEALED]
        return ({block.key: self.tier[block.key] for block in blocks},
                {block.key: b"" if block.parent is None else block.parent.key for block in blocks})


def finish(build: SnapshotBuild) -> EventSnapshot:
    while not build.step():
        pass
    return collect(build, part_blocks=3)


def collect(build: SnapshotBuild, part_blocks: int) -> EventSnapshot:
    keys, parent_keys, tiers = [], [], []
    for part in build.parts(part_blocks):
        assert len(part.keys) == len(part.parent_keys) == len(part.tiers) <= part_blocks
        keys += part.keys
        parent_keys += part.parent_keys
        tiers.append(part.tiers)
    build.verify()
    assert len(keys) == build.block_count
    return EventSnapshot("", build.sequence, keys, parent_keys, b"".join(tiers))


def served_at(events: EventLog, namespace_id: bytes, sequence: int) -> tuple[dict[bytes, int], dict[bytes, bytes]]:
    """What was served right after event `sequence`: the events up to it, applied to nothing."""
    mirror = BlockMirror(EventSnapshot("", 0, [], [], b""))
    for event in events.read(namespace_id, 1, sequence) if sequence else ():
        mirror.apply(event)
    assert mirror.sequence == sequence
    return mirror.tiers, mirror.parents


def assert_exact(snapshot: EventSnapshot, served: tuple[dict[bytes, int], dict[bytes, bytes]]) -> None:
    """The snapshot lists exactly what is served, each key once, parents first."""
    assert len(set(snapshot.keys)) == len(snapshot.keys), "a key listed twice"
    assert dict(zip(snapshot.keys, snapshot.tiers)) == served[0]
    assert dict(zip(snapshot.keys, snapshot.parent_keys)) == served[1]
    listed: set[bytes] = set()
    for child, parent in zip(snapshot.keys, snapshot.parent_keys):
        assert not parent or parent in listed, "a child listed before its parent"
        listed.add(child)


# ----------------------------------------------------------------------
# Hand-made interleavings over a bare index


def test_a_quiet_namespace_is_listed_whole_in_steps_of_bounded_size():
    space = Namespace()
    for number in range(10):
        space.store(number, None if number % 4 == 0 else number - 1)
    space.insert(100, 9)  # writable: not served, not listed
    build = space.build(step_blocks=3)
    assert core_ops.tracker_count(space.events) == 1
    steps = 1
    while not build.step():
        steps += 1
    # 11 blocks in the tree, 3 per step, then the catch-up's step.
    assert steps >= 11 // 3 + 1
    assert core_ops.tracker_count(space.events) == 0
    snapshot = collect(build, part_blocks=4)
    assert snapshot.sequence == space.events.last_sequence(NS) > 0
    assert_exact(snapshot, space.served())


def test_an_empty_namespace_is_one_empty_part():
    space = Namespace()
    build = space.build(step_blocks=5)
    assert build.step() is True
    assert [(part.keys, part.tiers) for part in build.parts(5)] == [([], b"")]
    assert (build.sequence, build.block_count) == (0, 0)


def test_a_block_removed_while_the_walk_holds_it_does_not_lose_its_siblings():
    space = Namespace()
    for number in range(1, 7):
        space.store(number)  # six roots: the newest first
    build = space.build(step_blocks=2)
    build.step()  # roots 6 and 5 listed; the walk holds root 4 next
    space.remove(4)
    space.remove(3)
    space.store(7)  # joins at the head of the roots, behind the walk
    snapshot = finish(build)
    assert_exact(snapshot, space.served())
    assert set(snapshot.keys) == {key(number) for number in (1, 2, 5, 6, 7)}


def test_changes_behind_and_ahead_of_the_walk_are_as_of_its_sequence():
    space = Namespace()
    space.store(1)
    for number in range(2, 9):
        space.store(number, number - 1)  # a chain 1..8
    space.store(20, 1)
    space.insert(30, 2)  # writable when the walk passes
    build = space.build(step_blocks=2)
    build.step()
    build.step()
    space.move(1, DISK)  # behind the walk
    space.move(8, DISK)  # ahead of it
    space.seal(30)  # its parent was walked, it was not served then
    space.store(31, 30)
    space.remove(20)
    space.store(20, 8)  # the same key again, under another parent
    snapshot = finish(build)
    assert_exact(snapshot, space.served())
    mirror = BlockMirror(snapshot)
    space.remove(31)
    space.move(1, HOST)
    for event in space.events.read(NS, snapshot.sequence + 1, 100):
        mirror.apply(event)
    assert (mirror.tiers, mirror.parents) == space.served()


def test_a_parent_sealed_after_the_walk_passed_it_comes_before_its_children():
    space = Namespace()
    space.store(1)
    space.insert(2, 1)
    space.insert(3, 2)
    for number in range(10, 20):
        space.store(number)  # roots the walk lists first (newest first)
    build = space.build(step_blocks=1)
    for _ in range(12):
        assert not build.step()  # roots 19..10, then 1 listed, 2 (writable) passed
    space.seal(2)
    space.seal(3)
    snapshot = finish(build)
    assert_exact(snapshot, space.served())
    assert snapshot.keys[-2:] == [key(2), key(3)]


def test_a_chain_stored_again_under_another_root_keeps_parents_first():
    space = Namespace()
    space.store(2)  # root B
    space.store(1)  # root A, at the head: walked first
    space.store(10, 1)  # P under A
    space.store(11, 10)  # K under P
    build = space.build(step_blocks=1)
    for _ in range(3):
        assert not build.step()  # A, P, K listed; B next
    space.remove(11)
    space.remove(10)
    space.store(10, 2)  # P again, under B, which the walk has not reached
    space.store(11, 10)  # K again, under the new P: the same parent key as listed
    snapshot = finish(build)
    assert_exact(snapshot, space.served())
    assert snapshot.keys == [key(1), key(2), key(10), key(11)]


def test_a_namespace_changing_faster_than_the_catch_up_still_ends():
    space = Namespace()
    for number in range(20):
        space.store(number)
    build = space.build(step_blocks=1)
    steps, fresh = 0, 1000
    while not build.step():
        steps += 1
        for _ in range(3):
            space.store(fresh)
            fresh += 1
    # The walk (20 roots, 60 keys noted meanwhile), one round of 60 look-ups
    # (180 noted meanwhile: more, so no second round), the last look-ups;
    # then over frozen data a step per record (20) and per key added last (240).
    assert steps == 20 + 60 + 20 + 240
    snapshot = collect(build, part_blocks=7)
    assert_exact(snapshot, served_at(space.events, NS, snapshot.sequence))
    assert build.block_count == 20 + 240


def test_closing_an_unfinished_build_stops_tracking():
    space = Namespace()
    for number in range(10):
        space.store(number)
    build = space.build(step_blocks=2)
    build.step()
    build.close()
    build.close()
    assert core_ops.tracker_count(space.events) == 0
    build.verify()
    with pytest.raises(InvariantError):
        next(build.parts(4))


def random_step(space: Namespace, rng: random.Random) -> None:
    blocks = list(space.index)
    action = rng.choice(["store", "store", "insert", "seal", "remove", "move"])
    if action in ("store", "insert"):
        number = rng.randrange(60)
        if space.index.get(key(number)) is not None:
            return
        parents = [block for block in blocks if block.state == BlockState.SEALED]
        parent = rng.choice(parents) if parents and rng.random() < 0.8 else None
        parent_number = None if parent is None else int.from_bytes(parent.key, "big")
        (space.store if action == "store" else space.insert)(number, parent_number)
    elif action == "seal":
        ready = [block for block in blocks if block.state == BlockState.WRITABLE
                 and (block.parent is None or block.parent.state == BlockState.SEALED)]
        if ready:
            space.seal(int.from_bytes(rng.choice(ready).key, "big"))
    elif action == "remove":
        leaves = [block for block in blocks if block.first_child is None]
        if leaves:
            space.remove(int.from_bytes(rng.choice(leaves).key, "big"))
    else:
        sealed = [block for block in blocks if block.state == BlockState.SEALED]
        if sealed:
            space.move(int.from_bytes(rng.choice(sealed).key, "big"), rng.choice([HOST, DISK]))


@pytest.mark.parametrize("seed", range(40))
def test_random_changes_between_every_two_steps(seed):
    rng = random.Random(seed)
    space = Namespace()
    for _ in range(80):
        random_step(space, rng)
    builds: list[SnapshotBuild] = []
    done: list[EventSnapshot] = []
    for _ in range(300):
        if len(builds) < 3 and rng.random() < 0.1:
            builds.append(space.build(step_blocks=rng.randint(1, 4)))
        for _ in range(rng.randint(0, 3)):
            random_step(space, rng)
        for build in list(builds):
            build.verify()
            if build.step():
                snapshot = collect(build, part_blocks=rng.randint(1, 5))
                # Its last steps only assemble what it has: changes since are not in it.
                assert_exact(snapshot, served_at(space.events, NS, snapshot.sequence))
                done.append(snapshot)
                builds.remove(build)
        space.index.verify()
        space.events.verify()
    for build in builds:
        build.close()
    assert done and core_ops.tracker_count(space.events) == 0
    # Each one, with the events after it, is what is served now.
    for snapshot in done:
        mirror = BlockMirror(snapshot)
        for event in space.events.read(NS, snapshot.sequence + 1, 1 << 20):
            mirror.apply(event)
        assert (mirror.tiers, mirror.parents) == space.served()


# ----------------------------------------------------------------------
# The engine, with a disk tier: evictions, demotions, promotions, losses

SPEC = NamespaceSpec(model_id="snapshot-test", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
LONG = 10_000


def K(chain: str) -> list[bytes]:
    return chain_keys(SPEC, [ord(ch) for ch in chain])


class EngineSide:
    def __init__(self) -> None:
        self.engine = Engine(host_slot_count=6, host_slot_bytes=64, disk_slot_count=10, disk_slot_bytes=64,
                             events=EventLog(ring_events=1 << 20, ring_keys=1 << 22))
        self.ns = self.engine.register_namespace(SPEC).namespace_id
        self.engine.enable_disk(self.ns)
        self.corrupt: set[int] = set()

    def act(self, rng: random.Random, chain: str) -> None:
        engine, ns = self.engine, self.ns
        action = rng.choice(["put", "put", "flush", "get", "get", "delete", "corrupt"])
        if action == "put":
            with contextlib.suppress(ResourceExhausted):
                result = engine.reserve(KeysRequest(ns, "w", K(chain), LONG, 0))
                if result.lease is not None:
                    engine.commit(CommitRequest(ns, "w", result.lease.lease_id, 0))
        elif action == "flush":
            writes = engine.pick_writes(100)
            self.journal()
            engine.finish_writes(writes, [True] * len(writes))
            self.journal()
        elif action == "get":
            plan = engine.begin_get(KeysRequest(ns, "r", K(chain), LONG, 0))
            engine.finish_loads(plan.loads, [load.source_slot not in self.corrupt for load in plan.loads])
            self.journal()
            engine.settle_get(plan)
            if plan.lease is not None:
                engine.release("r", [plan.lease.lease_id])
        elif action == "delete":
            engine.delete(ns, [K(chain)[rng.randrange(len(chain))]])
        else:
            durable = [engine.disk_slot(block) for block in engine.namespace(ns).index
                       if engine.disk_slot(block) >= 0]
            if durable:
                self.corrupt.add(rng.choice(durable))

    def journal(self) -> None:
        removals = self.engine.take_disk_removals()
        self.engine.disk_removals_journalled([slot for _, _, slot in removals])

    def served(self) -> tuple[dict[bytes, int], dict[bytes, bytes]]:
        blocks = [block for block in self.engine.namespace(self.ns).index if block.state == BlockState.SEALED]
        return ({block.key: int(self.engine.tier_of(block)) for block in blocks},
                {block.key: b"" if block.parent is None else block.parent.key for block in blocks})


@pytest.mark.parametrize("seed", range(8))
def test_engine_snapshots_stay_exact_while_blocks_move_between_tiers(seed):
    rng = random.Random(seed)
    side = EngineSide()
    chains = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(16)]
    build = None
    snapshots = []
    for _ in range(500):
        side.act(rng, rng.choice(chains))
        side.engine.verify()
        if build is None:
            build = side.engine.event_snapshot(side.ns, step_blocks=rng.randint(1, 3))
        elif build.step():
            snapshot = collect(build, part_blocks=4)
            build.close()
            assert_exact(snapshot, served_at(side.engine.events, side.ns, snapshot.sequence))
            snapshots.append(snapshot)
            build = None
    assert len(snapshots) >= 5
    events = side.engine.events
    assert events.published_events[3] > 0 and events.published_events[2] > 0  # TIER_CHANGED, REMOVED
    for snapshot in snapshots:
        mirror = BlockMirror(snapshot)
        for event in events.read(side.ns, snapshot.sequence + 1, 1 << 20):
            mirror.apply(event)
        assert (mirror.tiers, mirror.parents) == side.served()


# ----------------------------------------------------------------------
# The daemon's handler: the loop turns between the steps


def test_the_handler_yields_to_the_loop_between_steps_and_sends_bounded_parts(monkeypatch):
    # Issue 35 item 7: the handler listed the whole namespace in one loop step.
    from kvd.server import service as service_module
    from kvd.server.handlers import events as event_handlers
    from kvd.v1 import kvd_pb2

    monkeypatch.setattr(event_handlers, "SNAPSHOT_STEP_BLOCKS", 8)
    monkeypatch.setattr(event_handlers, "SNAPSHOT_PART_BLOCKS", 16)
    side = EngineSide()
    side.engine = Engine(host_slot_count=256, host_slot_bytes=64)
    side.ns = side.engine.register_namespace(SPEC).namespace_id
    for first in "abcdefgh":
        result = side.engine.reserve(KeysRequest(side.ns, "w", K(first * 12), LONG, 0))
        side.engine.commit(CommitRequest(side.ns, "w", result.lease.lease_id, 0))
    handler = service_module.KvdService.EventSnapshot.__wrapped__
    service = types.SimpleNamespace(engine=side.engine, arena=types.SimpleNamespace(instance_id="test"))
    request = kvd_pb2.EventSnapshotRequest(namespace_id=side.ns)

    async def run() -> tuple[int, list]:
        turns_before_first = 0
        messages = []
        stream = handler(service, request, None)
        consumer = asyncio.ensure_future(_drain(stream, messages))
        while not consumer.done():
            if not messages:
                turns_before_first += 1
                if turns_before_first == 3:
                    # A change while the build runs: a new chain, one deleted.
                    result = side.engine.reserve(KeysRequest(side.ns, "w", K("zz"), LONG, 0))
                    side.engine.commit(CommitRequest(side.ns, "w", result.lease.lease_id, 0))
                    side.engine.delete(side.ns, [K("a")[0]])
            await asyncio.sleep(0)
        return turns_before_first, messages

    turns, messages = asyncio.run(run())
    assert turns >= 96 // 8
    assert all(len(message.keys) <= 16 for message in messages)
    assert len({message.sequence for message in messages}) == 1
    snapshot = EventSnapshot("test", messages[0].sequence, [k for m in messages for k in m.keys],
                             [k for m in messages for k in m.parent_keys], b"".join(m.tiers for m in messages))
    assert messages[0].block_count == len(snapshot.keys) == 96 - 12 + 2
    assert snapshot.sequence == side.engine.events.last_sequence(side.ns)
    assert_exact(snapshot, side.served())
    assert core_ops.tracker_count(side.engine.events) == 0


async def _drain(stream, messages: list) -> None:
    async for message in stream:
        messages.append(message)
