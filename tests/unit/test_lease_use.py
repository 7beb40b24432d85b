"""A lease used past its call (kvd.core.lease_use), driven by hand as SaveLayers, the cluster
fetch and the private read pins drive it, against a real engine.

A fill holds its reservation's lease while bytes land, so nothing frees its slots under them;
it ends once: the verified prefix sealed and the rest aborted, nothing kept when the lease
ended meanwhile, or left to its deadline. A read pin is closed once, unless its lease ended
first, and while held outlives its lease's deadline.
"""

from __future__ import annotations

import pytest

from kvd.core.engine import Engine
from kvd.core.get_life import GetLife
from kvd.core.keys import NamespaceSpec
from kvd.core.lease_use import Fill, FillPhase, ReadPin
from kvd.core.requests import CommitRequest, KeysRequest
from kvd.invariants import InvariantError
from kvd.testing.chains import text_chain as keys

SPEC = NamespaceSpec(model_id="lease-use", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
LEASE_MS = 1_000
SLOTS = 8


class Rig:
    def __init__(self) -> None:
        self.engine = Engine(host_slot_count=SLOTS, host_slot_bytes=64)
        self.ns = self.engine.register_namespace(SPEC).namespace_id

    def request(self, client_id: str, chain: str, now_ms: int = 0) -> KeysRequest:
        return KeysRequest(self.ns, client_id, keys(SPEC, chain), LEASE_MS, now_ms)

    def fill(self, chain: str) -> Fill:
        return Fill(self.engine, self.engine.reserve(self.request("writer", chain)).lease)

    def read_pin(self, chain: str) -> ReadPin:
        """`chain` stored, then pinned by a private Get (as the handlers' inline and peer Gets pin)."""
        written = self.engine.reserve(self.request("writer", chain))
        self.engine.commit(CommitRequest(self.ns, "writer", written.lease.lease_id, 0))
        life = GetLife(self.engine, None, 0.0)
        life.begin(self.request("reader", chain), 0.0)
        assert len(life.settle().blocks) == len(chain)
        return ReadPin(self.engine, life.plan.lease)

    def free(self) -> int:
        return self.engine.host.pool.free_count


@pytest.fixture
def rig() -> Rig:
    return Rig()


def test_a_fill_seals_its_verified_prefix_aborts_the_rest_and_ends_once(rig):
    fill = rig.fill("abcd")
    assert fill.landed(2, 0) == 2 and fill.phase is FillPhase.KEPT
    assert len(rig.engine.lookup(rig.ns, keys(SPEC, "abcd"))) == 2
    assert not rig.engine.leases and rig.free() == SLOTS - 2
    with pytest.raises(InvariantError, match="cannot go from"):
        fill.abandon(0)
    rig.engine.verify()


def test_a_fill_keeps_its_slots_while_its_lease_ends_and_then_keeps_nothing(rig):
    engine, fill = rig.engine, rig.fill("abc")
    lease = fill.lease
    assert engine.expire(lease.deadline_ms) == 1  # the sweeper: ended for the client...
    assert fill.lapsed and not lease.ended and rig.free() == SLOTS - 3  # ...not under the bytes
    # Another writer gets only the free slots.
    other = engine.reserve(rig.request("other", "xyzuvw", lease.deadline_ms))
    engine.commit(CommitRequest(rig.ns, "other", other.lease.lease_id, lease.deadline_ms))
    assert fill.landed(3, lease.deadline_ms) == 0 and fill.phase is FillPhase.LAPSED
    assert lease.ended and engine.lookup(rig.ns, keys(SPEC, "abc")) == []
    assert rig.free() == SLOTS - 5
    engine.verify()


def test_a_fill_past_its_deadline_with_no_sweep_keeps_nothing(rig):
    """The commit would expire the lease first and answer NOT_FOUND; the fill says LAPSED instead."""
    fill = rig.fill("ab")
    assert fill.landed(2, fill.lease.deadline_ms) == 0 and fill.phase is FillPhase.LAPSED
    assert not rig.engine.leases and rig.free() == SLOTS
    rig.engine.verify()


def test_a_fill_let_lapse_stays_reserved_until_its_deadline(rig):
    fill = rig.fill("ab")
    fill.let_lapse()
    assert fill.phase is FillPhase.LET_LAPSE and rig.free() == SLOTS - 2
    assert rig.engine.expire(fill.lease.deadline_ms) == 1 and fill.lease.ended
    assert rig.free() == SLOTS
    with pytest.raises(InvariantError, match="cannot go from"):
        fill.landed(2, fill.lease.deadline_ms)
    rig.engine.verify()


def test_a_read_pin_is_closed_once(rig):
    pin = rig.read_pin("abc")
    pin.release()
    assert pin.lease.ended and rig.engine.pinned_blocks == 0
    with pytest.raises(InvariantError, match="released twice"):
        pin.release()
    ReadPin(rig.engine, None).release()  # nothing pinned, nothing to close
    rig.engine.verify()


def test_a_read_pin_whose_lease_ended_first_closes_nothing(rig):
    pin = rig.read_pin("ab")
    assert rig.engine.expire(pin.lease.deadline_ms) == 1 and pin.lease.ended
    pin.release()
    assert rig.engine.pinned_blocks == 0
    rig.engine.verify()


def test_a_held_read_pin_outlives_its_deadline_until_released(rig):
    pin = rig.read_pin("abc").hold()
    assert rig.engine.expire(pin.lease.deadline_ms) == 1
    assert not pin.lease.ended and rig.engine.pinned_blocks == 3
    pin.release()
    assert pin.lease.ended and rig.engine.pinned_blocks == 0
    rig.engine.verify()
