"""A lease used past the call that took it, its rules written once (issue 36 item 1).

Two kinds of request keep working on a lease's blocks after the event loop
has moved on, and each had its rules copied into every handler that did
it, where they drifted (one fetch path wrote into reserved slots without
holding their lease: the sweeper could free them under the bytes):

* `Fill`: slots reserved under a write lease, filled by bytes that land
  later (SaveLayers' device copies, a cluster fetch's stream or NIXL READ).
  The lease is held from the start (LeaseTable.hold: it cannot end, and
  its slots cannot be freed or reused, while bytes may land), and the fill
  ends exactly once:

      LANDING --landed(verified)--> KEPT    (the verified prefix sealed, the rest aborted)
         |   \\--landed, lease ended-> LAPSED (nothing sealed: its slots went with the lease)
         \\--let_lapse--------------> LET_LAPSE (left reserved until the lease's deadline)

  A lease ended for the client meanwhile (its deadline, a Release, the
  drain) ends for real at the unhold; so does one whose deadline passed
  with no sweep since. Either way nothing is sealed.
* `ReadPin`: a read lease a request took for itself alone (an inline Get's
  copy, a peer's ReadBlocks or PinBlocks, a LoadLayers' device copies). It
  is closed once, by the request, unless it ended first (its deadline, the
  drain); held (`hold`) while copies read its slots after the call
  returned, so that it cannot end under them.

No clock: the driver passes `now_ms`, as for every engine call.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from kvd.core.lease import Lease, LeaseKind
from kvd.invariants import check

if TYPE_CHECKING:
    from kvd.core.engine import Engine


class FillPhase(enum.Enum):
    LANDING = "bytes landing"
    KEPT = "its verified prefix sealed, the rest aborted"
    LAPSED = "its lease ended while the bytes landed"
    LET_LAPSE = "left reserved until its lease's deadline"


class Fill:
    """Slots reserved under `lease`, being filled by bytes that land after the reserving call."""

    def __init__(self, engine: Engine, lease: Lease) -> None:
        check(lease.kind is LeaseKind.WRITE and len(lease.handles) > 0, "a fill of a lease that reserved nothing")
        engine.leases.hold(lease)
        self.engine = engine
        self.lease = lease
        self.phase = FillPhase.LANDING

    @property
    def lapsed(self) -> bool:
        """Whether its lease has ended, for the client at least: whatever lands is not kept."""
        return self.lease.closing or self.lease.ended

    def _end(self, phase: FillPhase) -> None:
        check(self.phase is FillPhase.LANDING, "a fill cannot go from {} to {}", self.phase.value, phase.value)
        self.phase = phase
        self.engine.leases.unhold(self.lease)  # a lease that ended meanwhile ends here, its slots freed

    def landed(self, verified: int, now_ms: int) -> int:
        """No more bytes land, and the first `verified` reserved blocks hold checked ones: seal them,
        abort the rest, and answer how many were sealed; 0, sealing nothing, when the lease ended
        meanwhile or its deadline has passed (`phase` then says LAPSED)."""
        self._end(FillPhase.KEPT)
        if not self.lease.ended:
            self.engine.expire(now_ms)  # as the commit would, first: a lease past its deadline ends now
        if self.lease.ended:
            self.phase = FillPhase.LAPSED
            return 0
        return self.engine.seal_prefix(self.lease, verified, now_ms)

    def abandon(self, now_ms: int) -> None:
        """The bytes stopped landing and none are kept (the copy failed or was cancelled): every
        reserved block is aborted, at once."""
        self.landed(0, now_ms)

    def let_lapse(self) -> None:
        """Stop holding, sealing and aborting nothing: for a failure after which bytes may still
        land a while, the slots stay reserved until the lease's deadline ends it."""
        self._end(FillPhase.LET_LAPSE)


class ReadPin:
    """A read lease (or None: nothing pinned) a request took for itself, closed once by `release`."""

    def __init__(self, engine: Engine, lease: Lease | None) -> None:
        check(lease is None or lease.kind is LeaseKind.READ, "a read pin of a write lease")
        self.engine = engine
        self.lease = lease
        self.held = False
        self.released = False

    def hold(self) -> ReadPin:
        """Its slots are read after the call returns (a device copy): the lease does not end,
        whatever ends it meanwhile, until `release`."""
        check(not self.held and not self.released, "a read pin held twice, or after its release")
        if self.lease is not None:
            self.engine.leases.hold(self.lease)
        self.held = True
        return self

    def release(self) -> None:
        """The request is done with the blocks: the lease ends, unless it already has."""
        check(not self.released, "a read pin released twice")
        self.released = True
        lease = self.lease
        if lease is None:
            return
        if self.held:
            self.engine.leases.unhold(lease)
        if not lease.ended:
            self.engine.leases.close(lease)
