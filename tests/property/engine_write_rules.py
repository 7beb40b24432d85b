"""The rules of the engine state machine that write: reserve (plain, from a
parent key, spliced, with duplicate keys), put, commit and abort, and
delete, each predicted by the model (tests/property/engine_model.py).

Which blocks a reserve evicts is policy; the model learns it from the engine
after each reserve and checks only what must hold for any policy: only
sealed, unpinned blocks are evicted, a block never outlives its evicted
parent, a reserve falls short (NO_SPACE) only when nothing at all could be
freed, and the eviction counter agrees."""

from __future__ import annotations

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import rule

from kvd.core.engine import ReserveStatus
from kvd.core.lease import LeaseKind
from kvd.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from kvd.testing.engine_snapshot import snapshot
from kvd.core.requests import CommitRequest, KeysRequest
from tests.property.engine_model import (MAX_LEASES, EngineModel, MBlock, MLease, clients, expected_walk, keys_of,
    lease_lengths, namespaces, paths, picks, rarely)


class WriteRules(EngineModel):
    """Reserve, put, commit and abort, and delete."""

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
