"""Namespaces, Lookup, Puts (Reserve/Commit, PutInline, MakeDurable), leases, Delete, Prefetch.

A part of kvd.server.service.KvdService (its handlers by concern); they share the
service's state and reach each other's helpers through self."""

from __future__ import annotations

import asyncio
import dataclasses
import logging


from kvd import arena_protocol
from kvd.core.block import NO_SLOT
from kvd.core.engine import CommitRequest, KeysRequest, ReserveStatus, TierId
from kvd.core.quota import QuotaExceeded
from kvd.errors import (NOT_IN_A_CLUSTER, FailedPrecondition, InvalidArgument, NotDurable, PermissionDenied,
                        PinCapExceeded, ResourceExhausted, Unavailable)
from kvd.invariants import check
from kvd.planner.load_time import load_seconds
from kvd.server import convert
from kvd.server.rpc import rpc


log = logging.getLogger(__name__)

# How long an ACK_DURABLE Put waits when its call has no deadline.
DURABLE_WAIT_S = 30.0


class BlockHandlers:
    @rpc("RegisterNamespace")
    async def RegisterNamespace(self, request, context):
        if not request.HasField("spec"):
            raise InvalidArgument("spec must be set")
        spec = convert.spec_from_proto(request.spec)
        tenant = self._caller()
        if tenant is not None:
            if not tenant.may_use(spec.model_id):
                raise PermissionDenied(
                    f"tenant {tenant.name!r} may not use model {spec.model_id!r} "
                    f"(its namespaces: {', '.join(tenant.namespaces) or 'none'})"
                )
            # The tenant's own namespace: never the same as another's (kvd.core.keys).
            spec = dataclasses.replace(spec, tenant=tenant.name)
        known = len(self.engine.namespaces())
        state = self.engine.register_namespace(spec)
        if self.disk_plane is not None:
            await self.disk_plane.register_namespace(self.engine, state.namespace_id)
        slot_bytes = self.engine.host.pool.classes[state.index.host_class].slot_bytes
        if len(self.engine.namespaces()) > known and state.block_bytes * 2 <= slot_bytes:
            log.warning(
                "namespace blocks fill at most half a host slot; set host.min_slot_bytes (or host.slot_bytes) "
                "near the block size",
                extra={
                    "model_id": spec.model_id,
                    "block_bytes": state.block_bytes,
                    "slot_bytes": slot_bytes,
                    "slot_use_percent": round(100.0 * state.block_bytes / slot_bytes, 1),
                },
            )
        return convert.register_namespace_response(state)

    @rpc("ArenaInfo")
    async def ArenaInfo(self, request, context):
        return convert.arena_info_response(self.arena_socket, self.arena.layout,
                                           [slot_class.slot_bytes for slot_class in self.engine.host.pool.classes],
                                           self.arena.instance_id, self.max_message_bytes)

    @rpc("Lookup")
    async def Lookup(self, request, context):
        keys = convert.lookup_keys(request)
        matched = self.engine.lookup(request.namespace_id, keys, request.parent_key)
        tiers = convert.tiers(self.engine, matched)
        tier = self.device_plane.tier if self.device_plane is not None else None
        if tier is not None and len(tier):  # copies in the device tier, above host memory
            held = tier.holds(request.namespace_id, keys, matched)
            tiers = bytes(TierId.DEVICE if hit else level for hit, level in zip(held, tiers))
        if request.include_remote:
            tiers += await self._remote_tiers(request, keys, len(matched))
        load_s = self._load_seconds(request.namespace_id, tiers).tolist() if request.load_times else []
        return convert.lookup_response(tiers, load_s)

    def _load_seconds(self, namespace_id: bytes, tiers: bytes):
        """LookupResponse.load_s: from the drives' queue and recent read rate, and the recent rate
        of remote fetches (kvd.planner.load_time)."""
        io = self.disk_plane.io if self.disk_plane is not None else None
        fetch = self.cluster_fetch
        rates = {TierId.DISK: io.read_rate.bytes_per_s if io is not None else None,
                 TierId.REMOTE: fetch.rate.bytes_per_s if fetch is not None else None}
        queued = {TierId.DISK: io.queued_read_bytes() if io is not None else 0}
        return load_seconds(tiers, self.engine.namespace(namespace_id).spec.block_bytes, queued, rates)

    async def _remote_tiers(self, request, keys, local: int) -> bytes:
        """TIER_REMOTE for the blocks past `local` that the longest peer holds (of a chain from its
        root, or continuing a parent stored here)."""
        if self.cluster is None:
            raise FailedPrecondition(f"include_remote: {NOT_IN_A_CLUSTER} ([cluster] etcd_endpoints is empty)")
        chain = self._chain_before(request)
        if local >= len(keys) or chain is None:
            return b""
        answer = await self.cluster.lookup(request.namespace_id, b"".join(chain) + b"".join(keys), len(chain) + local)
        remote = max((node.matched for node in answer.nodes if not node.local), default=0) - len(chain)
        return bytes([TierId.REMOTE]) * max(0, remote - local)

    def _chain_before(self, request) -> list[bytes] | None:
        """The stored chain a request's keys continue, root first: [] for keys from the root, None
        when its parent_key is not stored here (then no peer's blocks can be placed under it)."""
        if not request.parent_key:
            return []
        return self.engine.chain_to(request.namespace_id, request.parent_key) or None

    async def _reserve(self, request, lease_ms: int):
        """engine.reserve, waiting once for an in-flight disk write batch to
        unpin the host tier if that is all that stands in the way."""
        def reserve():
            return self.engine.reserve(KeysRequest(request.namespace_id, request.client_id, list(request.keys),
                                                   lease_ms, self.clock.now_ms(), parent_key=request.parent_key))

        try:
            return reserve()
        except (PinCapExceeded, QuotaExceeded):
            raise  # the disk writer frees none of this client's pins, nor the tenant's quota
        except ResourceExhausted:
            if self.disk_plane is None or self.disk_plane.writes_idle.is_set() or self._draining:
                raise
        # Draining: try once more now rather than after the batch.
        await self._unless_draining(self.disk_plane.writes_idle.wait)
        return reserve()

    def _check_arena(self, request) -> None:
        """Offsets are only good for the arena of this instance: refuse a client that mapped another."""
        if request.arena_instance_id and request.arena_instance_id != self.arena.instance_id:
            raise FailedPrecondition(
                f"{arena_protocol.ARENA_CHANGED}: the client mapped the arena of daemon instance "
                f"{request.arena_instance_id[:32]!r}, this is instance {self.arena.instance_id!r} (the daemon "
                "restarted); call ArenaInfo and map the arena again"
            )

    @rpc("Reserve")
    async def Reserve(self, request, context):
        self._check_arena(request)
        result = await self._reserve(request, request.lease_ms)
        return convert.reserve_response(result, self._reserved_offsets(result.slots))

    @rpc("Commit")
    async def Commit(self, request, context):
        durable_ack = convert.durable_ack(request.ack, self.disk_plane is not None)
        committed = self.engine.commit(CommitRequest(
            request.namespace_id, request.client_id, request.lease_id, self.clock.now_ms(),
            keys=request.keys, abort_keys=request.abort_keys))
        durable = committed.blocks if durable_ack else []
        if durable:
            await self._make_durable(durable, len(durable), context)  # which wakes the writer
        elif self.disk_plane is not None:
            self.disk_plane.wake()  # the write-back starts now
        return convert.commit_response(committed, len(durable))

    async def _make_durable(self, blocks, requested: int, context) -> None:
        """Wait until `blocks` (the leading ones of the `requested` blocks a
        call asked to make durable, in chain order) are on disk; NotDurable
        naming the first that is not, and how many before it are."""
        remaining = context.time_remaining()
        timeout_s = DURABLE_WAIT_S if remaining is None else max(0.0, remaining - 0.05)
        failures = await self.disk_plane.wait_durable(blocks, timeout_s)
        if not failures:
            return
        first = failures[0]
        position = blocks.index(first.block)
        raise NotDurable(
            first.code,
            f"of the {requested} blocks this call asked to make durable, the first {position} are; keys[{position}:"
            f"{requested}] are not: keys[{position}] ({first.block.key.hex()[:16]}...) because {first.reason}",
            position, requested,
        )

    @rpc("PutInline")
    async def PutInline(self, request, context):
        durable_ack = convert.durable_ack(request.ack, self.disk_plane is not None)
        state = self.engine.namespace(request.namespace_id)
        if len(request.blocks) != len(request.keys):
            raise InvalidArgument(f"{len(request.keys)} keys but {len(request.blocks)} blocks; send one block per key")
        for position, payload in enumerate(request.blocks):
            if len(payload) != state.block_bytes:
                raise InvalidArgument(
                    f"blocks[{position}] is {len(payload)} bytes; this namespace's blocks are {state.block_bytes} bytes"
                )
        result = await self._reserve(request, 0)
        now_ms = self.clock.now_ms()
        sealed = 0
        if result.lease is not None:
            # Reserve, copy and seal without an await in between: no other
            # request can observe the half-written blocks.
            offsets = self._reserved_offsets(result.slots)
            for position, status in enumerate(result.statuses):
                if status == ReserveStatus.RESERVED:
                    self.arena.write_at(offsets[position], request.blocks[position])
            sealed, _, _ = self.engine.commit(CommitRequest(request.namespace_id, request.client_id,
                                                         result.lease.lease_id, now_ms))
        durable = 0
        if self.disk_plane is not None and not durable_ack:
            self.disk_plane.wake()  # a durable wait wakes the writer itself
        if durable_ack:
            # Every key, those already stored too: a retry must be as durable as the first try.
            stored = self.engine.stored(request.namespace_id, list(request.keys), request.parent_key)
            await self._make_durable(stored, len(request.keys), context)
            if len(stored) < len(request.keys):
                raise _not_stored(result.statuses, len(stored), len(request.keys))
            durable = len(stored)
        return convert.put_inline_response(result.statuses, sealed, durable)

    @rpc("MakeDurable")
    async def MakeDurable(self, request, context):
        if self.disk_plane is None:
            raise FailedPrecondition("this kvd has no disk tier (disk.directories is empty): nothing can be durable")
        keys = list(request.keys)
        stored = self.engine.stored(request.namespace_id, keys, request.parent_key)
        await self._make_durable(stored, len(keys), context)
        if len(stored) < len(keys):
            raise NotDurable("NOT_FOUND", f"keys[{len(stored)}:{len(keys)}] are not stored (the first {len(stored)} "
                             "are durable); Put them first", len(stored), len(keys))
        return convert.make_durable_response(len(stored))

    def _reserved_offsets(self, slots: list[int]) -> list[int]:
        """Arena offsets of a reservation's slots (0 where the key got none)."""
        pool = self.engine.host.pool
        check(max(slots, default=NO_SLOT) < pool.slot_count, "a reserved slot is outside the host tier")
        held = iter(pool.offsets_of([slot for slot in slots if slot >= 0]))
        return [next(held) if slot >= 0 else 0 for slot in slots]

    @rpc("Release")
    async def Release(self, request, context):
        released = self.engine.release(request.client_id, request.lease_ids)
        return convert.release_response(released)

    @rpc("Renew")
    async def Renew(self, request, context):
        deadline_ms = self.engine.renew(request.client_id, request.lease_id, request.lease_ms, self.clock.now_ms())
        return convert.renew_response(deadline_ms)

    @rpc("Delete")
    async def Delete(self, request, context):
        deleted, pinned = self.engine.delete(request.namespace_id, request.keys)
        await self._deletions_durable(deleted)
        return convert.delete_response(deleted, pinned)

    async def _deletions_durable(self, deleted: int, what_else: str = "") -> None:
        """Return once no restart can bring back the `deleted` blocks the engine has just
        removed (call it with no await in between: see DiskPlane.journal_deletions);
        Unavailable, ending in `what_else`, when a drive could not record their removal."""
        if not deleted or self.disk_plane is None:
            return
        failed = await self.disk_plane.journal_deletions()
        if failed:
            raise Unavailable(
                f"{deleted} blocks are deleted from memory, but the removal of {failed} of them could not be "
                "made durable on disk (a drive's manifest failed; see the daemon log): they may be listed "
                f"again after a restart, though their data was overwritten where the drive still allowed it{what_else}"
            )

    @rpc("Prefetch")
    async def Prefetch(self, request, context):
        """Queue disk reads of a prefix a Get will want (see the proto); returns at once unless `wait`."""
        keys = list(request.keys)
        if self.disk_plane is None:
            # Every stored block is in host memory: report, read nothing.
            plan, reading = self.engine.begin_prefetch(request.namespace_id, keys, request.parent_key), None
        else:
            plan, reading = self.disk_plane.prefetch(request.namespace_id, keys, request.parent_key)
        loaded = 0
        if request.wait and reading is not None:
            # Shielded: if this call is cancelled, the reads go on.
            loaded = await asyncio.shield(reading)
        return convert.prefetch_response(plan, loaded)


def _not_stored(statuses, stored: int, requested: int) -> NotDurable:
    """The error of a durable Put whose keys[stored:] were not stored (the rest are durable)."""
    blocked = statuses[stored] if stored < len(statuses) else ReserveStatus.NO_SPACE
    if blocked == ReserveStatus.IN_FLIGHT:
        code, why = "UNAVAILABLE", "another client is writing them now; retry once it has committed"
    else:
        code, why = "RESOURCE_EXHAUSTED", "the host tier has no slot to spare (every slot is pinned or being written)"
    return NotDurable(code, f"keys[{stored}:{requested}] were not stored, so they are not durable: {why}; the first "
                      f"{stored} are durable", stored, requested)
