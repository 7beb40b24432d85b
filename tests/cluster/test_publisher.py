"""The publisher against a real engine: every sealed block reaches its segment's owner, removals follow."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.cluster.directory import DirectoryShard
from kvd.cluster.keys import mask_keys, namespace_mask, rendezvous_ids
from kvd.cluster.placement import Rendezvous, packed_segment_starts
from kvd.cluster.publisher import Publisher
from kvd.core.block import BlockState
from kvd.core.engine import Engine
from kvd.core.events import EventLog
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.requests import CommitRequest, KeysRequest

SPEC = NamespaceSpec(model_id="publisher-test", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
SEGMENT = 4
ME = "me"


def put(engine: Engine, namespace_id: bytes, tokens: list[int]) -> None:
    keys = chain_keys(SPEC, tokens)
    present = len(engine.lookup(namespace_id, keys))
    if present == len(keys):
        return
    parent = keys[present - 1] if present else b""
    result = engine.reserve(KeysRequest(namespace_id, "w", keys[present:], 10_000, 0, parent_key=parent))
    if result.lease is not None:
        engine.commit(CommitRequest(namespace_id, "w", result.lease.lease_id, 0))


def expected_replicas(owners: Rendezvous, namespace_id: bytes, block, replicas: int) -> tuple[bytes, set[str]]:
    """A sealed block's directory key, and the nodes its segment's entries live on."""
    chain = []
    while block is not None:
        chain.append(block.key)
        block = block.parent
    chain.reverse()
    masked = mask_keys(b"".join(chain), namespace_mask(namespace_id))
    anchor_at = [s for s in packed_segment_starts(masked, SEGMENT) if s < len(chain)][-1]
    anchor = masked[anchor_at * 32:anchor_at * 32 + 32]
    picked = owners.replica_indices(rendezvous_ids(anchor), replicas)[0]
    assert owners.members[picked[0]] == owners.owner(anchor)
    return masked[-32:], {owners.members[i] for i in picked}


class Owners:
    """The shards of every member, fed with what the publisher hands out."""

    def __init__(self) -> None:
        self.shards: dict[str, DirectoryShard] = {}

    def deliver(self, publisher: Publisher) -> None:
        for owner, (stored, removed) in publisher.take().items():
            shard = self.shards.setdefault(owner, DirectoryShard())
            shard.remove(ME, removed)
            shard.add(ME, stored)


def check_directory(engine: Engine, namespace_id: bytes, owners: Rendezvous, shards: Owners, gone: set[bytes],
                    replicas: int = 1):
    state = engine.namespace(namespace_id)
    for block in state.index:
        if block.state != BlockState.SEALED:
            continue
        key, listed_at = expected_replicas(owners, namespace_id, block, replicas)
        for name, shard in shards.shards.items():
            listed = shard.query([key]) == [(ME,)]
            assert listed == (name in listed_at), f"{name}: a sealed block is listed at its replicas, and only there"
        gone.discard(key)
    for key in gone:
        for shard in shards.shards.values():
            assert ME not in (shard.query([key]) or [()])[0], "a removed block is listed nowhere it was sent"


# (operation, seed, whether the publisher reads and sends after it: several changes can meet in one batch)
ops = st.lists(st.tuples(st.sampled_from(["put", "put", "put", "delete", "members"]), st.integers(0, 10_000),
                         st.booleans()), min_size=1, max_size=40)


@settings(max_examples=80, deadline=None)
@given(ops, st.sampled_from([8, 1 << 16]), st.sampled_from([1, 2, 3]))
def test_published_directory_matches_the_index(operations, ring_keys, replicas):
    engine = Engine(host_slot_count=4096, host_slot_bytes=64, events=EventLog(ring_events=8, ring_keys=ring_keys))
    namespace_id = engine.register_namespace(SPEC).namespace_id
    publisher = Publisher(engine, SEGMENT, replicas)
    members = [ME, "n1", "n2"]
    publisher.set_members(members, fresh=members)
    shards = Owners()
    removed: set[bytes] = set()
    for op, seed, send in operations:
        rng = random.Random(seed)
        if op == "put":
            base = [rng.randrange(3) for _ in range(rng.randrange(1, 6))]
            put(engine, namespace_id, base + [rng.randrange(50) for _ in range(rng.randrange(0, 30))])
        elif op == "delete":
            blocks = [b for b in engine.namespace(namespace_id).index if b.state == BlockState.SEALED]
            if blocks:
                victim = rng.choice(blocks)
                dead = [b for b in blocks if _descends(b, victim)]
                removed.update(mask_keys(b.key, namespace_mask(namespace_id)) for b in dead)
                engine.delete(namespace_id, [victim.key])
        else:
            members = [ME] + rng.sample(["n1", "n2", "n3", "n4"], rng.randrange(1, 4))
            # A leaver's shard goes with it; a node that joins (again) starts empty.
            shards.shards = {name: shard for name, shard in shards.shards.items() if name in members}
            fresh = [m for m in members if m not in shards.shards]
            for name in fresh:
                shards.shards[name] = DirectoryShard()
            publisher.set_members(members, fresh)
        if send:
            publisher.poll()
            shards.deliver(publisher)
    publisher.poll()
    shards.deliver(publisher)
    check_directory(engine, namespace_id, Rendezvous(members), shards, removed, replicas)


def _descends(block, ancestor) -> bool:
    while block is not None:
        if block is ancestor:
            return True
        block = block.parent
    return False


def test_an_overflowed_event_ring_resynchronises_from_the_index():
    engine = Engine(host_slot_count=1024, host_slot_bytes=64, events=EventLog(ring_events=2, ring_keys=4))
    namespace_id = engine.register_namespace(SPEC).namespace_id
    publisher = Publisher(engine, SEGMENT)
    publisher.set_members([ME, "n1"], fresh=[ME, "n1"])
    shards = Owners()
    publisher.poll()
    shards.deliver(publisher)
    resyncs = publisher.resyncs
    for i in range(20):
        put(engine, namespace_id, [i % 3, i])
    publisher.poll()
    shards.deliver(publisher)
    assert publisher.resyncs > resyncs
    assert publisher.held_keys == sum(1 for b in engine.namespace(namespace_id).index if b.state == BlockState.SEALED)
    check_directory(engine, namespace_id, Rendezvous([ME, "n1"]), shards, set())
