"""Put: reserve writable slots for a chain, then commit (seal) or abort them.

A client reserves the keys of a chain it is about to write: stored keys
are EXISTS, keys another client is writing stop the walk (IN_FLIGHT),
missing keys get a host slot (RESERVED) until none can be freed
(NO_SPACE). The reserved keys are one contiguous run under one write
lease; the client writes their bytes into the slots and commits, which
seals them (discoverable from then on) or aborts the rest of the chain. A
write that kvd itself cut short seals the prefix it finished and aborts
the rest (`seal_prefix`).
Every check runs before any state changes.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvd.core.block import NO_SLOT, Block, BlockState
from kvd.core.lease import Lease, LeaseKind
from kvd.core.namespaces import NamespaceState
from kvd.core.component import EngineComponent
from kvd.core.radix import PrefixIndex
from kvd.core.requests import (CommitRequest, KeysRequest, check_client, check_keys, check_lease_room,
                                granted_lease_ms, parent_block)
from kvd.core.tier import TierId
from kvd.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvd.invariants import check


class ReserveStatus(enum.IntEnum):
    """Outcome of reserving one key; values match kvd.v1.ReserveStatus."""

    RESERVED = 1
    EXISTS = 2
    IN_FLIGHT = 3
    NO_SPACE = 4


@dataclass(slots=True)
class ReserveResult:
    lease: Lease | None
    statuses: list[ReserveStatus]
    # Host slot of each key; NO_SLOT where the status is not RESERVED.
    slots: list[int]


class Committed(NamedTuple):
    """A commit's outcome: how many blocks it sealed and aborted, and the sealed ones in chain
    order (what a durable Put then waits on)."""

    sealed: int
    aborted: int
    blocks: list[Block]


class Puts(EngineComponent):
    def reserve(self, request: KeysRequest) -> ReserveResult:
        """Reserve writable slots for the keys of a chain not yet stored.

        Walks the chain from `parent_key`: stored keys are EXISTS, keys
        another client is writing stop the walk (IN_FLIGHT), missing keys get
        a slot (RESERVED) until none can be freed (NO_SPACE). The reserved
        keys are always one contiguous run, held by one write lease.
        """
        namespace_id, client_id, keys, now_ms = request.namespace_id, request.client_id, request.keys, request.now_ms
        state = self.namespaces.namespace(namespace_id)
        check_keys(self.limits, keys, "keys")
        check_client(client_id)
        if len(set(keys)) != len(keys):
            raise InvalidArgument("keys contain duplicates; a chain never repeats a key")
        deadline_ms = now_ms + granted_lease_ms(self.limits, request.lease_ms)
        self.leases.expire(now_ms)
        index = state.index
        # Validate the whole walk before changing anything.
        existing, parent = self._stored_run(index, keys, parent_block(index, request.parent_key))
        first_missing = len(existing)
        in_flight = first_missing < len(keys) and index.get(keys[first_missing]) is not None
        if not in_flight and first_missing < len(keys):
            self._check_room(state, client_id, keys, first_missing, parent)
        self.blocks.touch_prefix(existing)
        self.blocks.note_sightings(existing)  # a Put of stored blocks: seen again
        statuses = [ReserveStatus.EXISTS] * first_missing
        slots = [NO_SLOT] * first_missing
        if in_flight:
            # Someone else is writing the next block: nothing to do from here.
            statuses.extend([ReserveStatus.IN_FLIGHT] * (len(keys) - first_missing))
            slots.extend([NO_SLOT] * (len(keys) - first_missing))
            return ReserveResult(None, statuses, slots)
        if first_missing == len(keys):
            return ReserveResult(None, statuses, slots)
        lease = self._reserve_missing(state, client_id, keys[first_missing:], parent, deadline_ms, statuses, slots)
        return ReserveResult(lease, statuses, slots)

    @staticmethod
    def _stored_run(index: PrefixIndex, keys: Sequence[bytes], parent: Block | None) -> tuple[list[Block], Block | None]:
        """The sealed blocks `keys` starts with, under `parent`, and the last of them (or `parent`).

        Stops at the first key that is missing, being written by another
        client, or a tombstone waiting for its readers."""
        existing: list[Block] = []
        for position, key in enumerate(keys):
            node = index.get(key)
            if node is None:
                break
            if node.parent is not parent:
                raise InvalidArgument(
                    f"keys[{position}] is stored under a different parent; keys must be a chain from parent_key"
                )
            if node.state != BlockState.SEALED:
                break
            existing.append(node)
            parent = node
        return existing, parent

    def _check_room(self, state: NamespaceState, client_id: str, keys: Sequence[bytes], first_missing: int,
                    parent: Block | None) -> None:
        """The last checks before slots are reserved for keys[first_missing:]; past them the request goes ahead."""
        index = state.index
        # The keys after the first missing one must be missing too: a stored
        # key cannot be the child of a block that does not exist yet. Checked
        # before anything is touched or allocated (allocating evicts), so a
        # rejection changes nothing.
        for position in range(first_missing + 1, len(keys)):
            if keys[position] in index.nodes:
                raise InvalidArgument(
                    f"keys[{position}] is stored under a different parent; keys must be a chain from parent_key"
                )
        check_lease_room(self.leases)
        # At most every missing key, and the parent pinned under them.
        self.leases.check_pin_room(client_id, len(keys) - first_missing + (parent is not None))
        if state.quota is not None:
            slot_bytes = self.host.pool.classes[state.index.host_class].slot_bytes
            self.allocator.make_quota_room(state.quota, len(keys) - first_missing, keep=parent, slot_bytes=slot_bytes)

    def _reserve_missing(self, state: NamespaceState, client_id: str, missing: Sequence[bytes],
                         parent: Block | None, deadline_ms: int, statuses: list[ReserveStatus],
                         slots: list[int]) -> Lease:
        """Give each missing key a host slot under one write lease, until none can be had."""
        index = state.index
        lease = self.leases.open(LeaseKind.WRITE, client_id, state.namespace_id, deadline_ms)
        if parent is not None:
            lease.parent_handle = self.blocks.acquire(parent)
        for position, key in enumerate(missing):
            # Checked missing above; evicting only ever removes keys.
            check(key not in index.nodes, "reserved key appeared in the index during reserve")
            slot = self.allocator.allocate(index.tenant, slot_class=self.host.pool.classes[index.host_class])
            if slot == NO_SLOT:
                statuses.extend([ReserveStatus.NO_SPACE] * (len(missing) - position))
                slots.extend([NO_SLOT] * (len(missing) - position))
                break
            node = index.insert(key, parent)
            self.blocks.set_host_slot(node, slot)
            lease.handles.append(self.blocks.writer_handle(node))
            self.host.counters.reserved += 1
            statuses.append(ReserveStatus.RESERVED)
            slots.append(slot)
            parent = node
        self.leases.charge(lease, len(lease.handles) + (lease.parent_handle is not None))
        if not lease.handles:
            self.leases.close(lease)
            pool = self.host.pool
            if len(pool.classes) > 1:
                raise ResourceExhausted(
                    f"host tier is full: no slot of {pool.classes[state.index.host_class].slot_bytes} bytes can be "
                    f"freed (every page of the {pool.page_count} holds blocks that are pinned or being written)")
            raise ResourceExhausted(f"host tier is full: all {self.host.slot_count} slots are pinned or being written")
        return lease

    def commit(self, request: CommitRequest) -> Committed:
        """Seal `keys` (all, when both lists are empty) and abort `abort_keys`.

        Aborting a block aborts the rest of the chain after it. All checks
        run before any block changes.
        """
        namespace_id, lease_id, keys, abort_keys = (request.namespace_id, request.lease_id, request.keys,
                                                    request.abort_keys)
        self.namespaces.namespace(namespace_id)
        check_keys(self.limits, keys, "keys")
        check_keys(self.limits, abort_keys, "abort_keys")
        self.leases.expire(request.now_ms)
        lease = self.leases.find(lease_id, request.client_id)
        if lease.kind != LeaseKind.WRITE:
            raise FailedPrecondition(f"lease {lease_id} is a read lease; only write leases are committed")
        if lease.namespace_id != namespace_id:
            raise InvalidArgument(f"lease {lease_id} belongs to another namespace")
        positions = _commit_positions(lease, keys, abort_keys)
        if not keys and not abort_keys:
            keys = [handle.key for handle in lease.handles if handle.writable]
        to_seal = sorted(positions[key] for key in keys)
        abort_from = min((positions[key] for key in abort_keys), default=len(lease.handles))
        _check_chain_order(lease, to_seal, abort_from)
        aborted = self._abort_from(lease, abort_from)
        sealed = [lease.handles[position].block for position in to_seal]
        self._seal(namespace_id, lease, to_seal)
        if not any(handle.writable for handle in lease.handles):
            self.leases.close(lease)
        return Committed(len(to_seal), aborted, sealed)

    def seal_prefix(self, lease: Lease, count: int, now_ms: int) -> int:
        """Seal the first `count` blocks a write lease reserved and abort the rest: a write cut
        short (a fetch from a peer whose bytes stopped verifying, a SaveLayers whose copy failed)
        leaves a sealed prefix and misses after it, never holes. Returns how many were sealed."""
        keys = [handle.key for handle in lease.handles]
        # An empty commit would seal every block the lease reserved.
        check(0 <= count <= len(keys) and len(keys) > 0, "seal {} of the {} blocks of a reservation", count,
              len(keys))
        return self.commit(CommitRequest(lease.namespace_id, lease.client_id, lease.lease_id, now_ms,
                                         keys=keys[:count], abort_keys=keys[count:])).sealed

    def _abort_from(self, lease: Lease, abort_from: int) -> int:
        """Abort the chain from position `abort_from`, tail first; how many were aborted."""
        aborted = 0
        for position in range(len(lease.handles) - 1, abort_from - 1, -1):
            handle = lease.handles[position]
            if not handle.released:
                handle.release()
                aborted += 1
        self.leases.refund(lease, aborted)
        return aborted

    def _seal(self, namespace_id: bytes, lease: Lease, to_seal: list[int]) -> None:
        """Seal these positions of the lease's chain (in order) and announce them."""
        if not to_seal:
            return
        for position in to_seal:
            lease.handles[position].seal()
        # One chain: its first block's parent is sealed already.
        first = lease.handles[to_seal[0]].block.parent
        self.blocks.events.stored(namespace_id, [lease.handles[position].key for position in to_seal],
                                  first.key if first is not None else b"", TierId.HOST)


def _commit_positions(lease: Lease, keys: Sequence[bytes], abort_keys: Sequence[bytes]) -> dict[bytes, int]:
    """Each key's position in the lease's chain, once every key is checked to be committable or abortable."""
    positions = {handle.key: position for position, handle in enumerate(lease.handles)}
    for field_name, requested in (("keys", keys), ("abort_keys", abort_keys)):
        for key in requested:
            if key not in positions:
                raise InvalidArgument(
                    f"{field_name} has key {key.hex()[:16]}... that is not part of lease {lease.lease_id}")
    if len(set(keys)) != len(keys) or len(set(abort_keys)) != len(abort_keys):
        raise InvalidArgument("keys or abort_keys contain duplicates")
    if set(keys) & set(abort_keys):
        raise InvalidArgument("a key is both committed and aborted")
    for key in keys:
        handle = lease.handles[positions[key]]
        if handle.released:
            raise FailedPrecondition(f"block {key.hex()[:16]}... was aborted in lease {lease.lease_id}")
        if not handle.writable:
            raise FailedPrecondition(f"block {key.hex()[:16]}... is already committed")
    return positions


def _check_chain_order(lease: Lease, to_seal: list[int], abort_from: int) -> None:
    """The lease is one chain: a block may be sealed only if every earlier
    block is sealed already or sealed by the same call, and never after an
    aborted one; nothing committed may be aborted."""
    sealing = set(to_seal)
    first_unsealed_gap = None
    for position, handle in enumerate(lease.handles):
        if position in sealing:
            if position >= abort_from:
                raise FailedPrecondition("cannot commit a block after an aborted block of the same chain")
            if first_unsealed_gap is not None:
                raise FailedPrecondition(
                    f"cannot commit keys[{position}] of the lease before its parent (position {first_unsealed_gap})"
                )
        elif handle.writable and first_unsealed_gap is None:
            first_unsealed_gap = position
    for position in range(abort_from, len(lease.handles)):
        if not lease.handles[position].writable and not lease.handles[position].released:
            raise FailedPrecondition(f"cannot abort: position {position} of the chain is already committed")
