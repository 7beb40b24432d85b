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

The machine is made of one base and mixins by concern: EngineModel (the
model and its helpers, tests/property/engine_model.py), WriteRules
(tests/property/engine_write_rules.py), and ReadRules, LeaseRules and
ModelChecks here."""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from kvd.core.block import BlockState
from kvd.core.lease import LeaseKind
from kvd.errors import NotFound, PermissionDenied, ResourceExhausted
from kvd.testing.engine_snapshot import snapshot
from kvd.testing import engine_ops
from kvd.core.requests import KeysRequest
from tests.property.engine_model import (MAX_LEASES, SPECS, EngineModel, MLease, clients, keys_of, lease_lengths,
    namespaces, paths, picks, rarely)
from tests.property.engine_write_rules import WriteRules


class ReadRules(EngineModel):
    """Get (from the root or a parent key), lookup, and handles acquired and released outside leases."""

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


class LeaseRules(EngineModel):
    """The clock (leases expire), release, renew and closing every lease."""

    @rule(amount=st.sampled_from([1, 49, 200, 1000]))
    def advance_clock(self, amount):
        self.now += amount
        self.advance_model_clock()

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

    @rule()
    def close_all_leases(self):
        assert self.engine.close_all_leases() == len(self.leases)
        for lease in list(self.leases.values()):
            self.end_lease(lease)


class ModelChecks(EngineModel):
    """The invariants checked after every step, and the teardown's."""

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


class EngineMachine(WriteRules, ReadRules, LeaseRules, ModelChecks):
    # The host eviction policy; nothing here depends on which.
    POLICY = "lru"


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
