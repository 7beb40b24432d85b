"""A Get's life, from its plan to its answer, written once without I/O or clock.

The engine knows a Get's steps (begin_get, finish_loads, settle_get, ...);
this machine knows their order and the rules between them, so that the two
drivers, the daemon's Get handlers with the disk plane (kvd.server) and the
simulator (kvd.sim), cannot drift apart (issue 35 item 2: they did, into a
race). It holds no clock: the driver passes `now` in its own units, the
same as the room deadline it gave. Its phases:

    PLANNING --plan--> READING --(own reads over, waited reads over)--> settle --> SETTLED
        |                  \\--drop (failed or cancelled, once no read into its slots runs)--> DROPPED
        |                   \\--abandon (its reads could not be started)--> DROPPED
        \\--plan, starved--> WAITING_FOR_ROOM --plan again (a write round ended, or final)--> ...

The rules:

* A plan starved of host slots while write-back is pending gives back
  everything it took (its counts too) and waits for the next write round,
  until its room deadline passes or the daemon drains; then (or when told
  `final`) it takes what it can. While it waits it counts as a reason to
  write (`Mover.starved_gets`); each round's demotions run before it tries
  again (`Mover.after_round`).
* From plan to settle or drop, the blocks it found are pinned by the Get
  itself, not only by its lease (which the client may release, or the
  clock expire, while reads run).
* It settles only once its own reads are over and the reads it waits on
  (another Get's or a prefetch's) have reported. A Get whose lease ended
  meanwhile serves nothing: a normal end (LEASE_ENDED), not an error.
* Its answer says why it is shorter than the prefix it found (`GetCut`):
  a block that failed its checksum is CORRUPT, not missing.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvd.core.block import Block
from kvd.core.reads import GetCut, GetPlan, LoadOutcome
from kvd.core.requests import KeysRequest
from kvd.core.transfer import Transfer
from kvd.invariants import check

if TYPE_CHECKING:
    from kvd.core.engine import Engine
    from kvd.core.mover import Mover

_CUT_BY_OUTCOME = {LoadOutcome.CORRUPT: GetCut.CORRUPT, LoadOutcome.UNREADABLE: GetCut.UNREADABLE}


class GetPhase(enum.Enum):
    PLANNING = "planning"
    WAITING_FOR_ROOM = "waiting for write-back to make room"
    READING = "reading"
    SETTLED = "settled"
    DROPPED = "dropped"


@dataclass(frozen=True, slots=True)
class Served:
    """A settled Get: the blocks it serves (pinned by its lease) and why there are not more."""

    blocks: list[Block]
    cut: GetCut


class GetLife:
    def __init__(self, engine: Engine, mover: Mover | None, room_deadline: float) -> None:
        """mover: None without tiers below host memory (nothing to wait for); room_deadline: until
        when (the driver's clock) a starved plan may wait for write-back."""
        self.engine = engine
        self.mover = mover
        self.room_deadline = room_deadline
        self.phase = GetPhase.PLANNING
        self.plan_: GetPlan | None = None
        # What the plan found (after any cut at planning), to say why settling served less.
        self._found: list[Block] = []
        self._reading: set[Block] = set()
        self._waiting: set[Block] = set()
        # Reads of found blocks that failed, with how.
        self._failed: dict[Block, LoadOutcome] = {}

    @property
    def plan(self) -> GetPlan:
        check(self.plan_ is not None, "the Get has no plan in phase {}", self.phase.value)
        return self.plan_

    def _enter(self, phase: GetPhase, *allowed: GetPhase) -> None:
        check(self.phase in allowed, "a Get cannot go from {} to {}", self.phase.value, phase.value)
        if self.phase is GetPhase.WAITING_FOR_ROOM:
            self.mover.starved_gets -= 1
        if phase is GetPhase.WAITING_FOR_ROOM:
            self.mover.starved_gets += 1
        self.phase = phase

    # -- planning --------------------------------------------------------

    def begin(self, request: KeysRequest, now: float, *, final: bool = False) -> GetPhase:
        """Plan the Get (again, after a wait for room: pass final when the wait gave up). Returns
        the new phase: READING (its loads and waits are in `plan`, possibly none), or
        WAITING_FOR_ROOM (call begin again after the next write round, or with final)."""
        retry = self.phase is GetPhase.WAITING_FOR_ROOM
        self._enter(GetPhase.PLANNING, GetPhase.PLANNING, GetPhase.WAITING_FOR_ROOM)
        if retry and not final:
            self.mover.after_round()  # the round's blocks may now give up their host copies
        plan = self.engine.begin_get(request)
        if plan.starved and self.mover is not None and not final:
            self.engine.abandon_get(plan)  # which takes back what it counted
            if self.mover.starved_get_waits(now, self.room_deadline):
                self._enter(GetPhase.WAITING_FOR_ROOM, GetPhase.PLANNING)
                return self.phase
            plan = self.engine.begin_get(request)
        self.plan_ = plan
        self._found = list(plan.matched)
        self._reading = {load.block for load in plan.loads}
        self._waiting = set(plan.waits)
        self._enter(GetPhase.READING, GetPhase.PLANNING)
        self._describe(request.namespace_id, plan)
        return self.phase

    def _describe(self, namespace_id: bytes, plan: GetPlan) -> None:
        """What the answer and the reads need, taken in the plan's own step (one entry into core):
        each found block's tier before the Get, where each is (or lands) in the host tier, where
        the plan's own loads land, and the namespace's shape."""
        engine = self.engine
        self.tiers: bytes = engine.tier_bytes(plan.matched)
        self.offsets: list[int] = engine.host_offsets(plan.matched)
        self.load_offsets: list[int] = engine.load_offsets(plan.loads)
        self.spec = engine.namespace(namespace_id).spec

    def cancel(self) -> None:
        """The Get ends before it has a plan (its call was cancelled while it waited for room)."""
        self._enter(GetPhase.DROPPED, GetPhase.PLANNING, GetPhase.WAITING_FOR_ROOM)

    # -- reads -----------------------------------------------------------

    @property
    def pending(self) -> bool:
        """Whether reads (its own, or others' it waits on) stand between the plan and its settling."""
        return bool(self._reading or self._waiting)

    def loads_done(self, loads: Sequence[Transfer], outcomes: Sequence[LoadOutcome] | None
                   ) -> list[tuple[bytes, bytes, int]]:
        """Some of the plan's own reads are over, with an outcome each; None: they never ran (their
        job was cancelled, or raised: a bug), and each block keeps its copy below.

        Returns the removals now queued (a block whose read failed is lost, and what that cut
        off with it), taken for the driver to journal before the Get settles; [] when the reads
        never ran (whatever is queued stays for the next taker)."""
        blocks = {load.block for load in loads}
        check(self.phase is GetPhase.READING and blocks <= self._reading, "loads_done for reads the Get is not waiting on")
        self._reading -= blocks
        if outcomes is None:
            self.engine.give_up_loads(loads)
            return []
        check(len(outcomes) == len(loads), "one outcome per load")
        self.engine.finish_loads(loads, [outcome == LoadOutcome.OK for outcome in outcomes])
        self._failed.update((load.block, outcome) for load, outcome in zip(loads, outcomes)
                            if outcome != LoadOutcome.OK)
        return self.mover.take_removals()

    def wait_done(self, block: Block, outcome: LoadOutcome | None) -> None:
        """A read the plan waits on (another request's) is over; None: how is not known."""
        check(self.phase in (GetPhase.READING, GetPhase.DROPPED) and block in self._waiting,
              "wait_done for {!r}, which the Get does not wait on", block)
        self._waiting.discard(block)
        if outcome is not None and outcome != LoadOutcome.OK:
            self._failed[block] = outcome

    # -- the end -----------------------------------------------------------

    def settle(self) -> Served:
        """Every read is over: the blocks it serves, pinned by its lease (none if the lease ended),
        and why it serves fewer than it found; its own pins go."""
        check(self.phase is GetPhase.READING and not self.pending, "settle of a Get with reads still pending")
        plan = self.plan
        lease_ended = plan.lease is not None and plan.lease.ended
        served = self.engine.settle_get(plan)
        self._enter(GetPhase.SETTLED, GetPhase.READING)
        if lease_ended:
            return Served([], GetCut.LEASE_ENDED)
        if len(served) == len(self._found):
            return Served(served, plan.cut)
        outcome = self._failed.get(self._found[len(served)])
        return Served(served, _CUT_BY_OUTCOME.get(outcome, GetCut.NONE))

    def drop(self) -> None:
        """The Get failed or was cancelled: once no read of its own runs into its slots, its lease
        and pins end. Reads of others it waited on may still report (wait_done), to no effect."""
        check(not self._reading, "a Get dropped while its own reads still run into its slots")
        self.engine.drop_get(self.plan)
        self._enter(GetPhase.DROPPED, GetPhase.READING)

    def abandon(self) -> None:
        """Its reads could not be started (the I/O thread is gone): nothing read, nothing lost."""
        self.engine.abandon_get(self.plan)
        self._reading.clear()
        self._waiting.clear()
        self._enter(GetPhase.DROPPED, GetPhase.READING)
