"""The engine with a host and a disk tier, against a naive model of where each block is.

tests/property/test_engine_state_machine.py checks the API (statuses,
errors, leases) on a host-only engine. This machine checks the tiers: for
every block the model keeps whether it is sealed or a tombstone, whether a
host slot and a disk slot hold it, and how many handles pin it. After every
step the engine's index, tiers and reference counts must equal the model.

What the model predicts exactly, for any policy:
- lookup and get: the stored prefix of a chain, and the tier of each block;
- get: which blocks are loaded from disk (the prefix's blocks without a
  host copy, in chain order), what a failed load loses (the block and
  everything chained under it; pinned ones stay as tombstones until their
  last handle goes), and what is served;
- write-back: which blocks pick_writes picks (every block sealed since the
  last flush, in seal order, that still has a host copy, no disk copy, and
  a parent on disk or in the same batch), and which become durable;
- delete, and a whole namespace's deletion in steps: what goes, and what a
  pin keeps;
- each tier's copies of the namespace's blocks, as ListNamespaces counts them.

Which block a full host tier gives up is the policy's choice. The model
learns it from the engine after each reserve and get and checks it was
allowed: only sealed, unpinned blocks with no host child left; a block with
a disk copy is demoted (it stays, on disk), one without is dropped with
everything under it; exactly as many as the free slots fell short; and a
request falls short only when nothing could be freed.

The disk tier is larger than every block the rules can make, so it never
evicts: what is on disk is exact.

Each machine also runs with a third tier between host memory and the disk
(`TierMachine3_*`): a volatile memory tier, test-only, added through the
engine's `lower_tiers` and nothing else. It is written back on its own
(flush_middle), its copies are loaded in preference to the disk's, and a
host copy is demoted when either copy below exists. It is larger than every
block too, so the model stays exact with three tiers.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvd.core.block import NO_SLOT, BlockHandle, BlockState
from kvd.core.engine import Engine, ReserveStatus, StorageSpec, TierId
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.errors import ResourceExhausted
from kvd.sim.plane import SlotContents
from kvd.sim.report import policy_names
from kvd.testing import engine_ops
from kvd.core.requests import CommitRequest, KeysRequest

HOST_SLOTS = 4
DISK_SLOTS = 64  # more than the 30 chains of `paths`: the disk never evicts
MIDDLE_SLOTS = 48  # as large: the middle tier never evicts either
# The test-only middle tier borrows the id of the remote tier (the wire's
# Tier enum has no other volatile tier below host memory).
MIDDLE = StorageSpec(TierId.REMOTE, MIDDLE_SLOTS, 64, name="middle")
SPEC = NamespaceSpec(model_id="tiers", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
LONG = 10_000

paths = st.lists(st.integers(0, 1), min_size=1, max_size=4).map(tuple)
# Which operations of a batch fail (bit i: the i-th load or write).
failures = st.one_of(st.just(0), st.just(0), st.integers(0, 15))


def chain(path: tuple[int, ...]) -> list[bytes]:
    return chain_keys(SPEC, path)


@dataclass(eq=False)
class MBlock:
    key: bytes
    parent: MBlock | None
    lost: bool = False
    host: bool = True
    disk: bool = False
    middle: bool = False

    @property
    def below(self) -> bool:
        """Has a copy below host memory."""
        return self.disk or self.middle

    def tier(self) -> TierId:
        return TierId.HOST if self.host else TierId.REMOTE if self.middle else TierId.DISK


class TierMachine(RuleBasedStateMachine):
    policy = "lru"
    three_tiers = False

    def __init__(self) -> None:
        super().__init__()
        self.engine = Engine(
            host_slot_count=HOST_SLOTS, host_slot_bytes=64, policy=self.policy,
            disk_slot_count=DISK_SLOTS, disk_slot_bytes=64, lower_tiers=[MIDDLE] if self.three_tiers else [],
        )
        self.middle = self.engine.lower_tiers[0] if self.three_tiers else None
        self.ns = self.engine.register_namespace(SPEC).namespace_id
        self.engine.enable_disk(self.ns)
        self.index = self.engine.namespace(self.ns).index
        self.contents = SlotContents(self.engine)
        self.blocks: dict[bytes, MBlock] = {}
        # Sealed since the last flush, in seal order: the engine's write
        # queues, per tier below host memory ("disk", "middle").
        self.pending: dict[str, list[MBlock]] = {"disk": [], "middle": []}
        self.held: list[BlockHandle] = []
        # The chain of every key ever made, to aim requests at stored blocks.
        self.paths: dict[bytes, tuple[int, ...]] = {}

    # ------------------------------------------------------------------
    # Model helpers

    def refs(self) -> dict[bytes, int]:
        counts: dict[bytes, int] = {}
        for handle in self.held:
            counts[handle.key] = counts.get(handle.key, 0) + 1
        return counts

    def match(self, keys: list[bytes]) -> list[MBlock]:
        matched: list[MBlock] = []
        for key in keys:
            block = self.blocks.get(key)
            if block is None or block.lost or block.parent is not (matched[-1] if matched else None):
                break
            matched.append(block)
        return matched

    def subtree(self, root: MBlock) -> list[MBlock]:
        found = [root]
        for member in found:
            found.extend(block for block in self.blocks.values() if block.parent is member)
        return found

    def children(self, parent: MBlock) -> list[MBlock]:
        return [block for block in self.blocks.values() if block.parent is parent]

    def host_count(self) -> int:
        return sum(block.host for block in self.blocks.values())

    def bury(self) -> None:
        """Tombstones go once nothing pins them and nothing hangs under them."""
        refs = self.refs()
        while True:
            gone = [b for b in self.blocks.values() if b.lost and not refs.get(b.key) and not self.children(b)]
            if not gone:
                return
            for block in gone:
                del self.blocks[block.key]

    def lose(self, root: MBlock) -> None:
        """A failed load: the block and everything under it are never served again."""
        for block in self.subtree(root):
            block.lost, block.host, block.disk, block.middle = True, False, False, False
        self.bury()

    def journal(self) -> None:
        self.contents.journal_removals()

    def learn_host_departures(self, before: set[bytes], allocated: int, free_before: int, pinned: set[bytes]) -> None:
        """Blocks a full host tier gave up during one call: learn them and check each was allowed."""
        departed = []
        for key in before:
            block = self.blocks[key]
            engine_block = self.index.get(key)
            if engine_block is None or self.engine.host_slot(engine_block) == NO_SLOT:
                departed.append(block)
        refs = self.refs()
        for block in departed:
            assert not block.lost and not refs.get(block.key) and block.key not in pinned, "a pinned block was evicted"
            if block.below:
                event("host: demoted")
                assert self.index.get(block.key) is not None, "a block with a copy below was dropped"
            else:
                event("host: dropped")
                assert self.index.get(block.key) is None, "a block without a copy below lost its host slot only"
            block.host = False
        for block in departed:
            if not block.below:
                # Dropped: nothing can have stayed under it.
                assert all(child in departed and not child.below for child in self.children(block))
        for block in departed:
            assert not any(child.host for child in self.children(block)), "evicted while a host child stayed"
            if not block.below:
                del self.blocks[block.key]
        assert len(departed) == max(0, allocated - free_before), "evicted more (or fewer) blocks than needed"

    def check_nothing_evictable(self, allowed: set[bytes]) -> None:
        """A request fell short: no free slot, and no candidate but blocks it pinned itself."""
        assert not self.engine.host.pool.free_slots
        assert {block.key for block in self.engine.host.policy.order()} <= allowed

    # ------------------------------------------------------------------
    # Rules

    def stored_path(self, data) -> tuple[int, ...]:
        """A chain through stored blocks (extended a little), or any chain."""
        stored = sorted(self.paths[key] for key in self.blocks)
        if not stored or data.draw(st.booleans()):
            return data.draw(paths)
        return (data.draw(st.sampled_from(stored)) + data.draw(paths))[:4]

    @rule(path=paths)
    def put(self, path):
        keys = chain(path)
        self.paths.update((key, path[: position + 1]) for position, key in enumerate(keys))
        matched = self.match(keys)
        parent = matched[-1] if matched else None
        if len(matched) < len(keys) and keys[len(matched)] in self.blocks:
            # A tombstone a reader still pins: nothing to write from there yet.
            event("put: tombstone in the way")
            result = self.engine.reserve(KeysRequest(self.ns, "writer", keys, LONG, 0))
            in_flight = [ReserveStatus.IN_FLIGHT] * (len(keys) - len(matched))
            assert result.lease is None and result.statuses == [ReserveStatus.EXISTS] * len(matched) + in_flight
            return
        before = {key for key, block in self.blocks.items() if block.host}
        free_before = len(self.engine.host.pool.free_slots)
        try:
            result = self.engine.reserve(KeysRequest(self.ns, "writer", keys, LONG, 0))
        except ResourceExhausted:
            event("put: host full")
            self.check_nothing_evictable({parent.key} if parent else set())
            return
        reserved = result.statuses.count(ReserveStatus.RESERVED)
        expected = [ReserveStatus.EXISTS] * len(matched) + [ReserveStatus.RESERVED] * reserved
        expected += [ReserveStatus.NO_SPACE] * (len(keys) - len(expected))
        assert result.statuses == expected
        if len(matched) == len(keys):
            assert result.lease is None
            return
        assert reserved > 0
        self.learn_host_departures(before, reserved, free_before, {parent.key} if parent else set())
        if reserved < len(keys) - len(matched):
            # Checked before the commit: the lease still pins what it holds.
            event("put: NO_SPACE")
            self.check_nothing_evictable(set())
        self.contents.fill(keys, result.slots)
        assert self.engine.commit(CommitRequest(self.ns, "writer", result.lease.lease_id, 0))[:2] == (reserved, 0)
        for key in keys[len(matched) : len(matched) + reserved]:
            parent = self.blocks[key] = MBlock(key, parent)
            for pending in self.pending.values():
                pending.append(parent)

    @rule(data=st.data(), fail=failures)
    def get(self, data, fail):
        keys = chain(self.stored_path(data))
        expected = self.match(keys)
        before = {key for key, block in self.blocks.items() if block.host}
        free_before = len(self.engine.host.pool.free_slots)
        plan = self.engine.begin_get(KeysRequest(self.ns, "reader", keys, LONG, 0))
        matched = [block.key for block in plan.matched]
        assert matched == [block.key for block in expected][: len(matched)]
        assert not plan.waits
        if plan.starved:
            # Nothing could go but blocks this Get let go of when it was cut,
            # or (if the engine keeps those for write-back) unwritten ones.
            event("get: starved")
            assert not self.engine.host.pool.free_slots
            released = {block.key for block in expected[len(matched):]}
            candidates = {block.key for block in self.engine.host.policy.order()}
            assert candidates <= released or any(not self.blocks[key].below for key in candidates - released)
        else:
            assert len(matched) == len(expected)
        loads = [load.block.key for load in plan.loads]
        assert loads == [block.key for block in expected[: len(matched)] if not block.host], "wrong blocks loaded"
        # Each from its fastest copy below.
        assert [load.source.tier_id for load in plan.loads] == [self.blocks[key].tier() for key in loads]
        if any(load.source is self.middle for load in plan.loads):
            event("get: loaded from the middle tier")
        event(f"get: {len(matched)} blocks, {len(loads)} loaded")
        # Everything matched was pinned while slots were found, the cut tail too.
        self.learn_host_departures(before, len(loads), free_before, {block.key for block in expected})
        loading = [self.blocks[key] for key in loads]
        ok = [not fail >> position & 1 for position in range(len(loads))]
        corrupt = {(load.source.name, load.source_slot) for load, good in zip(plan.loads, ok) if not good}
        self.engine.finish_loads(plan.loads, self.contents.load(plan.loads, corrupt))
        served = self.engine.settle_get(plan)
        self.contents.check_served(served)
        for block, good in zip(loading, ok):
            if block.lost:
                continue  # an ancestor's failure took it already
            if good:
                block.host = True
            else:
                # What the Get still pins stays a tombstone until it releases;
                # the model buries by its own pins only, and agrees at the end.
                event("get: load failed")
                self.lose(block)
        serving = [block.key for block in expected[: len(matched)]]
        lost_at = next((i for i, key in enumerate(serving) if self.blocks.get(key) is None or self.blocks[key].lost),
                       len(serving))
        assert [block.key for block in served] == serving[:lost_at]
        if plan.lease is not None:
            self.engine.release("reader", [plan.lease.lease_id])
        self.bury()
        self.journal()

    @rule(fail=failures)
    def flush(self, fail):
        """One write-back round to disk, large enough to drain its write queue."""
        self.write_back("disk", self.engine.disk, fail)

    @rule(fail=failures)
    def flush_middle(self, fail):
        """One write-back round to the middle tier (three tiers only)."""
        if self.middle is not None:
            self.write_back("middle", self.middle, fail)

    def write_back(self, tier: str, engine_tier, fail: int) -> None:
        picked: list[MBlock] = []
        for block in self.pending[tier]:
            if self.blocks.get(block.key) is not block or block.lost or getattr(block, tier) or not block.host:
                continue
            if block in picked:
                continue
            if block.parent is not None and not getattr(block.parent, tier) and block.parent not in picked:
                continue  # skipped for good: its prefix has no copy there
            picked.append(block)
        self.pending[tier] = []
        writes = self.engine.pick_writes(DISK_SLOTS, engine_tier)
        assert [write.block.key for write in writes] == [block.key for block in picked]
        assert all(write.target is engine_tier for write in writes)
        event(f"flush {tier}: picked {min(len(writes), 3)}+")
        self.journal()
        ok = [not fail >> position & 1 for position in range(len(writes))]
        failing = {write.block.key for write, good in zip(writes, ok) if not good}
        self.engine.finish_writes(writes, self.contents.write(writes, failing))
        for block, good in zip(picked, ok):
            setattr(block, tier, good and (block.parent is None or getattr(block.parent, tier)))
        self.journal()

    @rule(path=paths)
    def put_and_flush(self, path):
        """Write-through: what is put goes below at once (more hits there to load)."""
        self.put(path)
        self.flush(0)
        self.flush_middle(0)

    @rule(data=st.data())
    def lookup(self, data):
        keys = chain(self.stored_path(data))
        matched = self.engine.lookup(self.ns, keys)
        expected = self.match(keys)
        assert [block.key for block in matched] == [block.key for block in expected]
        tiers = [self.engine.tier_of(block) for block in matched]
        assert tiers == [block.tier() for block in expected]
        # What Lookup answers: the same, in one pass.
        assert self.engine.tier_bytes(matched) == bytes(int(tier) for tier in tiers)
        event(f"lookup: {len(matched)} blocks, {len(tiers) - tiers.count(TierId.HOST)} below host memory")

    @rule(path_list=st.lists(paths, min_size=1, max_size=2))
    def delete(self, path_list):
        refs = self.refs()
        deleted = pinned = 0
        for key in [chain(path)[-1] for path in path_list]:
            block = self.blocks.get(key)
            if block is None:
                continue
            subtree = self.subtree(block)
            if any(refs.get(member.key) or member.lost for member in subtree):
                pinned += 1
                continue
            for member in subtree:
                del self.blocks[member.key]
            deleted += len(subtree)
        event(f"delete: deleted={bool(deleted)} pinned={bool(pinned)}")
        assert self.engine.delete(self.ns, [chain(path)[-1] for path in path_list]) == (deleted, pinned)
        self.journal()

    @rule(step_blocks=st.integers(1, 5))
    def delete_namespace(self, step_blocks):
        """Every block goes but those pinned, lost or over one that is: Delete's rule, a step at a time."""
        refs = self.refs()
        kept = {block.key for block in self.blocks.values()
                if any(refs.get(member.key) or member.lost for member in self.subtree(block))}
        deletion = self.engine.delete_namespace(self.ns)
        while not deletion.done:
            deletion.step(step_blocks)
        event(f"delete_namespace: kept={bool(kept)}")
        assert (deletion.deleted, deletion.pinned) == (len(self.blocks) - len(kept), len(kept))
        self.blocks = {key: block for key, block in self.blocks.items() if key in kept}
        self.journal()

    @rule(data=st.data())
    def hold(self, data):
        """Pin a prefix and keep it pinned: a slow reader."""
        keys = chain(self.stored_path(data))
        handles = engine_ops.acquire(self.engine, self.ns, keys)
        assert [handle.key for handle in handles] == [block.key for block in self.match(keys)]
        self.held.extend(handles)

    @rule(pick=st.integers(0, 100))
    def release_held(self, pick):
        if self.held:
            self.held.pop(pick % len(self.held)).release()
            self.bury()
            self.journal()

    # ------------------------------------------------------------------
    # Invariants

    @invariant()
    def engine_is_consistent(self):
        self.engine.verify()

    @invariant()
    def every_block_is_where_the_model_says(self):
        nodes = self.index.nodes
        assert set(nodes) == set(self.blocks)
        refs = self.refs()
        for key, block in self.blocks.items():
            engine_block = nodes[key]
            assert engine_block.state == (BlockState.LOST if block.lost else BlockState.SEALED)
            assert (engine_block.parent and engine_block.parent.key) == (block.parent and block.parent.key)
            assert (self.engine.host_slot(engine_block) != NO_SLOT) == block.host, "host residency differs from the model"
            assert (self.engine.disk_slot(engine_block) != NO_SLOT) == block.disk, "disk residency differs from the model"
            if self.middle is not None:
                in_middle = self.engine.tiers.slot_in(engine_block, self.middle) != NO_SLOT
                assert in_middle == block.middle, "middle tier residency differs from the model"
            assert engine_block.ref_count == refs.get(key, 0)
        assert self.engine.host.pool.resident_blocks == self.host_count() <= HOST_SLOTS
        assert self.engine.disk.pool.resident_blocks == sum(block.disk for block in self.blocks.values())
        assert all(tier.counters.evictions == 0 for tier in self.engine.lower_tiers)
        if self.middle is not None:
            assert self.middle.pool.resident_blocks == sum(block.middle for block in self.blocks.values())

    @invariant()
    def each_tier_holds_what_the_model_counts(self):
        """ListNamespaces' figures: every copy in every tier, with its payload and slot bytes."""
        count = self.engine.namespace_usage(self.ns)
        while not count.done:
            count.step(3)
        copies = {TierId.HOST: self.host_count(), TierId.DISK: sum(block.disk for block in self.blocks.values())}
        if self.middle is not None:
            copies[self.middle.tier_id] = sum(block.middle for block in self.blocks.values())
        assert {usage.tier_id: (usage.blocks, usage.payload_bytes, usage.slot_bytes) for usage in count.usage} == {
            tier: (blocks, blocks * SPEC.block_bytes, blocks * 64) for tier, blocks in copies.items()}

    def teardown(self):
        for handle in self.held:
            handle.release()
        self.held.clear()
        self.engine.verify()
        assert self.engine.live_handles == 0 and not any(block.state == BlockState.LOST for block in self.index)


SETTINGS = settings(max_examples=150, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# One machine per registered policy, so a new policy is checked as it lands;
# each with two tiers and with three.
for _name in policy_names():
    for _count, _three in ((2, False), (3, True)):
        _machine = type(f"TierMachine{_count}_{_name}", (TierMachine,), {"policy": _name, "three_tiers": _three})
        _machine.TestCase.settings = SETTINGS
        globals()[f"TestTiers{_count}_{_name}"] = _machine.TestCase
