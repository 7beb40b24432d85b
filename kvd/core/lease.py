"""Leases: time-bounded pins a client holds through the API.

A lease owns block handles on behalf of one client. It ends when the client
releases it, when its deadline passes (the client died or forgot), or when
the daemon drains. Ending a lease releases its handles; for a write lease
that aborts every block not yet sealed. Nothing stays pinned forever: every
lease has a deadline, and the deadline has an upper bound.
"""

from __future__ import annotations

import enum
import heapq
from dataclasses import dataclass, field

from kvd.core.block import Block, BlockHandle
from kvd.errors import NotFound, PermissionDenied
from kvd.invariants import check


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

    def __init__(self, max_leases: int) -> None:
        check(max_leases > 0, "max_leases must be positive")
        self.max_leases = max_leases
        self._leases: dict[int, Lease] = {}
        self._deadlines: list[tuple[int, int]] = []  # (deadline_ms, lease_id), lazily pruned
        self._next_id = 1
        self.expired_total = 0

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

    def find(self, lease_id: int, client_id: str) -> Lease:
        """The live lease `lease_id` owned by `client_id`, or a precise error."""
        lease = self._leases.get(lease_id)
        if lease is None:
            raise NotFound(f"lease {lease_id} does not exist (released or expired)")
        if lease.client_id != client_id:
            raise PermissionDenied(f"lease {lease_id} belongs to another client")
        return lease

    def renew(self, lease: Lease, deadline_ms: int) -> None:
        lease.deadline_ms = deadline_ms
        heapq.heappush(self._deadlines, (deadline_ms, lease.lease_id))

    def close(self, lease: Lease) -> None:
        check(self._leases.get(lease.lease_id) is lease, "close of a lease not in the table")
        del self._leases[lease.lease_id]
        lease.end()

    def expire(self, now_ms: int) -> list[Lease]:
        """End and return every lease whose deadline is at or before now."""
        expired: list[Lease] = []
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now_ms:
            deadline_ms, lease_id = heapq.heappop(deadlines)
            lease = self._leases.get(lease_id)
            # Stale heap entries: the lease ended or was renewed since.
            if lease is None or lease.deadline_ms != deadline_ms:
                continue
            self.close(lease)
            expired.append(lease)
        self.expired_total += len(expired)
        return expired

    def next_deadline_ms(self) -> int | None:
        while self._deadlines:
            deadline_ms, lease_id = self._deadlines[0]
            lease = self._leases.get(lease_id)
            if lease is not None and lease.deadline_ms == deadline_ms:
                return deadline_ms
            heapq.heappop(self._deadlines)
        return None

    def close_all(self) -> int:
        leases = list(self._leases.values())
        for lease in leases:
            self.close(lease)
        return len(leases)

    def verify(self) -> None:
        for lease_id, lease in self._leases.items():
            check(lease.lease_id == lease_id, "lease stored under a wrong id")
            check(not lease.ended, "ended lease still in the table")
