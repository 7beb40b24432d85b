"""Leases: time-bounded pins a client holds through the API.

A lease owns block handles on behalf of one client. It ends when the client
releases it, when its deadline passes (the client died or forgot), or when
the daemon drains. Ending a lease releases its handles; for a write lease
that aborts every block not yet sealed. Nothing stays pinned forever: every
lease has a deadline, and the deadline has an upper bound.

"The client died" is known only through the deadline: a client id is a
name the client chooses, not a connection, and a lease outlives the call
that took it (the client copies out, then releases), so there is no
connection whose end the daemon could take for the client's death. A
client that is killed keeps its pins until its leases' deadlines pass
(leases.default_ms, 30 s by default, at most leases.max_ms); the daemon's
sweeper then ends them and their blocks can be evicted again. Clients that
read or write for longer renew their leases.

A request that works on a lease's blocks after its own call returned to
the event loop (SaveLayers copying into its reserved slots, LoadLayers
copying out of its pinned ones, on a device stream) holds the lease
(`hold`): until the last hold goes, the lease does not end, whatever
ends it meanwhile (the client's Release, its deadline, the drain); it is
gone for the client at once (NOT_FOUND) and ends for real at `unhold`. So
no slot is freed, or reused, while a copy still runs into or out of it.

Each client's pins are counted (`pins_of`): the blocks its open leases pin,
a write lease's pinned parent included. A request that would take a client
past `max_pins_per_client` is refused before anything changes, so one
client cannot pin the whole host tier while others wait.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, field

from kvd.core.block import Block, BlockHandle
from kvd.errors import NotFound, PermissionDenied, PinCapExceeded
from kvd.invariants import check


# A client id "<scope>\x00<name>" belongs to a scope: the server scopes the
# client ids of each tenant by its name (kvd.server.auth), and a lease of
# another scope is NOT_FOUND, as if it did not exist. Unscoped ids share "".
SCOPE_SEPARATOR = "\x00"


def scope_of(client_id: str) -> str:
    scope, separator, _ = client_id.partition(SCOPE_SEPARATOR)
    return scope if separator else ""


class LeaseKind(enum.IntEnum):
    READ = 1
    WRITE = 2


@dataclass(slots=True, eq=False)
class Lease:
    lease_id: int
    kind: LeaseKind
    client_id: str
    namespace_id: bytes
    deadline_ms: int
    # Handles in chain order. For WRITE leases, the writer handles.
    handles: list[BlockHandle] = field(default_factory=list)
    # WRITE leases: a read pin on the parent of the first reserved block, so
    # the prefix being extended cannot be evicted while the client writes.
    parent_handle: BlockHandle | None = None
    ended: bool = False
    # Blocks this lease pins (its unreleased handles, parent included),
    # charged to its client in LeaseTable.pins_of.
    pinned: int = 0
    # Requests working on its blocks now (LeaseTable.hold); while any does,
    # an end (release, expiry) only marks it `closing`, and unhold ends it.
    holds: int = 0
    closing: bool = False

    def blocks(self) -> list[Block]:
        return [handle.block for handle in self.handles if not handle.released]

    def end(self) -> None:
        """Release every handle, tail first (children before parents)."""
        if self.ended:
            return
        self.ended = True
        for handle in reversed(self.handles):
            handle.release()
        if self.parent_handle is not None:
            self.parent_handle.release()


class LeaseTable:
    """Live leases by id, with a deadline heap for expiry."""

    def __init__(self, max_leases: int, max_pins_per_client: int = 65536) -> None:
        check(max_leases > 0, "max_leases must be positive")
        check(max_pins_per_client > 0, "max_pins_per_client must be positive")
        self.max_leases = max_leases
        self.max_pins_per_client = max_pins_per_client
        self._leases: dict[int, Lease] = {}
        self._deadlines: list[tuple[int, int]] = []  # (deadline_ms, lease_id), lazily pruned
        self._next_id = 1
        self.expired_total = 0
        # Blocks pinned per client, over its open leases; clients at 0 are
        # dropped, so the dict holds only clients that pin something.
        self._client_pins: dict[str, int] = {}
        self.pinned_total = 0
        self.pin_cap_rejections = 0

    def __len__(self) -> int:
        return len(self._leases)

    def __iter__(self):
        return iter(list(self._leases.values()))

    def full(self) -> bool:
        return len(self._leases) >= self.max_leases

    def open(self, kind: LeaseKind, client_id: str, namespace_id: bytes, deadline_ms: int) -> Lease:
        check(not self.full(), "lease table full; the caller must check first")
        lease = Lease(self._next_id, kind, client_id, namespace_id, deadline_ms)
        self._next_id += 1
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._deadlines, (deadline_ms, lease.lease_id))
        return lease

    def pins_of(self, client_id: str) -> int:
        """Blocks the open leases of `client_id` pin."""
        return self._client_pins.get(client_id, 0)

    def pinning_clients(self) -> int:
        return len(self._client_pins)

    def max_client_pins(self) -> int:
        """The most blocks any one client pins (O(clients); for metrics)."""
        return max(self._client_pins.values(), default=0)

    def check_pin_room(self, client_id: str, count: int) -> None:
        """Raise PinCapExceeded (RESOURCE_EXHAUSTED) if pinning `count` more blocks would take
        `client_id` past the cap. Callers check before changing anything."""
        held = self._client_pins.get(client_id, 0)
        if held + count > self.max_pins_per_client:
            self.pin_cap_rejections += 1
            raise PinCapExceeded(
                f"client {client_id!r} pins {held} blocks through its leases; {count} more would pass the cap "
                f"of {self.max_pins_per_client} blocks per client (leases.max_pins_per_client): release leases first"
            )

    def charge(self, lease: Lease, count: int) -> None:
        """`lease` took `count` more pins."""
        check(count >= 0 and not lease.ended, "charge of a negative count or an ended lease")
        if count:
            lease.pinned += count
            self.pinned_total += count
            self._client_pins[lease.client_id] = self._client_pins.get(lease.client_id, 0) + count

    def refund(self, lease: Lease, count: int) -> None:
        """`lease` released `count` of its pins."""
        check(0 <= count <= lease.pinned, "refund of {} pins from a lease holding {}", count, lease.pinned)
        if count:
            lease.pinned -= count
            self.pinned_total -= count
            remaining = self._client_pins[lease.client_id] - count
            if remaining:
                self._client_pins[lease.client_id] = remaining
            else:
                del self._client_pins[lease.client_id]

    def find(self, lease_id: int, client_id: str) -> Lease:
        """The live lease `lease_id` owned by `client_id`, or a precise error."""
        lease = self._leases.get(lease_id)
        if lease is not None and lease.closing:
            lease = None  # ended, for the client: only a request's copy still holds it
        if lease is None or (lease.client_id != client_id and scope_of(lease.client_id) != scope_of(client_id)):
            # Another scope's (tenant's) lease is not even said to exist.
            raise NotFound(f"lease {lease_id} does not exist (released or expired)")
        if lease.client_id != client_id:
            raise PermissionDenied(f"lease {lease_id} belongs to another client")
        return lease

    def renew(self, lease: Lease, deadline_ms: int) -> None:
        lease.deadline_ms = deadline_ms
        heapq.heappush(self._deadlines, (deadline_ms, lease.lease_id))

    def close(self, lease: Lease) -> None:
        """End the lease; while a request holds it, only mark it closing (unhold ends it)."""
        check(self._leases.get(lease.lease_id) is lease, "close of a lease not in the table")
        if lease.holds:
            lease.closing = True
            return
        del self._leases[lease.lease_id]
        self.refund(lease, lease.pinned)
        lease.end()

    def hold(self, lease: Lease) -> None:
        """A request works on the lease's blocks from now until its unhold: the lease does not end before."""
        check(self._leases.get(lease.lease_id) is lease and not lease.closing, "hold of an ended lease")
        lease.holds += 1

    def unhold(self, lease: Lease) -> None:
        """The request is done with the lease's blocks; a lease closed meanwhile ends now."""
        check(lease.holds > 0 and self._leases.get(lease.lease_id) is lease, "unhold of a lease nobody holds")
        lease.holds -= 1
        if lease.holds == 0 and lease.closing:
            self.close(lease)

    def expire(self, now_ms: int) -> list[Lease]:
        """End and return every lease whose deadline is at or before now."""
        expired: list[Lease] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now_ms:
            deadline_ms, lease_id = heapq.heappop(deadlines)
            lease = self._leases.get(lease_id)
            # Stale heap entries: the lease ended (or is ending) or was renewed since.
            if lease is None or lease.closing or lease.deadline_ms != deadline_ms:
                continue
            self.close(lease)
            expired.append(lease)
        self.expired_total += len(expired)
        return expired

    def close_all(self) -> int:
        leases = [lease for lease in self._leases.values() if not lease.closing]
        for lease in leases:
            self.close(lease)
        return len(leases)

    def verify(self) -> None:
        client_pins: dict[str, int] = {}
        for lease_id, lease in self._leases.items():
            check(lease.lease_id == lease_id, "lease stored under a wrong id")
            check(not lease.ended, "ended lease still in the table")
            check(lease.holds >= 0 and (lease.holds or not lease.closing), "lease {} closing with no hold", lease_id)
            held = sum(not handle.released for handle in lease.handles)
            held += lease.parent_handle is not None and not lease.parent_handle.released
            check(lease.pinned == held, "lease {} charged {} pins but holds {}", lease_id, lease.pinned, held)
            if lease.pinned:
                client_pins[lease.client_id] = client_pins.get(lease.client_id, 0) + lease.pinned
        check(client_pins == self._client_pins, "pins per client drifted from the leases")
        check(self.pinned_total == sum(client_pins.values()), "pinned total drifted from the leases")
