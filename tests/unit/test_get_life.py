"""A Get's life (kvd.core.get_life), driven by hand as the daemon and the simulator drive it.

Each rule the two drivers share is checked once here: a starved plan waits for write-back and
counts as a reason to write; a Get's blocks stay pinned by the Get whatever its lease does; it
settles only once its reads and the reads it waits on are over; and its answer says why it
is short (a block that failed its checksum is CORRUPT, for the Get that read it and for one
that waited on that read).
"""

from __future__ import annotations

import pytest

from kvd.core.block import BlockState
from kvd.core.engine import Engine
from kvd.core.get_life import GetLife, GetPhase
from kvd.core.keys import NamespaceSpec
from kvd.core.mover import Mover, MoverSettings
from kvd.core.reads import GetCut, LoadOutcome
from kvd.core.requests import CommitRequest, KeysRequest
from kvd.invariants import InvariantError
from kvd.sim.plane import SlotContents
from kvd.testing import engine_ops
from kvd.testing.chains import text_chain as keys
from kvd.v1 import kvd_pb2

SPEC = NamespaceSpec(model_id="get-life", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
LONG = 10_000


class Rig:
    def __init__(self, host_slots: int = 4, write_mode: str = "back") -> None:
        self.engine = Engine(host_slot_count=host_slots, host_slot_bytes=64, disk_slot_count=16,
                             disk_slot_bytes=64, high_watermark=1.0, low_watermark=0.75)
        self.mover = Mover(self.engine, MoverSettings(write_mode=write_mode))
        self.contents = SlotContents(self.engine)
        self.ns = self.engine.register_namespace(SPEC).namespace_id
        self.engine.enable_disk(self.ns)

    def put(self, chain: str) -> None:
        result = self.engine.reserve(KeysRequest(self.ns, "w", keys(SPEC, chain), LONG, 0))
        self.contents.fill(keys(SPEC, chain), result.slots)
        self.engine.commit(CommitRequest(self.ns, "w", result.lease.lease_id, 0))

    def on_disk_only(self, chain: str) -> None:
        """Store `chain`, write it, and drop its host copies (as after a restart)."""
        self.put(chain)
        self.mover.draining = True  # a reason to write, under write-back
        while self.run_round():
            pass
        self.mover.draining = False
        engine_ops.demote_all(self.engine)
        assert all(self.engine.host_slot(block) < 0 for block in self.engine.stored(self.ns, keys(SPEC, chain)))

    def run_round(self) -> bool:
        round_ = self.start_round()
        if round_ is not None:
            self.finish_round(round_)
        return round_ is not None

    def start_round(self):
        """A round picked: its blocks are pinned until it finishes."""
        return self.mover.next_round()

    def finish_round(self, round_) -> None:
        self.contents.drop(round_.removals)
        self.mover.round_removals_journalled(round_, ())
        for positions in round_.chunks():
            self.mover.chunk_written(round_, positions, self.contents.write([round_.writes[p] for p in positions]))
        self.mover.finish_round(round_)

    def life(self, chain: str, client: str = "r", lease_ms: int = LONG, now: float = 0.0,
             deadline: float = 10.0) -> tuple[GetLife, GetPhase]:
        life = GetLife(self.engine, self.mover, deadline)
        return life, life.begin(KeysRequest(self.ns, client, keys(SPEC, chain), lease_ms, 0), now)

    def read(self, life: GetLife, corrupt: set[int] = frozenset()) -> None:
        """The Get's own reads, as a driver does them: bytes in, then the outcomes."""
        loads = life.plan.loads
        ok = self.contents.load(loads, corrupt)
        life.loads_done(loads, [LoadOutcome.OK if good else LoadOutcome.CORRUPT for good in ok])
        self.contents.journal_removals()


def test_the_cut_values_are_the_protos():
    for cut in GetCut:
        if cut != GetCut.LEASE_ENDED:  # never sent: the call fails with FAILED_PRECONDITION instead
            assert kvd_pb2.GetCut.Value(f"GET_CUT_{cut.name}") == cut.value


def test_a_corrupt_block_cuts_the_get_that_read_it_and_the_one_that_waited_on_that_read():
    rig = Rig()
    rig.on_disk_only("abc")
    reader, phase = rig.life("abc")
    assert phase is GetPhase.READING and len(reader.plan.loads) == 3
    waiter, _ = rig.life("abc", client="w2")
    assert waiter.plan.waits == reader.plan.matched and not waiter.plan.loads
    with pytest.raises(InvariantError, match="pending"):
        waiter.settle()  # its wait has not reported
    corrupt_slot = reader.plan.loads[1].source_slot
    rig.read(reader, {corrupt_slot})
    served = reader.settle()
    assert rig.contents.served(served.blocks) == keys(SPEC, "a") and served.cut == GetCut.CORRUPT
    for load, outcome in zip(reader.plan.loads, (LoadOutcome.OK, LoadOutcome.CORRUPT, LoadOutcome.OK)):
        waiter.wait_done(load.block, outcome)
    assert waiter.settle().cut == GetCut.CORRUPT
    assert rig.engine.lookup(rig.ns, keys(SPEC, "abc"))[-1].key == keys(SPEC, "a")[0]
    rig.engine.close_all_leases()
    assert rig.engine.pinned_blocks == 0


def test_a_get_whose_lease_ends_mid_read_keeps_its_pins_then_serves_nothing():
    rig = Rig()
    rig.on_disk_only("ab")
    life, _ = rig.life("ab", lease_ms=5)
    blocks = list(life.plan.matched)
    rig.engine.expire(1_000)  # the sweeper, mid-read
    assert life.plan.lease.ended and all(block.ref_count > 0 for block in blocks)
    rig.read(life)
    served = life.settle()
    assert (served.blocks, served.cut) == ([], GetCut.LEASE_ENDED)
    assert rig.engine.pinned_blocks == 0 and all(block.state == BlockState.SEALED for block in blocks)


def starved(rig: Rig):
    """Host memory full of blocks a write round in flight pins; "ab" on disk only. The round."""
    rig.on_disk_only("ab")
    rig.put("wxyz")
    rig.mover.draining = True
    round_ = rig.start_round()
    rig.mover.draining = False
    assert round_ is not None and len(round_.writes) == 4
    return round_


def test_a_starved_plan_waits_for_a_round_counted_as_a_reason_to_write():
    rig = Rig(host_slots=4, write_mode="back")
    round_ = starved(rig)
    life, phase = rig.life("ab")
    assert phase is GetPhase.WAITING_FOR_ROOM and rig.mover.starved_gets == 1
    state = rig.engine.namespace(rig.ns)
    assert (state.get_hits, state.get_misses, rig.engine.leases.pinned_total) == (0, 0, 0)  # given back
    assert rig.mover.should_write()
    rig.finish_round(round_)
    assert life.begin(KeysRequest(rig.ns, "r", keys(SPEC, "ab"), LONG, 0), 1.0) is GetPhase.READING
    assert rig.mover.starved_gets == 0 and len(life.plan.loads) == 2
    rig.read(life)
    served = life.settle()
    assert rig.contents.served(served.blocks) == keys(SPEC, "ab") and served.cut == GetCut.NONE
    assert (state.get_hits, state.get_misses) == (2, 0)  # counted once
    rig.engine.close_all_leases()


def test_a_starved_plan_past_its_deadline_takes_what_it_can_and_says_why():
    rig = Rig(host_slots=4, write_mode="back")
    round_ = starved(rig)
    life, phase = rig.life("ab", now=11.0, deadline=10.0)
    assert phase is GetPhase.READING and rig.mover.starved_gets == 0
    assert not life.pending and life.settle().cut == GetCut.NO_ROOM
    rig.finish_round(round_)


def test_a_get_cancelled_while_it_waits_for_room_stops_counting():
    rig = Rig(host_slots=4, write_mode="back")
    round_ = starved(rig)
    life, _ = rig.life("ab")
    assert rig.mover.starved_gets == 1
    life.cancel()
    assert rig.mover.starved_gets == 0 and life.phase is GetPhase.DROPPED
    with pytest.raises(InvariantError):
        life.begin(KeysRequest(rig.ns, "r", keys(SPEC, "ab"), LONG, 0), 0.0)
    rig.finish_round(round_)


def test_a_get_is_dropped_only_once_its_own_reads_are_over():
    rig = Rig()
    rig.on_disk_only("ab")
    life, _ = rig.life("ab")
    with pytest.raises(InvariantError, match="still run"):
        life.drop()
    rig.read(life)
    life.drop()
    assert life.phase is GetPhase.DROPPED and rig.engine.pinned_blocks == 0 and not rig.engine.leases
    with pytest.raises(InvariantError):
        life.settle()
