"""Random operation sequences against the engine, checked by a naive model.

The model is a plain dict per namespace of key -> (state, parent key), plus
the leases and handles the test holds. It predicts everything that does not
depend on the eviction policy exactly: statuses, errors, match results,
reference counts. Which blocks a reserve evicts is policy; the model learns
it from the engine after each reserve and checks only what must hold for any
policy: only sealed, unpinned blocks are evicted, a block never outlives its
evicted parent, a reserve falls short (NO_SPACE) only when nothing at all
could be freed, and the eviction counter agrees.

After every step: the engine's indexes equal the model, every block's ref
count equals the model's count of handles on it, every sealed block is found
by a prefix match of its chain, and engine.verify() holds. A rejected call
(KvdError) must leave the engine's state exactly as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvd.core.block import BlockHandle, BlockState
from kvd.core.engine import Engine, EngineLimits, ReserveStatus
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.lease import LeaseKind
from kvd.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvdError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvd.testing.engine_snapshot import snapshot
from kvd.testing import engine_ops
from kvd.core.requests import CommitRequest, KeysRequest

SLOTS = 6
MAX_LEASES = 4
LEASE_DEFAULT, LEASE_MAX = 300, 1000
SPECS = [
    NamespaceSpec(model_id="sm", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1),
    NamespaceSpec(model_id="sm", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1, lora_id="x"),
]
CLIENTS = ["alice", "bob"]

paths = st.lists(st.integers(0, 1), min_size=1, max_size=4).map(tuple)
namespaces = st.sampled_from([0, 1])
clients = st.sampled_from(CLIENTS)
lease_lengths = st.sampled_from([0, 50, 200, LEASE_MAX])
picks = st.integers(0, 1000)  # index into whatever list exists at the time
rarely = st.integers(0, 9).map(lambda n: n == 0)  # a bad variant of a request, 1 in 10


def keys_of(ns: int, path: tuple[int, ...]) -> list[bytes]:
    return chain_keys(SPECS[ns], path)


@dataclass
class MBlock:
    state: str  # "W" writable or "S" sealed
    parent: bytes | None


@dataclass
class MLease:
    lease_id: int
    kind: LeaseKind
    client: str
    ns: int
    deadline: int
    # [key, state] in chain order; state "W", "S", or "X" (aborted). Read
    # leases hold sealed keys only.
    handles: list[list] = field(default_factory=list)
    parent: bytes | None = None


def expected_walk(model: dict, keys: list[bytes], parent: bytes | None) -> tuple[list, bytes | None] | None:
    """What the model says a reserve's walk from `parent` finds: EXISTS for
    each stored key up to the first missing or in-flight one, and the last
    of them; None when a key is stored under another parent (INVALID_ARGUMENT)."""
    statuses = []
    for key in keys:
        node = model.get(key)
        if node is None or (node.parent == parent and node.state == "W"):
            break
        if node.parent != parent:
            return None
        statuses.append(ReserveStatus.EXISTS)
        parent = key
    return statuses, parent

class EngineMachine(RuleBasedStateMachine):
    # The host eviction policy; nothing here depends on which.
    POLICY = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.engine = Engine(
            policy=self.POLICY,
            host_slot_count=SLOTS,
            host_slot_bytes=64,
            limits=EngineLimits(max_leases=MAX_LEASES, lease_ms_default=LEASE_DEFAULT, lease_ms_max=LEASE_MAX),
        )
        self.ns_ids = [self.engine.register_namespace(spec).namespace_id for spec in SPECS]
        self.blocks: list[dict[bytes, MBlock]] = [{} for _ in SPECS]
        self.leases: dict[int, MLease] = {}
        self.held: list[tuple[int, BlockHandle]] = []
        self.now = 0

    # ------------------------------------------------------------------
    # Model helpers

    def refs(self) -> list[dict[bytes, int]]:
        counts: list[dict[bytes, int]] = [{} for _ in SPECS]
        for lease in self.leases.values():
            for key, state in lease.handles:
                if state != "X":
                    counts[lease.ns][key] = counts[lease.ns].get(key, 0) + 1
            if lease.parent is not None:
                counts[lease.ns][lease.parent] = counts[lease.ns].get(lease.parent, 0) + 1
        for ns, handle in self.held:
            counts[ns][handle.key] = counts[ns].get(handle.key, 0) + 1
        return counts

    def match(self, ns: int, keys: list[bytes], parent: bytes | None = None) -> list[bytes]:
        matched = []
        for key in keys:
            node = self.blocks[ns].get(key)
            if node is None or node.parent != parent or node.state != "S":
                break
            matched.append(key)
            parent = key
        return matched

    def descendants(self, ns: int, key: bytes) -> list[bytes]:
        found = [key]
        for candidate in found:
            found.extend(k for k, b in self.blocks[ns].items() if b.parent == candidate)
        return found

    def end_lease(self, lease: MLease) -> None:
        del self.leases[lease.lease_id]
        for entry in lease.handles:
            if entry[1] == "W":
                del self.blocks[lease.ns][entry[0]]
                entry[1] = "X"

    def advance_model_clock(self) -> None:
        due = [lease for lease in self.leases.values() if lease.deadline <= self.now]
        assert self.engine.expire(self.now) == len(due)
        for lease in due:
            event(f"expired: {lease.kind.name}")
            self.end_lease(lease)

    def lease_ms(self, value: int) -> int:
        return LEASE_DEFAULT if value == 0 else value

    def pick(self, items: list, index: int):
        return items[index % len(items)] if items else None

    def expect_rejected(self, error: type[KvdError], call) -> None:
        event(f"rejected: {error.__name__}")
        before = snapshot(self.engine)
        try:
            call()
        except KvdError as raised:
            assert type(raised) is error, f"expected {error.__name__}, got {type(raised).__name__}: {raised}"
        else:
            raise AssertionError(f"expected {error.__name__}")
        assert snapshot(self.engine) == before, "a rejected call changed the engine"

    # ------------------------------------------------------------------
    # Rules

    @rule(amount=st.sampled_from([1, 49, 200, 1000]))
    def advance_clock(self, amount):
        self.now += amount
        self.advance_model_clock()

    @rule(ns=namespaces, path=paths, start=st.integers(0, 3), client=clients, lease_ms=lease_lengths)
    def reserve(self, ns, path, start, client, lease_ms):
        chain = keys_of(ns, path)
        start = min(start, len(chain) - 1)
        self.do_reserve(ns, client, chain[start - 1] if start else b"", chain[start:], lease_ms)

    @rule(ns=namespaces, path=paths, client=clients)
    def put(self, ns, path, client):
        # Reserve and commit at once, as most writers do: fills the pool with
        # sealed blocks, so reserves have to evict.
        lease = self.do_reserve(ns, client, b"", keys_of(ns, path), 0)
        if lease is not None:
            self.do_commit(lease, client, self.ns_ids[ns], [], [])

    @rule(ns=namespaces, first=paths, second=paths, cut=st.integers(0, 3), client=clients)
    def reserve_spliced(self, ns, first, second, cut, client):
        # Two chains glued together, or one with a block left out: not a
        # real chain. Stored keys in the wrong place must be refused; unseen
        # keys are opaque, so the engine stores them as the chain it was given
        # (the model tracks parents by key, so it follows either way).
        one, two = keys_of(ns, first), keys_of(ns, second)
        keys = one[: cut + 1] + two[cut + 1 :] if first != second else one[:cut] + one[cut + 1 :]
        if keys and len(set(keys)) == len(keys):
            self.do_reserve(ns, client, b"", keys, 0)

    @rule(ns=namespaces, path=paths, client=clients)
    def reserve_duplicate_keys(self, ns, path, client):
        chain = keys_of(ns, path)
        self.advance_model_clock()
        self.expect_rejected(
            InvalidArgument, lambda: self.engine.reserve(KeysRequest(self.ns_ids[ns], client, chain + chain[:1], 0,
                                                                     self.now))
        )

    def do_reserve(self, ns: int, client: str, parent_key: bytes, keys: list[bytes], lease_ms: int) -> MLease | None:
        """Reserve through the engine and the model; the new lease, if any."""
        self.advance_model_clock()
        model = self.blocks[ns]
        ns_id = self.ns_ids[ns]

        def call():
            return self.engine.reserve(KeysRequest(ns_id, client, keys, lease_ms, self.now, parent_key=parent_key))

        parent = parent_key or None
        if parent is not None and (parent not in model or model[parent].state != "S"):
            return self.expect_rejected(FailedPrecondition, call)
        walked = expected_walk(model, keys, parent)
        if walked is None:
            return self.expect_rejected(InvalidArgument, call)
        statuses, parent = walked
        first_missing = len(statuses)
        in_flight = first_missing < len(keys) and keys[first_missing] in model
        if not in_flight and first_missing < len(keys):
            if any(key in model for key in keys[first_missing + 1 :]):
                return self.expect_rejected(InvalidArgument, call)
            if len(self.leases) >= MAX_LEASES:
                return self.expect_rejected(ResourceExhausted, call)
        if in_flight or first_missing == len(keys):
            statuses += [ReserveStatus.IN_FLIGHT] * (len(keys) - first_missing)
            event("reserve: in flight" if in_flight else "reserve: all exist")
            result = call()
            assert result.lease is None and result.statuses == statuses
            return None

        refs_before = self.refs()
        evictions_before = self.engine.host.counters.evictions
        before = snapshot(self.engine)
        try:
            result = call()
        except ResourceExhausted:
            # Refused only when nothing could be freed, and the refusal
            # changes nothing, so the pool is still in that state.
            event("reserve: host full")
            assert snapshot(self.engine) == before, "a refused reserve changed the engine"
            self.check_nothing_evictable(parent)
            return None
        wanted = len(keys) - first_missing
        reserved = result.statuses[first_missing:].count(ReserveStatus.RESERVED)
        assert 0 < reserved <= wanted
        assert result.statuses == statuses + [ReserveStatus.RESERVED] * reserved + [ReserveStatus.NO_SPACE] * (
            wanted - reserved
        )
        if reserved < wanted:
            event("reserve: NO_SPACE")
            self.check_nothing_evictable(None)
        lease = MLease(result.lease.lease_id, LeaseKind.WRITE, client, ns, self.now + self.lease_ms(lease_ms))
        lease.parent = parent
        assert result.lease.deadline_ms == lease.deadline
        assert lease.lease_id not in self.leases

        self.learn_reserve_evictions(refs_before, parent, evictions_before)

        for key in keys[first_missing : first_missing + reserved]:
            model[key] = MBlock("W", parent)
            lease.handles.append([key, "W"])
            parent = key
        self.leases[lease.lease_id] = lease
        return lease

    def learn_reserve_evictions(self, refs_before: list[dict], parent: bytes | None, evictions_before: int) -> None:
        """Learn the blocks a reserve evicted, then check each was allowed to go."""
        evicted = {}
        for ns_index, ns_id in enumerate(self.ns_ids):
            nodes = self.engine.namespace(ns_id).index.nodes
            evicted[ns_index] = [key for key in self.blocks[ns_index] if key not in nodes]
        for ns_index, gone in evicted.items():
            if gone:
                event(f"reserve: evicted {len(gone)}")
            for key in gone:
                node = self.blocks[ns_index][key]
                assert node.state == "S", "a block being written was evicted"
                assert refs_before[ns_index].get(key, 0) == 0, "a pinned block was evicted"
                assert key != parent, "the block being extended was evicted"
            for key in gone:
                del self.blocks[ns_index][key]
            for key, node in self.blocks[ns_index].items():
                assert node.parent is None or node.parent in self.blocks[ns_index], "a block outlived its parent"
        assert sum(map(len, evicted.values())) == self.engine.host.counters.evictions - evictions_before

    def check_nothing_evictable(self, parent: bytes | None) -> None:
        # The block a request extends is pinned while slots are found for it,
        # so it may be the one candidate left (it is a candidate again once a
        # refused request lets go of it).
        assert not self.engine.host.pool.free_slots
        candidates = [block.key for block in self.engine.host.policy.order()]
        allowed = [parent] if parent is not None else []
        assert candidates in ([], allowed), "a reserve fell short while a block could be evicted"

    @rule(data=st.data(), pick=picks, foreign=rarely, wrong_namespace=rarely)
    def commit(self, data, pick, foreign, wrong_namespace):
        self.advance_model_clock()
        lease = self.pick(sorted(self.leases.values(), key=lambda lease: lease.lease_id), pick)
        if lease is None:
            return
        client = "mallory" if foreign else lease.client
        handle_keys = [entry[0] for entry in lease.handles]
        mode = data.draw(st.sampled_from(["all", "prefix", "abort", "random"]))
        keys: list[bytes] = []
        abort: list[bytes] = []
        if mode == "prefix":
            writable = [entry[0] for entry in lease.handles if entry[1] == "W"]
            keys = writable[: data.draw(st.integers(0, len(writable)))]
        elif mode == "abort" and handle_keys:
            abort = [data.draw(st.sampled_from(handle_keys))]
        elif mode == "random":
            pool = handle_keys + keys_of(lease.ns, (3,))  # token 3 is outside `paths`: in no lease
            keys = data.draw(st.lists(st.sampled_from(pool), max_size=3, unique=True))
            abort = data.draw(st.lists(st.sampled_from(pool), max_size=2, unique=True))
        ns_id = self.ns_ids[1 - lease.ns if wrong_namespace else lease.ns]
        self.do_commit(lease, client, ns_id, keys, abort)

    def do_commit(self, lease: MLease, client: str, ns_id: bytes, keys: list[bytes], abort: list[bytes]) -> None:
        def call():
            return self.engine.commit(CommitRequest(ns_id, client, lease.lease_id, self.now, keys=keys,
                                                    abort_keys=abort))

        error = self.predict_commit(lease, client, ns_id, keys, abort)
        if error is not None:
            return self.expect_rejected(error, call)
        position = {entry[0]: i for i, entry in enumerate(lease.handles)}
        # Both lists empty means "seal everything still writable". (A new
        # name: `call` must still send the empty lists.)
        sealing = keys if keys or abort else [entry[0] for entry in lease.handles if entry[1] == "W"]
        abort_from = min((position[k] for k in abort), default=len(lease.handles))
        aborted = 0
        for entry in lease.handles[abort_from:]:
            if entry[1] == "W":
                del self.blocks[lease.ns][entry[0]]
                entry[1] = "X"
                aborted += 1
        for key in sealing:
            self.blocks[lease.ns][key].state = "S"
            lease.handles[position[key]][1] = "S"
        event(f"commit: all={not keys and not abort} sealed={bool(sealing)} aborted={bool(aborted)}")
        assert call()[:2] == (len(sealing), aborted)
        if not any(entry[1] == "W" for entry in lease.handles):
            self.end_lease(lease)

    def predict_commit(self, lease, client, ns_id, keys, abort):
        """The error a commit must raise, or None; the order of checks is the API's."""
        if client != lease.client:
            return PermissionDenied
        if lease.kind != LeaseKind.WRITE:
            return FailedPrecondition
        if ns_id != self.ns_ids[lease.ns]:
            return InvalidArgument
        position = {entry[0]: i for i, entry in enumerate(lease.handles)}
        if any(k not in position for k in keys) or any(k not in position for k in abort):
            return InvalidArgument
        if set(keys) & set(abort):
            return InvalidArgument
        if any(lease.handles[position[k]][1] != "W" for k in keys):
            return FailedPrecondition  # aborted or already committed
        to_seal = (
            {position[k] for k in keys}
            if keys or abort
            else {i for i, entry in enumerate(lease.handles) if entry[1] == "W"}
        )
        abort_from = min((position[k] for k in abort), default=len(lease.handles))
        for p in to_seal:
            if p >= abort_from:
                return FailedPrecondition
            if any(lease.handles[e][1] == "W" and e not in to_seal for e in range(p)):
                return FailedPrecondition
        if any(entry[1] == "S" for entry in lease.handles[abort_from:]):
            return FailedPrecondition
        return None

    @rule(ns=namespaces, path=paths, client=clients, lease_ms=lease_lengths, start=st.integers(0, 3))
    def get(self, ns, path, client, lease_ms, start):
        # start > 0 reads a continuation from parent_key.
        self.advance_model_clock()
        chain = keys_of(ns, path)
        start = min(start, len(chain) - 1)
        parent_key = chain[start - 1] if start else b""
        parent = self.blocks[ns].get(parent_key) if parent_key else None
        if parent_key and (parent is None or parent.state != "S"):
            expected = []
        else:
            expected = self.match(ns, chain[start:], parent_key or None)

        def call():
            return engine_ops.get(self.engine, KeysRequest(self.ns_ids[ns], client, chain[start:], lease_ms, self.now,
                                                           parent_key=parent_key))

        if expected and len(self.leases) >= MAX_LEASES:
            # (snapshot leaves out the hit/miss counters, which get bumps
            # before it finds no room for a lease)
            before = snapshot(self.engine)
            try:
                call()
            except ResourceExhausted:
                event("get: lease table full")
                assert snapshot(self.engine) == before
                return
            raise AssertionError("expected ResourceExhausted")
        lease, matched = call()
        event(f"get: matched={bool(expected)} from_parent={bool(parent_key)}")
        assert [b.key for b in matched] == expected
        assert all(b.state == BlockState.SEALED for b in matched)
        if not expected:
            assert lease is None
            return
        model_lease = MLease(lease.lease_id, LeaseKind.READ, client, ns, self.now + self.lease_ms(lease_ms))
        model_lease.handles = [[key, "S"] for key in expected]
        assert lease.deadline_ms == model_lease.deadline
        self.leases[lease.lease_id] = model_lease

    @rule(ns=namespaces, path=paths)
    def lookup(self, ns, path):
        chain = keys_of(ns, path)
        matched = self.engine.lookup(self.ns_ids[ns], chain)
        event(f"lookup: matched={bool(matched)}")
        assert all(b.state == BlockState.SEALED for b in matched), "lookup returned an unsealed block"
        assert [b.key for b in matched] == self.match(ns, chain)

    @rule(pick=picks, foreign=rarely, extra=rarely)
    def release(self, pick, foreign, extra):
        self.advance_model_clock()
        lease = self.pick(sorted(self.leases.values(), key=lambda lease: lease.lease_id), pick)
        if lease is None:
            return
        client = "mallory" if foreign else lease.client
        ids = [lease.lease_id, 10_000] if extra else [lease.lease_id]

        def call():
            return self.engine.release(client, ids)

        if foreign:
            return self.expect_rejected(PermissionDenied, call)
        if extra:
            return self.expect_rejected(NotFound, call)
        assert call() == 1
        self.end_lease(lease)

    @rule(pick=picks, lease_ms=lease_lengths)
    def renew(self, pick, lease_ms):
        self.advance_model_clock()
        lease = self.pick(sorted(self.leases.values(), key=lambda lease: lease.lease_id), pick)
        if lease is None:
            return
        lease.deadline = self.now + self.lease_ms(lease_ms)
        assert self.engine.renew(lease.client, lease.lease_id, lease_ms, self.now) == lease.deadline

    @rule(ns=namespaces, path_list=st.lists(paths, min_size=1, max_size=2))
    def delete(self, ns, path_list):
        keys = [keys_of(ns, path)[-1] for path in path_list]
        refs = self.refs()[ns]
        deleted = pinned = 0
        for key in keys:
            if key not in self.blocks[ns]:
                continue
            subtree = self.descendants(ns, key)
            if any(refs.get(k, 0) or self.blocks[ns][k].state != "S" for k in subtree):
                pinned += 1
                continue
            for k in subtree:
                del self.blocks[ns][k]
            deleted += len(subtree)
        event(f"delete: deleted={bool(deleted)} pinned={bool(pinned)}")
        assert self.engine.delete(self.ns_ids[ns], keys) == (deleted, pinned)

    @rule(ns=namespaces, path=paths)
    def acquire(self, ns, path):
        chain = keys_of(ns, path)
        handles = engine_ops.acquire(self.engine, self.ns_ids[ns], chain)
        event(f"acquire: matched={bool(handles)}")
        assert [h.key for h in handles] == self.match(ns, chain)
        self.held.extend((ns, handle) for handle in handles)

    @rule(pick=picks)
    def release_handle(self, pick):
        if not self.held:
            return
        _, handle = self.held.pop(pick % len(self.held))
        handle.release()
        handle.release()  # idempotent

    @rule()
    def close_all_leases(self):
        assert self.engine.close_all_leases() == len(self.leases)
        for lease in list(self.leases.values()):
            self.end_lease(lease)

    # ------------------------------------------------------------------
    # Invariants

    @invariant()
    def engine_is_consistent(self):
        self.engine.verify()

    @invariant()
    def engine_matches_model(self):
        refs = self.refs()
        total_refs = 0
        pinned = 0
        for ns, ns_id in enumerate(self.ns_ids):
            index = self.engine.namespace(ns_id).index
            assert set(index.nodes) == set(self.blocks[ns])
            for key, node in self.blocks[ns].items():
                block = index.nodes[key]
                assert block.state == (BlockState.SEALED if node.state == "S" else BlockState.WRITABLE)
                assert (block.parent and block.parent.key) == node.parent
                assert block.ref_count == refs[ns].get(key, 0)
                total_refs += block.ref_count
                pinned += block.ref_count > 0
        assert self.engine.live_handles == total_refs
        assert self.engine.pinned_blocks == pinned
        assert {lease.lease_id for lease in self.engine.leases} == set(self.leases)
        for lease in self.engine.leases:
            assert lease.deadline_ms == self.leases[lease.lease_id].deadline

    @invariant()
    def every_sealed_block_is_found_by_its_chain(self):
        for ns in range(len(SPECS)):
            index = self.engine.namespace(self.ns_ids[ns]).index
            for key, node in self.blocks[ns].items():
                if node.state != "S":
                    continue
                chain = [key]
                while self.blocks[ns][chain[-1]].parent is not None:
                    chain.append(self.blocks[ns][chain[-1]].parent)
                chain.reverse()
                # index.match is the lookup path without its side effects.
                assert [b.key for b in index.match(chain)] == chain

    def teardown(self):
        for _, handle in self.held:
            handle.release()
        self.held.clear()
        self.engine.close_all_leases()
        self.engine.verify()
        assert self.engine.live_handles == 0
        assert self.engine.pinned_blocks == 0
        assert len(self.engine.host.policy) == sum(
            1 for state in self.engine.namespaces() for block in state.index if block.first_child is None
        ), "with nothing pinned, every leaf is an eviction candidate"


MACHINE_SETTINGS = settings(
    max_examples=300,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
EngineMachine.TestCase.settings = MACHINE_SETTINGS
TestEngineStateMachine = EngineMachine.TestCase


class S3FifoEngineMachine(EngineMachine):
    POLICY = "s3fifo"


S3FifoEngineMachine.TestCase.settings = MACHINE_SETTINGS
TestEngineStateMachineS3Fifo = S3FifoEngineMachine.TestCase
