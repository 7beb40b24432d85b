"""The engine: the one owner of kvd's block state.

Everything that decides which block lives where is here and is synchronous:
namespaces and their prefix indexes, the host tier's slot bookkeeping and
eviction policy, block handles and client leases. The engine never touches
payload bytes, never reads a clock (callers pass `now_ms`) and never does
I/O, so the daemon, the tests and a simulator drive exactly the same code.

Concurrency: the daemon calls the engine only from its event-loop thread
and never awaits in the middle of an engine call, so every call is atomic
with respect to every other; no locks exist to get wrong.

Errors: bad client input raises a `kvd.errors.KvdError` *before* any state
changes, so a rejected request never alters stored data. Inconsistent
internal state raises `InvariantError` and is never caught.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from kvd.core.block import NO_SLOT, Block, BlockHandle, BlockState
from kvd.core.keys import KEY_BYTES, NamespaceSpec
from kvd.core.lease import Lease, LeaseKind, LeaseTable
from kvd.core.policy import EvictionPolicy, make_policy
from kvd.core.radix import PrefixIndex
from kvd.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
from kvd.invariants import check


class ReserveStatus(enum.IntEnum):
    """Outcome of reserving one key; values match kvd.v1.ReserveStatus."""

    RESERVED = 1
    EXISTS = 2
    IN_FLIGHT = 3
    NO_SPACE = 4


class TierId(enum.IntEnum):
    """Values match kvd.v1.Tier."""

    DEVICE = 1
    HOST = 2
    DISK = 3
    REMOTE = 4


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_batch_keys: int = 65536
    lease_ms_default: int = 30_000
    lease_ms_max: int = 600_000
    max_leases: int = 65536
    max_namespaces: int = 1024


@dataclass(slots=True, eq=False)
class NamespaceState:
    namespace_id: bytes
    spec: NamespaceSpec
    block_bytes: int
    index: PrefixIndex
    lookup_hits: int = 0
    lookup_misses: int = 0
    get_hits: int = 0
    get_misses: int = 0


@dataclass(slots=True)
class ReserveResult:
    lease: Lease | None
    statuses: list[ReserveStatus]
    # Host slot of each key; NO_SLOT where the status is not RESERVED.
    slots: list[int]


@dataclass(slots=True)
class HostCounters:
    evictions: int = 0
    reserved: int = 0
    sealed: int = 0
    aborted: int = 0
    deleted: int = 0


class HostPool:
    """Slot bookkeeping of the host tier (the bytes live in kvd.tiers.host).

    Empty slots come first from `free_slots`; only when none is left is the
    policy's victim evicted and its slot reused, so cached blocks stay
    discoverable as long as possible.
    """

    def __init__(self, slot_count: int, slot_bytes: int, policy: EvictionPolicy) -> None:
        check(slot_count > 0 and slot_bytes > 0, "host pool needs slots")
        self.slot_count = slot_count
        self.slot_bytes = slot_bytes
        self.policy = policy
        # Popped from the end: slot 0 is handed out first. The int objects
        # are made here, once, and move between this stack and blocks.
        self.free_slots: list[int] = list(range(slot_count - 1, -1, -1))
        self.owners: list[Block | None] = [None] * slot_count
        # Payload bytes of resident blocks (each block's own size).
        self.used_bytes = 0
        self.counters = HostCounters()

    @property
    def capacity_bytes(self) -> int:
        return self.slot_count * self.slot_bytes

    @property
    def occupied_bytes(self) -> int:
        """Capacity taken: whole slots, however small the blocks in them."""
        return self.resident_blocks * self.slot_bytes

    @property
    def resident_blocks(self) -> int:
        return self.slot_count - len(self.free_slots)

    def verify(self) -> None:
        self.policy.verify()
        check(len(set(self.free_slots)) == len(self.free_slots), "slot listed free twice")
        for slot in self.free_slots:
            check(self.owners[slot] is None, f"free slot {slot} has an owner")
        for slot, owner in enumerate(self.owners):
            if owner is not None:
                check(owner.host_slot == slot, f"{owner!r} does not know its slot {slot}")
                check(owner.state != BlockState.REMOVED, f"removed {owner!r} owns slot {slot}")


class Engine:
    def __init__(
        self,
        *,
        host_slot_count: int,
        host_slot_bytes: int,
        policy: str = "lru",
        limits: EngineLimits | None = None,
    ) -> None:
        self.limits = limits or EngineLimits()
        self.host = HostPool(host_slot_count, host_slot_bytes, make_policy(policy))
        self.leases = LeaseTable(self.limits.max_leases)
        self._namespaces: dict[bytes, NamespaceState] = {}
        self.live_handles = 0
        self.leaked_handles = 0
        self.pinned_blocks = 0

    # ------------------------------------------------------------------
    # Namespaces

    def register_namespace(self, spec: NamespaceSpec) -> NamespaceState:
        """Register (idempotently) the cache identity `spec`."""
        spec.validate()
        namespace_id = spec.namespace_id()
        existing = self._namespaces.get(namespace_id)
        if existing is not None:
            return existing
        if len(self._namespaces) >= self.limits.max_namespaces:
            raise ResourceExhausted(f"too many namespaces (max {self.limits.max_namespaces})")
        if spec.block_bytes > self.host.slot_bytes:
            raise InvalidArgument(
                f"a block of this namespace is {spec.block_bytes} bytes, larger than the host slot "
                f"of {self.host.slot_bytes} bytes; use fewer tokens per block or raise host.slot_bytes"
            )
        state = NamespaceState(namespace_id, spec, spec.block_bytes, PrefixIndex(spec.model_id, spec.block_bytes))
        self._namespaces[namespace_id] = state
        return state

    def namespace(self, namespace_id: bytes) -> NamespaceState:
        if len(namespace_id) != KEY_BYTES:
            raise InvalidArgument(f"namespace_id must be {KEY_BYTES} bytes, got {len(namespace_id)}")
        state = self._namespaces.get(namespace_id)
        if state is None:
            raise NotFound(f"namespace {namespace_id.hex()[:16]}... is not registered; call RegisterNamespace first")
        return state

    def namespaces(self) -> list[NamespaceState]:
        return list(self._namespaces.values())

    # ------------------------------------------------------------------
    # Lookup and Get

    def lookup(self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes = b"") -> list[Block]:
        """Longest stored prefix of `keys` (a chain continuing `parent_key`).

        Marks the prefix as used. An unknown parent matches nothing.
        """
        state = self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        matched = self._match(state, keys, parent_key)
        self._touch_prefix(matched)
        state.lookup_hits += len(matched)
        state.lookup_misses += len(keys) - len(matched)
        return matched

    def get(
        self,
        namespace_id: bytes,
        client_id: str,
        keys: Sequence[bytes],
        lease_ms: int,
        now_ms: int,
        parent_key: bytes = b"",
    ) -> tuple[Lease | None, list[Block]]:
        """Pin the longest stored prefix of `keys` under a read lease."""
        state = self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        self._check_client(client_id)
        deadline_ms = now_ms + self._lease_ms(lease_ms)
        self.expire(now_ms)
        matched = self._match(state, keys, parent_key)
        if matched:
            self._check_lease_room()
        state.get_hits += len(matched)
        state.get_misses += len(keys) - len(matched)
        if not matched:
            return None, matched
        self._touch_prefix(matched)
        lease = self.leases.open(LeaseKind.READ, client_id, namespace_id, deadline_ms)
        lease.handles = [self._acquire(block) for block in matched]
        return lease, matched

    def peek(self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes = b"") -> list[Block]:
        """Like get without a lease: for callers that copy out before they return."""
        state = self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        matched = self._match(state, keys, parent_key)
        state.get_hits += len(matched)
        state.get_misses += len(keys) - len(matched)
        self._touch_prefix(matched)
        return matched

    # ------------------------------------------------------------------
    # Put: reserve, then commit

    def reserve(
        self,
        namespace_id: bytes,
        client_id: str,
        parent_key: bytes,
        keys: Sequence[bytes],
        lease_ms: int,
        now_ms: int,
    ) -> ReserveResult:
        """Reserve writable slots for the keys of a chain not yet stored.

        Walks the chain from `parent_key`: stored keys are EXISTS, keys
        another client is writing stop the walk (IN_FLIGHT), missing keys get
        a slot (RESERVED) until none can be freed (NO_SPACE). The reserved
        keys are always one contiguous run, held by one write lease.
        """
        state = self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        self._check_client(client_id)
        if len(set(keys)) != len(keys):
            raise InvalidArgument("keys contain duplicates; a chain never repeats a key")
        deadline_ms = now_ms + self._lease_ms(lease_ms)
        self.expire(now_ms)
        index = state.index
        parent = self._parent_block(index, parent_key)

        statuses: list[ReserveStatus] = []
        slots: list[int] = []
        # Validate the whole walk before changing anything.
        first_missing = len(keys)
        for position, key in enumerate(keys):
            node = index.get(key)
            if node is None:
                first_missing = position
                break
            if node.parent is not parent:
                raise InvalidArgument(
                    f"keys[{position}] is stored under a different parent; keys must be a chain from parent_key"
                )
            if node.state == BlockState.WRITABLE:
                first_missing = position
                break
            statuses.append(ReserveStatus.EXISTS)
            slots.append(NO_SLOT)
            parent = node
        in_flight = first_missing < len(keys) and index.get(keys[first_missing]) is not None
        if not in_flight and first_missing < len(keys):
            # The keys after the first missing one must be missing too: a
            # stored key cannot be the child of a block that does not exist
            # yet. Checked before the touch below and before any slot is
            # allocated (allocating evicts), so a rejection changes nothing.
            for position in range(first_missing + 1, len(keys)):
                if keys[position] in index.nodes:
                    raise InvalidArgument(
                        f"keys[{position}] is stored under a different parent; keys must be a chain from parent_key"
                    )
            self._check_lease_room()
        self._touch_prefix([index.nodes[key] for key in keys[:first_missing]])

        lease: Lease | None = None
        if in_flight:
            # Someone else is writing the next block: nothing to do from here.
            statuses.extend([ReserveStatus.IN_FLIGHT] * (len(keys) - first_missing))
            slots.extend([NO_SLOT] * (len(keys) - first_missing))
            return ReserveResult(None, statuses, slots)
        if first_missing == len(keys):
            return ReserveResult(None, statuses, slots)

        lease = self.leases.open(LeaseKind.WRITE, client_id, namespace_id, deadline_ms)
        if parent is not None:
            lease.parent_handle = self._acquire(parent)
        for position in range(first_missing, len(keys)):
            key = keys[position]
            # Checked missing above; evicting only ever removes keys.
            check(key not in index.nodes, "reserved key appeared in the index during reserve")
            slot = self._allocate_host_slot()
            if slot == NO_SLOT:
                statuses.extend([ReserveStatus.NO_SPACE] * (len(keys) - position))
                slots.extend([NO_SLOT] * (len(keys) - position))
                break
            node = index.insert(key, parent)
            if parent is not None:
                self._withdraw(parent)
            node.host_slot = slot
            self.host.owners[slot] = node
            self.host.used_bytes += state.block_bytes
            lease.handles.append(self._writer_handle(node))
            self.host.counters.reserved += 1
            statuses.append(ReserveStatus.RESERVED)
            slots.append(slot)
            parent = node
        if not lease.handles:
            self.leases.close(lease)
            raise ResourceExhausted(
                f"host tier is full: all {self.host.slot_count} slots are pinned or being written"
            )
        return ReserveResult(lease, statuses, slots)

    def commit(
        self,
        namespace_id: bytes,
        client_id: str,
        lease_id: int,
        keys: Sequence[bytes],
        abort_keys: Sequence[bytes],
        now_ms: int,
    ) -> tuple[int, int]:
        """Seal `keys` (all, when both lists are empty) and abort `abort_keys`.

        Aborting a block aborts the rest of the chain after it. Returns
        (sealed, aborted). All checks run before any block changes.
        """
        self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        self._check_keys(abort_keys, "abort_keys")
        self.expire(now_ms)
        lease = self.leases.find(lease_id, client_id)
        if lease.kind != LeaseKind.WRITE:
            raise FailedPrecondition(f"lease {lease_id} is a read lease; only write leases are committed")
        if lease.namespace_id != namespace_id:
            raise InvalidArgument(f"lease {lease_id} belongs to another namespace")
        positions = {handle.key: position for position, handle in enumerate(lease.handles)}
        for field_name, requested in (("keys", keys), ("abort_keys", abort_keys)):
            for key in requested:
                if key not in positions:
                    raise InvalidArgument(f"{field_name} has key {key.hex()[:16]}... that is not part of lease {lease_id}")
        if len(set(keys)) != len(keys) or len(set(abort_keys)) != len(abort_keys):
            raise InvalidArgument("keys or abort_keys contain duplicates")
        if set(keys) & set(abort_keys):
            raise InvalidArgument("a key is both committed and aborted")
        for key in keys:
            handle = lease.handles[positions[key]]
            if handle.released:
                raise FailedPrecondition(f"block {key.hex()[:16]}... was aborted in lease {lease_id}")
            if not handle.writable:
                raise FailedPrecondition(f"block {key.hex()[:16]}... is already committed")
        if not keys and not abort_keys:
            keys = [handle.key for handle in lease.handles if handle.writable]
        to_seal = {positions[key] for key in keys}
        abort_from = min((positions[key] for key in abort_keys), default=len(lease.handles))
        # The lease is one chain: a block may be sealed only if every earlier
        # block is sealed already or sealed by this same call. One pass.
        first_unsealed_gap = None
        for position, handle in enumerate(lease.handles):
            if position in to_seal:
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

        aborted = 0
        for position in range(len(lease.handles) - 1, abort_from - 1, -1):
            handle = lease.handles[position]
            if not handle.released:
                handle.release()
                aborted += 1
        for position in sorted(to_seal):
            lease.handles[position].seal()
        if not any(handle.writable for handle in lease.handles):
            self.leases.close(lease)
        return len(to_seal), aborted

    # ------------------------------------------------------------------
    # Release, renew, delete, expiry

    def release(self, client_id: str, lease_ids: Sequence[int]) -> int:
        self._check_client(client_id)
        if len(lease_ids) > self.limits.max_batch_keys:
            raise InvalidArgument(f"at most {self.limits.max_batch_keys} lease ids per call")
        leases = [self.leases.find(lease_id, client_id) for lease_id in lease_ids]
        if len({lease.lease_id for lease in leases}) != len(leases):
            raise InvalidArgument("lease_ids contain duplicates")
        for lease in leases:
            self.leases.close(lease)
        return len(leases)

    def renew(self, client_id: str, lease_id: int, lease_ms: int, now_ms: int) -> int:
        self._check_client(client_id)
        deadline_ms = now_ms + self._lease_ms(lease_ms)
        self.expire(now_ms)
        lease = self.leases.find(lease_id, client_id)
        self.leases.renew(lease, deadline_ms)
        return deadline_ms

    def delete(self, namespace_id: bytes, keys: Sequence[bytes]) -> tuple[int, int]:
        """Remove blocks and their descendants. Returns (deleted, pinned)."""
        state = self.namespace(namespace_id)
        self._check_keys(keys, "keys")
        deleted = pinned = 0
        for key in keys:
            node = state.index.get(key)
            if node is None:
                continue
            subtree = state.index.subtree(node)
            if any(block.ref_count > 0 or block.state != BlockState.SEALED for block in subtree):
                pinned += 1
                continue
            for block in subtree:
                self._remove_block(block, cold_parent=False)
            deleted += len(subtree)
        self.host.counters.deleted += deleted
        return deleted, pinned

    def expire(self, now_ms: int) -> int:
        return len(self.leases.expire(now_ms))

    def close_all_leases(self) -> int:
        return self.leases.close_all()

    # ------------------------------------------------------------------
    # In-process handles (tests, simulator, future tiers)

    def acquire(self, namespace_id: bytes, keys: Sequence[bytes]) -> list[BlockHandle]:
        """Read handles for the stored prefix of `keys`; the caller releases them."""
        matched = self.namespace(namespace_id).index.match(keys)
        return [self._acquire(block) for block in matched]

    # ------------------------------------------------------------------
    # HandleOwner: called back by BlockHandle

    def _seal(self, block: Block) -> None:
        check(block.parent is None or block.parent.state == BlockState.SEALED, "seal before the parent")
        block.state = BlockState.SEALED
        self.host.counters.sealed += 1

    def _drop_reference(self, block: Block, *, writer: bool) -> None:
        self.live_handles -= 1
        check(block.ref_count > 0, f"reference count underflow on {block!r}")
        block.ref_count -= 1
        if block.ref_count == 0:
            self.pinned_blocks -= 1
        if writer and block.state == BlockState.WRITABLE:
            check(block.ref_count == 0, "a writable block has exactly one reference")
            check(block.children == 0, "abort of a writable block with children: abort tail first")
            self.host.counters.aborted += 1
            self._remove_block(block, cold_parent=False)
            return
        check(block.state == BlockState.SEALED, f"reference dropped on {block!r}")
        self._maybe_admit(block, cold=False)

    def _count_leak(self) -> None:
        self.leaked_handles += 1

    # ------------------------------------------------------------------
    # Internals

    def _acquire(self, block: Block) -> BlockHandle:
        check(block.state == BlockState.SEALED, f"read handle on {block!r}")
        self._withdraw(block)
        if block.ref_count == 0:
            self.pinned_blocks += 1
        block.ref_count += 1
        self.live_handles += 1
        return BlockHandle(self, block, writer=False)

    def _writer_handle(self, block: Block) -> BlockHandle:
        check(block.ref_count == 0 and block.state == BlockState.WRITABLE, "writer handle on a used block")
        block.ref_count = 1
        self.pinned_blocks += 1
        self.live_handles += 1
        return BlockHandle(self, block, writer=True)

    def _allocate_host_slot(self) -> int:
        host = self.host
        if host.free_slots:
            return host.free_slots.pop()
        victim = host.policy.victim()
        if victim is None:
            return NO_SLOT
        slot = victim.host_slot
        # Evicting a leaf may make its parent a leaf: it goes next in line, so
        # a cold prefix is evicted from its tail inward.
        self._remove_block(victim, cold_parent=True)
        host.counters.evictions += 1
        check(host.free_slots[-1] == slot, "evicted slot not on top of the free stack")
        return host.free_slots.pop()

    def _remove_block(self, block: Block, *, cold_parent: bool) -> None:
        """Take a childless, unpinned block out of its index and its slot."""
        check(block.ref_count == 0, f"removal of pinned {block!r}")
        self._withdraw(block)
        slot = block.host_slot
        if slot != NO_SLOT:
            check(self.host.owners[slot] is block, "slot owner mismatch")
            self.host.owners[slot] = None
            self.host.free_slots.append(slot)
            self.host.used_bytes -= self._block_bytes(block)
            block.host_slot = NO_SLOT
        parent = block.index.remove(block)
        if parent is not None:
            self._maybe_admit(parent, cold=cold_parent)

    @staticmethod
    def _block_bytes(block: Block) -> int:
        return block.index.block_bytes

    def _maybe_admit(self, block: Block, *, cold: bool) -> None:
        if (
            block.state == BlockState.SEALED
            and block.ref_count == 0
            and block.children == 0
            and block.host_slot != NO_SLOT
            and block not in self.host.policy
        ):
            self.host.policy.admit(block, cold=cold)

    def _withdraw(self, block: Block) -> None:
        if block in self.host.policy:
            self.host.policy.remove(block)

    def _touch_prefix(self, matched: Sequence[Block]) -> None:
        # Only a prefix's last block can be a leaf, so only it can be a
        # candidate: touching it is O(1) however long the prefix.
        if matched:
            last = matched[-1]
            if last in self.host.policy:
                self.host.policy.touch(last)

    def _match(self, state: NamespaceState, keys: Sequence[bytes], parent_key: bytes) -> list[Block]:
        if not parent_key:
            return state.index.match(keys)
        if len(parent_key) != KEY_BYTES:
            raise InvalidArgument(f"parent_key must be empty or {KEY_BYTES} bytes, got {len(parent_key)}")
        parent = state.index.get(parent_key)
        if parent is None or parent.state != BlockState.SEALED:
            return []
        return state.index.match(keys, parent)

    def _parent_block(self, index: PrefixIndex, parent_key: bytes) -> Block | None:
        if not parent_key:
            return None
        if len(parent_key) != KEY_BYTES:
            raise InvalidArgument(f"parent_key must be empty or {KEY_BYTES} bytes, got {len(parent_key)}")
        parent = index.get(parent_key)
        if parent is None or parent.state != BlockState.SEALED:
            raise FailedPrecondition("parent_key is not a stored block; Put the prefix from an earlier point")
        return parent

    def _check_keys(self, keys: Sequence[bytes], field_name: str) -> None:
        if len(keys) > self.limits.max_batch_keys:
            raise InvalidArgument(f"{field_name} has {len(keys)} keys; at most {self.limits.max_batch_keys} per call")
        if keys and set(map(len, keys)) == {KEY_BYTES}:
            return
        for position, key in enumerate(keys):
            if len(key) != KEY_BYTES:
                raise InvalidArgument(f"{field_name}[{position}] is {len(key)} bytes; keys are {KEY_BYTES} bytes")

    @staticmethod
    def _check_client(client_id: str) -> None:
        if not client_id or len(client_id) > 128:
            raise InvalidArgument("client_id must be 1..128 characters")

    def _check_lease_room(self) -> None:
        if self.leases.full():
            raise ResourceExhausted(f"too many open leases (max {self.leases.max_leases}); release some first")

    def _lease_ms(self, lease_ms: int) -> int:
        if lease_ms == 0:
            return self.limits.lease_ms_default
        if not 0 < lease_ms <= self.limits.lease_ms_max:
            raise InvalidArgument(f"lease_ms {lease_ms} is outside (0, {self.limits.lease_ms_max}]")
        return lease_ms

    # ------------------------------------------------------------------

    def tier_of(self, block: Block) -> TierId:
        check(block.host_slot != NO_SLOT, f"{block!r} resides in no tier")
        return TierId.HOST

    def verify(self) -> None:
        """Check every cross-structure invariant (tests call this after each step)."""
        self.host.verify()
        self.leases.verify()
        resident = 0
        pinned = 0
        refs = 0
        used_bytes = 0
        for state in self._namespaces.values():
            state.index.verify()
            for block in state.index:
                check(block.host_slot != NO_SLOT, f"{block!r} is indexed but resides nowhere")
                check(self.host.owners[block.host_slot] is block, f"{block!r} slot owner mismatch")
                resident += 1
                used_bytes += state.block_bytes
                refs += block.ref_count
                pinned += block.ref_count > 0
                candidate = (
                    block.state == BlockState.SEALED and block.ref_count == 0 and block.children == 0
                )
                check(
                    (block in self.host.policy) == candidate,
                    f"{block!r} candidate={candidate} but policy membership disagrees",
                )
        check(resident == self.host.resident_blocks, "resident blocks disagree with free slots")
        check(used_bytes == self.host.used_bytes, "host used bytes drifted")
        check(pinned == self.pinned_blocks, f"pinned count {self.pinned_blocks} but {pinned} pinned")
        check(refs == self.live_handles, f"{self.live_handles} live handles but {refs} references")
