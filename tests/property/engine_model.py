"""The naive model that tests/property/test_engine_state_machine.py checks the engine against.

The model is a plain dict per namespace of key -> (state, parent key), plus
the leases and handles the test holds. EngineModel holds it next to the
engine under test, with the helpers every rule uses; the rules are mixed in
by concern (WriteRules in engine_write_rules.py, the reads, leases and
checks in test_engine_state_machine.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine

from kvd.core.block import BlockHandle
from kvd.core.engine import Engine, EngineLimits, ReserveStatus
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.lease import LeaseKind
from kvd.errors import KvdError
from kvd.testing.engine_snapshot import snapshot

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


class EngineModel(RuleBasedStateMachine):
    """The engine under test (its host eviction policy named by the subclass's POLICY) and the model
    of what it holds, with the helpers the rules share."""

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
