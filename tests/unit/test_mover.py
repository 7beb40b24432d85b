"""The mover (kvd.core.mover): when write-back runs, and the order of a round's steps.

A round is driven here by hand, with the fake slot contents the simulator
uses (kvd.sim.plane), so each rule the daemon and the simulator share is
checked once, directly: when a round is due, removals before writes, no
write into a slot whose REMOVE failed, removals confirmed before the
writes' outcomes, and when a starved Get waits.
"""

from __future__ import annotations

import pytest

from kvd.core.block import NO_SLOT
from kvd.core.engine import Engine
from kvd.core.keys import NamespaceSpec
from kvd import config
from kvd.core.mover import WRITE_MODES, Mover, MoverSettings
from kvd.invariants import InvariantError
from kvd.sim.plane import SlotContents
from kvd.core.requests import CommitRequest, KeysRequest
from kvd.testing.chains import text_chain as keys
from kvd.testing import core_ops

SPEC = NamespaceSpec(model_id="mover-test", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
OTHER = NamespaceSpec(model_id="mover-other", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
LONG = 10_000


class Rig:
    def __init__(self, host_slots: int = 8, disk_slots: int = 16, **settings) -> None:
        self.engine = Engine(host_slot_count=host_slots, host_slot_bytes=64, disk_slot_count=disk_slots,
                             disk_slot_bytes=64, high_watermark=0.75, low_watermark=0.5)
        self.mover = Mover(self.engine, MoverSettings(**settings))
        self.contents = SlotContents(self.engine)
        self.ns = {}
        for spec in (SPEC, OTHER):
            self.ns[spec] = self.engine.register_namespace(spec).namespace_id
            self.engine.enable_disk(self.ns[spec])

    def put(self, chain: str, spec: NamespaceSpec = SPEC) -> None:
        result = self.engine.reserve(KeysRequest(self.ns[spec], "w", keys(spec, chain), LONG, 0))
        self.contents.fill(keys(spec, chain), result.slots)
        if result.lease is not None:
            self.engine.commit(CommitRequest(self.ns[spec], "w", result.lease.lease_id, 0))

    def run_round(self, failed_removals=(), failing=()) -> list[list[int]] | None:
        """One whole round as a driver runs it; the chunks it wrote."""
        round_ = self.mover.next_round()
        if round_ is None:
            return None
        self.contents.drop([removal for removal in round_.removals if removal[2] not in failed_removals])
        self.mover.round_removals_journalled(round_, failed_removals)
        chunks = round_.chunks()
        for positions in chunks:
            writes = [round_.writes[position] for position in positions]
            self.mover.chunk_written(round_, positions, self.contents.write(writes, failing))
        self.outcomes = self.mover.finish_round(round_)
        self.mover.verify()
        self.engine.verify()
        return chunks

    def durable(self, chain: str, spec: NamespaceSpec = SPEC) -> list[bool]:
        blocks = self.engine.stored(self.ns[spec], keys(spec, chain))
        return [self.engine.disk_slot(block) != NO_SLOT for block in blocks]


def test_write_back_waits_for_a_reason_and_write_through_does_not():
    rig = Rig(write_mode="back")
    rig.put("ab")
    assert not rig.mover.should_write() and rig.run_round() is None  # below the high watermark
    rig.mover.starved_gets = 1
    assert rig.mover.should_write()
    rig.mover.starved_gets = 0
    started, failures, pins, _ = rig.mover.durable.start(rig.engine.stored(rig.ns[SPEC], keys(SPEC, "ab")), "", lambda block: object())
    assert len(started) == 2 and failures == []
    assert rig.mover.should_write()  # a client waits for durability
    rig.run_round()
    assert rig.outcomes == [(token, None) for token in started.values()]
    assert not rig.mover.durable and rig.durable("ab") == [True, True]
    for pin in pins:
        pin.release()
    rig.mover.draining = True
    assert rig.mover.should_write()
    through = Rig(write_mode="through")
    through.put("ab")
    assert through.run_round() == [[0, 1]] and through.durable("ab") == [True, True]


def test_write_behind_writes_at_once_in_the_reads_gaps():
    """The default: every queued block is written without waiting for a reason, but the queue counts
    as a backlog (which may take drive time from reads) only when something waits for it."""
    assert MoverSettings().write_mode == "behind" and config.WRITE_MODES == WRITE_MODES
    rig = Rig(write_mode="behind")
    rig.put("ab")
    assert rig.mover.should_write() and rig.mover.backlog() == 0
    rig.mover.starved_gets = 1
    assert rig.mover.backlog() == 2
    rig.mover.starved_gets = 0
    assert rig.run_round() == [[0, 1]] and rig.durable("ab") == [True, True]
    through = Rig(write_mode="through")
    through.put("ab")
    assert through.mover.backlog() == 2


def test_above_the_high_watermark_a_round_writes_and_the_next_turn_demotes():
    rig = Rig(host_slots=8, write_mode="back")
    rig.put("abcdef")  # 6 of 8 slots: at the high watermark (0.75)
    assert rig.mover.should_write() and rig.mover.backlog() == 6
    rig.run_round()
    assert rig.durable("abcdef") == [True] * 6
    rig.mover.next_round()  # the writer's next turn: durable blocks demoted to the low watermark
    assert rig.engine.host.pool.resident_blocks == 4


def test_chunks_keep_to_one_namespace_and_to_the_chunk_size():
    rig = Rig(write_mode="through", chunk_blocks=2)
    rig.put("abc")
    rig.put("xy", OTHER)
    assert rig.run_round() == [[0, 1], [2], [3, 4]]
    whole = Rig(write_mode="through", chunk_blocks=0)
    whole.put("abc")
    assert whole.run_round() == [[0, 1, 2]]


def test_writes_wait_for_the_removals_and_skip_a_slot_whose_removal_failed():
    rig = Rig(write_mode="through", disk_slots=2)
    rig.put("a")
    rig.put("b")
    rig.run_round()
    rig.put("c")  # the disk is full: a slot is taken from an evicted block
    round_ = rig.mover.next_round()
    [(_, _, reused)] = round_.removals
    with pytest.raises(InvariantError):
        round_.chunks()  # no write before the removals are durable
    rig.mover.round_removals_journalled(round_, {reused})
    assert round_.chunks() == []  # the only write went to the slot whose REMOVE failed
    rig.mover.finish_round(round_)
    assert rig.durable("c") == [False]
    # Still on record under the old block: quarantined until a REMOVE of it is durable.
    assert reused in rig.engine.disk.pool.quarantine
    rig.engine.verify()


def test_a_failed_write_keeps_its_slot_quarantined_after_the_round():
    rig = Rig(write_mode="through")
    rig.put("ab")
    rig.run_round(failing={keys(SPEC, "ab")[-1]})
    assert rig.durable("ab") == [True, False]
    # The failed write may have reached the journal: its slot waits for its own REMOVE.
    [(_, key, slot)] = rig.engine.disk.pool.removals
    assert key == keys(SPEC, "ab")[-1] and slot in rig.engine.disk.pool.quarantine


def test_one_round_at_a_time():
    rig = Rig(write_mode="through")
    rig.put("ab")
    round_ = rig.mover.next_round()
    rig.put("xy", OTHER)
    assert rig.mover.next_round() is None  # the writer waits for the round in flight
    assert rig.mover.write_back_pending()
    with pytest.raises(InvariantError):
        rig.mover.chunk_written(round_, [0], [True])  # before its removals were journalled
    core_ops.abandon_round(rig.mover, round_)
    assert rig.durable("ab") == [False, False]
    rig.engine.verify()


def test_a_starved_get_waits_only_while_write_back_is_pending_and_its_time_lasts():
    rig = Rig()
    assert not rig.mover.starved_get_waits(0, 10)  # nothing queued, nothing in flight
    rig.put("ab")
    assert rig.mover.starved_get_waits(0, 10)
    assert not rig.mover.starved_get_waits(10, 10)
    rig.mover.draining = True
    assert not rig.mover.starved_get_waits(0, 10)


def test_a_durable_wait_fails_at_once_when_it_never_can_succeed_and_says_why():
    rig = Rig(write_mode="through")
    rig.put("a")
    rig.run_round(failing={keys(SPEC, "a")[0]})
    assert rig.outcomes == []  # nobody waited
    rig.put("ab")  # the parent is not on disk, so its child never will be written alone
    blocks = rig.engine.stored(rig.ns[SPEC], keys(SPEC, "ab"))
    started, failures, pins, _ = rig.mover.durable.start(blocks, "", lambda block: object())
    assert list(started) == blocks and failures == []  # both queued again, parent first
    rig.run_round()
    assert [failure for _, failure in rig.outcomes] == [None, None] and rig.durable("ab") == [True, True]
    for pin in pins:
        pin.release()
    _, down, _, _ = rig.mover.durable.start(rig.engine.stored(rig.ns[OTHER], []), "", lambda block: object())
    rig.put("xy", OTHER)
    started, down, pins, _ = rig.mover.durable.start(rig.engine.stored(rig.ns[OTHER], keys(OTHER, "xy")),
                                                 "no drive takes writes", lambda block: object())
    assert started == {} and pins == [] and [(failure.code, failure.reason) for failure in down] == [
        ("UNAVAILABLE", "no drive takes writes")] * 2


def _start(rig: Rig, chain: str):
    return rig.mover.durable.start(rig.engine.stored(rig.ns[SPEC], keys(SPEC, chain)), "", lambda block: object())


def test_under_group_a_written_block_is_durable_only_once_a_commit_begun_after_its_write_ends():
    rig = Rig(write_mode="through", sync="group")
    durable = rig.mover.durable
    rig.put("ab")
    started, _, pins, _ = _start(rig, "ab")
    rig.run_round()
    # Written, but not synced: no outcome yet, and a commit is wanted now.
    assert rig.outcomes == [] and durable.commit_due()
    # A block written while a commit is in flight is not covered by it.
    covered = durable.begin_sync()
    rig.put("abc")
    rig.run_round()
    # a and b wait for the commit in flight (their writes ended before it began), c for the next.
    late, _, late_pins, _ = _start(rig, "abc")
    a, b, c = rig.engine.stored(rig.ns[SPEC], keys(SPEC, "abc"))
    answered = durable.end_sync(covered, lambda slot: "")
    assert {id(token) for token, _ in answered} == {id(token) for token in [*started.values(), late[a], late[b]]}
    assert all(failure is None for _, failure in answered) and list(durable.syncing) == [c]
    (failed,) = durable.end_sync(durable.begin_sync(), lambda slot: "drive 0: EIO")
    assert failed[0] is late[c] and failed[1].code == "UNAVAILABLE"
    # The drive failed its sync: the block is not durable, and a new wait fails at the next commit again.
    again, _, again_pins, _ = _start(rig, "abc")
    assert len(again) == 1
    outcome = durable.end_sync(durable.begin_sync(), lambda slot: "drive 0: EIO")
    assert [failure.code for _, failure in outcome] == ["UNAVAILABLE"] and "EIO" in outcome[0][1].reason
    # A later good commit: nothing left unsynced, a new wait is answered at once.
    durable.end_sync(durable.begin_sync(), lambda slot: "")
    assert not durable.unsynced and _start(rig, "abc")[0] == {}
    for pin in pins + late_pins + again_pins:
        pin.release()
    rig.mover.verify()


def test_under_none_every_wait_on_a_disk_copy_asks_for_a_commit_and_strict_asks_for_none():
    rig = Rig(write_mode="through", sync="none")
    rig.put("ab")
    rig.run_round()
    durable = rig.mover.durable
    assert not durable.unsynced and not durable.commit_due()  # nobody waits: nothing is tracked
    started, _, pins, _ = _start(rig, "ab")
    assert len(started) == 2 and durable.commit_due()
    assert [failure for _, failure in durable.end_sync(durable.begin_sync(), lambda slot: "")] == [None, None]
    for pin in pins:
        pin.release()
    strict = Rig(write_mode="through")
    strict.put("ab")
    started, _, pins, _ = _start(strict, "ab")
    strict.run_round()
    assert [failure for _, failure in strict.outcomes] == [None, None] and not strict.mover.durable.commit_due()
    assert _start(strict, "ab")[0] == {}
    for pin in pins:
        pin.release()


def test_a_block_deleted_before_its_commit_is_not_acknowledged():
    rig = Rig(write_mode="through", sync="group")
    rig.put("ab")
    rig.run_round()
    durable = rig.mover.durable
    started, _, pins, _ = _start(rig, "ab")
    for pin in pins:
        pin.release()
    rig.engine.delete(rig.ns[SPEC], keys(SPEC, "ab"))
    outcome = durable.end_sync(durable.begin_sync(), lambda slot: "")
    assert len(outcome) == 2 and all(failure is not None and "removed" in failure.reason for _, failure in outcome)
