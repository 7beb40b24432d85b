"""The gRPC service: validates requests and drives the engine.

Handlers run on the daemon's event loop and call the engine synchronously,
never awaiting in the middle of a state change, so each engine call is
atomic. Operating errors (KvdError) become a gRPC status here and only here;
anything else is a bug and surfaces as INTERNAL with a logged traceback.

Before any handler runs, its request is brought inside the caller's tenant
(`KvdService._scope`, kvd.server.auth): namespace ids and client ids are
replaced by the engine's ids of the caller's own. Without auth the caller
is no tenant, and only namespaces of no tenant are found.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import grpc

from kvd import __version__, arena_protocol
from kvd.clock import Clock
from kvd.core.block import NO_SLOT
from kvd.core.engine import CommitRequest, Engine, KeysRequest, ReserveStatus, namespace_not_found
from kvd.core.quota import QuotaExceeded
from kvd.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvdError,
    NotDurable,
    PermissionDenied,
    PinCapExceeded,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvd.invariants import InvariantError, check
from kvd.metrics import RpcMetrics
from kvd.planner.distance import NONE
from kvd.server import convert
from kvd.server.auth import CURRENT_TENANT, Tenant, scoped_client_id
from kvd.server.get_stream import BlockSteps, LayerSteps
from kvd.server.planning import Planning
from kvd.tiers.host import DEFAULT_TENANT, HostArena
from kvd.v1 import kvd_pb2, kvd_pb2_grpc

if TYPE_CHECKING:
    from kvd.server.disk_plane import DiskPlane

log = logging.getLogger(__name__)

Request = TypeVar("Request")
# How long an ACK_DURABLE Put waits when its call has no deadline.
DURABLE_WAIT_S = 30.0
# A Get short of host slots waits this long for one write-back batch, then takes what it can.
STARVED_GET_WAIT_S = 5.0
# Inline Gets pin under a lease of their own, never one a client can name.
INLINE_CLIENT_PREFIX = "inline\x00"
# Events a subscriber takes from the ring at a time: what it holds while
# a slow client keeps it waiting (at most this many x MAX_EVENT_KEYS keys).
WATCH_READ_EVENTS = 8
# Blocks per EventSnapshot message (about 70 bytes each on the wire), and
# per step of its build (kvd.core.event_snapshot): each step and each
# message costs the event loop about the same, however many blocks the
# namespace holds.
SNAPSHOT_PART_BLOCKS = 4096
SNAPSHOT_STEP_BLOCKS = 4096
# Demote drops host copies this many candidates at a time, then lets other
# calls run (about 20 ms of the loop here, at 4-5 us a block).
DEMOTE_STEP_BLOCKS = 4096
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamHandler = Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[Any]]


@contextlib.asynccontextmanager
async def _measured(metrics: RpcMetrics, method: str, context: grpc.aio.ServicerContext,
                    on_bug: Callable[[str, BaseException], None] | None = None) -> AsyncIterator[None]:
    """Measure one RPC and map operating errors to their gRPC status. A broken invariant
    is a bug: the caller gets INTERNAL, and `on_bug` (the daemon's supervisor) stops kvd."""
    metrics.in_flight.inc()
    started = time.perf_counter()
    code = "OK"
    try:
        yield
    except KvdError as error:
        code = error.code
        if isinstance(error, NotDurable):
            context.set_trailing_metadata(error.trailers())
        await context.abort(convert.status_of(error), error.message)
    except grpc.aio.AbortError:
        raise
    except InvariantError as error:
        code = "INTERNAL"
        if on_bug is None:
            log.exception("invariant broken in %s", method)
        else:
            on_bug(f"the {method} handler", error)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; kvd stops (see its log)")
    except Exception:
        code = "INTERNAL"
        log.exception("internal error in %s", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the daemon log")
    finally:
        metrics.in_flight.dec()
        metrics.duration.labels(method).observe(time.perf_counter() - started)
        metrics.total.labels(method, code).inc()


def rpc(method: str) -> Callable[[Handler], Handler]:
    """A unary handler, measured, with operating errors mapped to their status."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def wrapper(self: KvdService, request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with _measured(self.metrics, method, context, self.on_bug):
                self._scope(request)
                return await handler(self, request, context)

        return wrapper

    return decorate


def stream_rpc(method: str) -> Callable[[StreamHandler], StreamHandler]:
    """The same for a server-streaming handler (an async generator)."""

    def decorate(handler: StreamHandler) -> StreamHandler:
        @functools.wraps(handler)
        async def wrapper(self: KvdService, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with _measured(self.metrics, method, context, self.on_bug):
                self._scope(request)
                async for message in handler(self, request, context):
                    yield message

        return wrapper

    return decorate


class KvdService(kvd_pb2_grpc.KvdServicer):
    def __init__(
        self,
        engine: Engine,
        arena: HostArena,
        clock: Clock,
        metrics: RpcMetrics,
        max_message_bytes: int,
        disk_plane: DiskPlane | None = None,
        max_subscribers: int = 32,
        auth_required: bool = False,
        arena_socket: str = "",
    ) -> None:
        self.engine = engine
        # Where co-located clients get the arena (kvd.arena_protocol); "": nowhere.
        self.arena_socket = arena_socket
        # auth.mode = "token": every call must have come through the
        # AuthInterceptor, which names its tenant (kvd.server.auth).
        self.auth_required = auth_required
        self.disk_plane = disk_plane
        self.arena = arena
        self.clock = clock
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.started_ms = clock.now_ms()
        self.max_subscribers = max_subscribers
        self._subscribers = 0
        # Set by start_draining: waits that would hold the drain end early.
        self._draining = False
        self._drain_started = asyncio.Event()
        # Set, and replaced by a fresh one, whenever events are published:
        # idle subscribers wait on it.
        self._events_published = asyncio.Event()
        self._publish_scheduled = False
        # kvd.cluster.node.ClusterNode when this daemon is in a cluster, and
        # kvd.server.cluster_blocks.ClusterBlocks when its Gets fetch from peers (set by the daemon).
        self.cluster = None
        self.cluster_blocks = None
        # kvd.server.device_plane.DevicePlane when [device] kind is not "off" (set by the daemon).
        self.device_plane = None
        self.planning = Planning()
        # Told of a broken invariant in a handler (the daemon's supervisor: kvd stops).
        self.on_bug: Callable[[str, BaseException], None] | None = None

    def _caller(self) -> Tenant | None:
        """The tenant of the call being served; None without auth."""
        tenant = CURRENT_TENANT.get()
        if tenant is None and self.auth_required:
            # Fail closed: only a call the interceptor let through has a tenant.
            raise Unauthenticated("kvd does not know who sent this call")
        return tenant

    def _scope(self, request) -> None:
        """Bring a request inside its caller's tenant, before its handler sees it.

        Every request that names a namespace has it resolved within the
        caller's tenant (kvd.server.auth): its namespace_id becomes the
        engine's id of the caller's namespace, or the call is NOT_FOUND as
        for a namespace nobody registered. Every client_id becomes the
        engine's name of the caller's client. Done here, for every method,
        so no handler can forget it.
        """
        tenant = self._caller()
        fields = request.DESCRIPTOR.fields_by_name
        if "namespace_id" in fields:
            public_id = request.namespace_id
            state = self.engine.tenant_namespace(tenant.name if tenant is not None else "", public_id)
            if tenant is not None and not tenant.may_use(state.spec.model_id):
                # Its model was taken off the tenant's list since it registered it.
                raise namespace_not_found(public_id)
            request.namespace_id = state.namespace_id
        if "client_id" in fields:
            request.client_id = scoped_client_id(tenant, request.client_id)

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
        return kvd_pb2.RegisterNamespaceResponse(
            namespace_id=state.public_id, block_bytes=state.block_bytes, layer_bytes=state.spec.layer_bytes
        )

    @rpc("ArenaInfo")
    async def ArenaInfo(self, request, context):
        layout = self.arena.layout
        return kvd_pb2.ArenaInfoResponse(
            arena_socket=self.arena_socket,
            arena_bytes=layout.arena_bytes,
            slot_bytes=layout.slot_bytes,
            slot_count=layout.slot_count,
            class_bytes=[slot_class.slot_bytes for slot_class in self.engine.host.pool.classes],
            instance_id=self.arena.instance_id,
            max_message_bytes=self.max_message_bytes,
        )

    @rpc("Lookup")
    async def Lookup(self, request, context):
        keys = convert.lookup_keys(request)
        matched = self.engine.lookup(request.namespace_id, keys, request.parent_key)
        tiers = convert.tiers(self.engine, matched)
        tier = self.device_plane.tier if self.device_plane is not None else None
        if tier is not None and len(tier):  # copies in the device tier, above host memory
            held = tier.holds(request.namespace_id, keys, matched)
            tiers = bytes(kvd_pb2.TIER_DEVICE if hit else level for hit, level in zip(held, tiers))
        if request.include_remote:
            tiers += await self._remote_tiers(request, keys, len(matched))
        return kvd_pb2.LookupResponse(matched=len(tiers), tiers=tiers)

    async def _remote_tiers(self, request, keys, local: int) -> bytes:
        """TIER_REMOTE for the blocks past `local` that the longest peer holds."""
        if self.cluster is None:
            raise FailedPrecondition("include_remote: this kvd is not in a cluster ([cluster] etcd_endpoints is empty)")
        if request.parent_key:
            raise InvalidArgument("include_remote needs the chain from its root: parent_key must be empty")
        if local >= len(keys):
            return b""
        answer = await self.cluster.lookup(request.namespace_id, b"".join(keys), local)
        remote = max((node.matched for node in answer.nodes if not node.local), default=0)
        return bytes([kvd_pb2.TIER_REMOTE]) * max(0, remote - local)

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
        return kvd_pb2.ReserveResponse(
            lease_id=result.lease.lease_id if result.lease else 0,
            lease_deadline_ms=result.lease.deadline_ms if result.lease else 0,
            statuses=[int(status) for status in result.statuses],
            offsets=self._reserved_offsets(result.slots),
        )

    @rpc("Commit")
    async def Commit(self, request, context):
        convert.ack_supported(request.ack, self.disk_plane is not None)
        durable = request.ack == kvd_pb2.ACK_DURABLE
        blocks = self._lease_blocks(request.client_id, request.lease_id, request.keys, request.abort_keys) \
            if durable else []
        sealed, aborted = self.engine.commit(CommitRequest(
            request.namespace_id, request.client_id, request.lease_id, self.clock.now_ms(),
            keys=request.keys, abort_keys=request.abort_keys))
        if self.disk_plane is not None:
            self.disk_plane.wake()  # the write-through starts now
        if durable:
            await self._make_durable(blocks, len(blocks), context)
        return kvd_pb2.CommitResponse(sealed=sealed, aborted=aborted, durable=len(blocks))

    def _lease_blocks(self, client_id: str, lease_id: int, keys, abort_keys) -> list:
        """The blocks a commit will seal (all writable ones when both key lists are empty)."""
        if not keys and abort_keys:
            return []  # it only aborts
        try:
            lease = self.engine.leases.find(lease_id, client_id)
        except KvdError:
            return []  # commit reports the precise error
        wanted = set(keys)
        return [handle.block for handle in lease.handles if handle.writable and (not wanted or handle.key in wanted)]

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
        convert.ack_supported(request.ack, self.disk_plane is not None)
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
            pool = self.engine.host.pool
            for position, status in enumerate(result.statuses):
                if status == ReserveStatus.RESERVED:
                    self.arena.write_at(pool.offset_of(result.slots[position]), request.blocks[position])
            sealed, _ = self.engine.commit(CommitRequest(request.namespace_id, request.client_id,
                                                         result.lease.lease_id, now_ms))
        if self.disk_plane is not None:
            self.disk_plane.wake()
        durable = 0
        if request.ack == kvd_pb2.ACK_DURABLE:
            # Every key, those already stored too: a retry must be as durable as the first try.
            stored = self.engine.stored(request.namespace_id, list(request.keys), request.parent_key)
            await self._make_durable(stored, len(request.keys), context)
            if len(stored) < len(request.keys):
                raise _not_stored(result.statuses, len(stored), len(request.keys))
            durable = len(stored)
        return kvd_pb2.PutInlineResponse(statuses=[int(status) for status in result.statuses], sealed=sealed,
                                         durable=durable)

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
        return kvd_pb2.MakeDurableResponse(durable=len(stored))

    async def _begin_get(self, request, client_id: str):
        """engine.begin_get, retried once after an in-flight write batch if starved."""

        def begin():
            return self.engine.begin_get(KeysRequest(request.namespace_id, client_id, list(request.keys),
                                                     request.lease_ms, self.clock.now_ms(),
                                                     parent_key=request.parent_key))

        plan = begin()
        if self.disk_plane is None:
            return plan
        # Host memory is held by blocks waiting for write-back (or pinned by
        # a write batch in flight): each batch that reaches disk lets their
        # copies make room, so try again after each, while that helps. Once
        # the daemon drains, take what there is at once.
        deadline = asyncio.get_running_loop().time() + STARVED_GET_WAIT_S
        while plan.starved:
            left = deadline - asyncio.get_running_loop().time()
            self.engine.abandon_get(plan)
            if left <= 0 or not await self._unless_draining(lambda: self.disk_plane.wait_for_write_back(left)):
                return begin()
            plan = begin()
        return plan

    async def _unless_draining(self, wait: Callable[[], Awaitable[Any]]) -> Any:
        """wait()'s result, or None as soon as the daemon drains (the wait is then cancelled)."""
        if self._draining:
            return None
        waiting = asyncio.ensure_future(wait())
        drain = asyncio.ensure_future(self._drain_started.wait())
        try:
            await asyncio.wait({waiting, drain}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            drain.cancel()
            if not waiting.done():
                waiting.cancel()
        return waiting.result() if waiting.done() and not waiting.cancelled() else None

    async def _pinned_prefix(self, request, client_id: str) -> tuple[object, list, bytes]:
        """begin_get + disk reads: (lease, servable blocks, their tiers before the Get)."""
        plan = await self._begin_get(request, client_id)
        tiers = convert.tiers(self.engine, plan.matched)
        if plan.loads or plan.waits:
            # On failure the get task ends the lease itself, once no read
            # into the pinned slots is still running.
            await self.disk_plane.start_get(plan)
            self._check_lease_outlived_reads(request, plan)
        return plan.lease, plan.matched, tiers[: len(plan.matched)]

    def _check_lease_outlived_reads(self, request, plan) -> None:
        """A Get whose lease ended while its disk reads ran has nothing pinned: refuse it by name
        rather than hand out slots another block may take at any moment."""
        if plan.lease is not None and plan.lease.ended:
            raise FailedPrecondition(
                f"the Get's lease ran out before its disk reads finished, so nothing is pinned for it "
                f"(lease_ms {request.lease_ms or self.engine.limits.lease_ms_default}); ask for a longer lease_ms")

    async def _fetch_remote(self, request) -> None:
        """In a cluster: bring what a peer holds of a chain that misses here (kvd.server.cluster_blocks)."""
        if self.cluster_blocks is None or request.parent_key or not request.keys:
            return
        await self.cluster_blocks.fetch_for_get(request.namespace_id, list(request.keys))

    @rpc("Get")
    async def Get(self, request, context):
        await self._fetch_remote(request)
        if request.inline:
            state = self.engine.namespace(request.namespace_id)
            # Pinned under a private lease while the bytes are copied out.
            # Per client, or per tenant for a Get that names none: one
            # tenant's inline Gets never take from another's pin cap.
            owner = request.client_id or scoped_client_id(self._caller(), "-")
            lease, matched, tiers = await self._pinned_prefix(request, INLINE_CLIENT_PREFIX + owner)
            try:
                response_bytes = len(matched) * (state.block_bytes + 8)
                if response_bytes > self.max_message_bytes:
                    raise ResourceExhausted(
                        f"an inline Get of {len(matched)} blocks is {response_bytes} bytes, over the "
                        f"{self.max_message_bytes}-byte message limit; ask for at most "
                        f"{max(1, self.max_message_bytes // (state.block_bytes + 8) - 1)} keys per call"
                    )
                offsets = self.engine.host.pool.offsets_of([self.engine.host_slot(block) for block in matched])
                blocks = [self.arena.read_at(offset, state.block_bytes) for offset in offsets]
            finally:
                if lease is not None and not lease.ended:
                    self.engine.leases.close(lease)
            return kvd_pb2.GetResponse(matched=len(matched), blocks=blocks, tiers=tiers)
        self._check_arena(request)
        lease, matched, tiers = await self._pinned_prefix(request, request.client_id)
        return kvd_pb2.GetResponse(
            matched=len(matched),
            lease_id=lease.lease_id if lease else 0,
            lease_deadline_ms=lease.deadline_ms if lease else 0,
            offsets=self._offsets(lease, matched),
            tiers=tiers,
        )

    def _offsets(self, lease, matched: list) -> list[int]:
        """Arena offsets of the blocks a Get hands out: each in host memory
        (never a slot another block may take) and pinned by the Get's lease."""
        slots = [self.engine.host_slot(block) for block in matched]
        check(not slots or (min(slots) >= 0 and lease is not None and not lease.ended),
              "a Get hands out {} blocks without a host slot or a live lease", len(slots))
        return self.engine.host.pool.offsets_of(slots)

    def _reserved_offsets(self, slots: list[int]) -> list[int]:
        """Arena offsets of a reservation's slots (0 where the key got none)."""
        pool = self.engine.host.pool
        check(max(slots, default=NO_SLOT) < pool.slot_count, "a reserved slot is outside the host tier")
        return [pool.offset_of(slot) if slot >= 0 else 0 for slot in slots]

    @stream_rpc("GetLayers")
    async def GetLayers(self, request, context):
        """Server-streaming Get: one message per layer landed (see the proto)."""
        async for message in self._stream_get(request, LayerSteps):
            yield message

    @stream_rpc("GetBlocks")
    async def GetBlocks(self, request, context):
        """Server-streaming Get: one message per run of leading blocks landed (see the proto)."""
        async for message in self._stream_get(request, BlockSteps):
            yield message

    async def _stream_get(self, request, steps_kind: type[LayerSteps | BlockSteps]):
        self._check_arena(request)
        await self._fetch_remote(request)
        layers = self.engine.namespace(request.namespace_id).spec.num_layers
        plan = await self._begin_get(request, request.client_id)
        matched = list(plan.matched)
        pending = bool(plan.loads or plan.waits)
        lease = plan.lease
        load_positions, first_wait = self._pending_positions(plan, matched) if pending else ([], len(matched))
        steps = steps_kind(layers, len(matched), load_positions, first_wait)
        first = steps.first(
            len(matched), pending,
            lease_id=lease.lease_id if lease else 0,
            lease_deadline_ms=lease.deadline_ms if lease else 0,
            offsets=self._offsets(lease, matched),
            tiers=convert.tiers(self.engine, matched),
        )
        if not pending:
            yield first
            return
        updates: asyncio.Queue = asyncio.Queue()
        # Started before the first message goes out: the plan's loads are
        # reads other Gets may wait on from now on. On failure the task ends
        # the lease itself, once no read into the pinned slots is running.
        getting = self.disk_plane.start_get(plan, **{steps.callback: lambda step, ok: updates.put_nowait((step, ok))})
        servable = len(matched)
        try:
            yield first
            while not getting.done() or not updates.empty():
                waiter = asyncio.ensure_future(updates.get())
                await asyncio.wait({waiter, getting}, return_when=asyncio.FIRST_COMPLETED)
                if not waiter.done():
                    waiter.cancel()
                    continue
                step, ok = waiter.result()
                servable = min([servable, *(position for position, good in zip(load_positions, ok) if not good)])
                if plan.waits:
                    continue  # another Get is loading some blocks: only the end counts
                yield steps.step(step, servable)
            served = await getting
        finally:
            if not getting.done():
                getting.cancel()
        self._check_lease_outlived_reads(request, plan)
        yield steps.last(min(servable, len(served)))

    @staticmethod
    def _pending_positions(plan, matched: list) -> tuple[list[int], int]:
        """Where in `matched` the plan's own loads are, and the first block another read is loading."""
        position_of = {id(block): position for position, block in enumerate(matched)}
        return ([position_of[id(load.block)] for load in plan.loads],
                min((position_of[id(block)] for block in plan.waits), default=len(matched)))

    @rpc("Release")
    async def Release(self, request, context):
        released = self.engine.release(request.client_id, request.lease_ids)
        return kvd_pb2.ReleaseResponse(released=released)

    @rpc("Renew")
    async def Renew(self, request, context):
        deadline_ms = self.engine.renew(request.client_id, request.lease_id, request.lease_ms, self.clock.now_ms())
        return kvd_pb2.RenewResponse(lease_deadline_ms=deadline_ms)

    @rpc("Delete")
    async def Delete(self, request, context):
        deleted, pinned = self.engine.delete(request.namespace_id, request.keys)
        if deleted and self.disk_plane is not None:
            # Answered only once no restart can bring the blocks back.
            failed = await self.disk_plane.journal_deletions()
            if failed:
                raise Unavailable(
                    f"{deleted} blocks are deleted from memory, but the removal of {failed} of them could not be "
                    "made durable on disk (a drive's manifest failed; see the daemon log): they may be listed "
                    "again after a restart, though their data was overwritten where the drive still allowed it"
                )
        return kvd_pb2.DeleteResponse(deleted=deleted, pinned=pinned)

    @rpc("Demote")
    async def Demote(self, request, context):
        """Drop every host copy a lower tier also holds (admin; see the proto)."""
        demoted, payload = await self._demote()
        kept = self.engine.host.pool.resident_blocks
        log.info("Demote: %d host copies dropped (%d bytes), %d kept", demoted, payload, kept)
        return kvd_pb2.DemoteResponse(blocks_demoted=demoted, bytes_demoted=payload, blocks_kept=kept)

    async def _demote(self) -> tuple[int, int]:
        """The candidates of now, DEMOTE_STEP_BLOCKS at a time, other calls running between steps."""
        candidates = self.engine.host_candidates()
        demoted = payload = 0
        for start in range(0, len(candidates), DEMOTE_STEP_BLOCKS):
            blocks, nbytes = self.engine.demote(candidates[start:start + DEMOTE_STEP_BLOCKS])
            demoted, payload = demoted + blocks, payload + nbytes
            await asyncio.sleep(0)
        return demoted, payload

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

    # ------------------------------------------------------------------
    # KV events (kvd.core.events): WatchEvents and EventSnapshot
    #
    # A subscriber is a cursor into the engine's shared ring of recent
    # events, never a queue of its own: however slow its client, it holds at
    # most WATCH_READ_EVENTS events, plus what gRPC's flow-control window
    # buffers. When its next event has left the ring it is sent
    # RESYNC_REQUIRED and its stream ends: the client takes a snapshot and
    # watches again, the same path as a resume from a too-old sequence.

    @stream_rpc("WatchEvents")
    async def WatchEvents(self, request, context):
        events = self.engine.events
        state = self.engine.namespace(request.namespace_id)
        # Events carry the id the client knows (a tenant's differs from the engine's).
        namespace_id, public_id = state.namespace_id, state.public_id
        if self._draining:
            raise Unavailable("kvd is draining; watch again once it is back, from a new snapshot")
        if self._subscribers >= self.max_subscribers:
            raise ResourceExhausted(f"too many event subscribers (max {self.max_subscribers}); close a watch first")
        last = events.last_sequence(namespace_id)
        if request.instance_id and request.instance_id != self.arena.instance_id:
            yield self._resync(public_id, last, kvd_pb2.RESYNC_REASON_INSTANCE_CHANGED)
            return
        if request.from_sequence > last + 1:
            raise InvalidArgument(
                f"from_sequence {request.from_sequence} is ahead of this namespace's newest event {last}; "
                f"watch from at most {last + 1}, or from 0 for new events only"
            )
        next_sequence = request.from_sequence or last + 1
        if next_sequence < events.first_sequence(namespace_id):
            yield self._resync(public_id, last, kvd_pb2.RESYNC_REASON_SEQUENCE_TOO_OLD)
            return
        self._subscribe(+1)
        try:
            yield kvd_pb2.KvEvent(
                kind=kvd_pb2.KV_EVENT_KIND_WATCHING,
                sequence=next_sequence - 1,
                namespace_id=public_id,
                instance_id=self.arena.instance_id,
            )
            while True:
                published = self._events_published
                if self._draining:
                    raise Unavailable("kvd is draining; watch again once it is back, from a new snapshot")
                batch = events.read(namespace_id, next_sequence, WATCH_READ_EVENTS)
                if batch is None:
                    yield self._resync(
                        public_id, events.last_sequence(namespace_id), kvd_pb2.RESYNC_REASON_SUBSCRIBER_TOO_SLOW
                    )
                    return
                if not batch:
                    await published.wait()
                    continue
                for event in batch:
                    yield convert.event_message(event, public_id)
                next_sequence = batch[-1].sequence + 1
        finally:
            self._subscribe(-1)

    @stream_rpc("EventSnapshot")
    async def EventSnapshot(self, request, context):
        engine = self.engine
        state = engine.namespace(request.namespace_id)
        # Built a bounded step at a time, the loop turning in between; exactly
        # the blocks served after event `build.sequence`, parents first.
        build = engine.event_snapshot(state.namespace_id, SNAPSHOT_STEP_BLOCKS)
        try:
            while not build.step():
                await asyncio.sleep(0)
        finally:
            build.close()
        for part in build.parts(SNAPSHOT_PART_BLOCKS):
            yield kvd_pb2.EventSnapshotResponse(
                instance_id=self.arena.instance_id,
                sequence=build.sequence,
                block_count=build.block_count,
                keys=part.keys,
                parent_keys=part.parent_keys,
                tiers=part.tiers,
            )

    def start_draining(self) -> None:
        """The daemon drains: nothing in flight should hold it for the grace period.

        Every WatchEvents stream ends (UNAVAILABLE) and new ones are
        refused; Gets starved of host slots stop waiting for write-back and
        answer with what they can serve; Reserves waiting for a write batch
        try again at once. Work that finishes by itself (disk reads, durable
        Puts' writes) goes on.
        """
        self._draining = True
        self._drain_started.set()
        self._events_published.set()

    def _resync(self, namespace_id: bytes, sequence: int, reason: int) -> kvd_pb2.KvEvent:
        self.metrics.event_resyncs.labels(kvd_pb2.ResyncReason.Name(reason)[len("RESYNC_REASON_"):].lower()).inc()
        return kvd_pb2.KvEvent(
            kind=kvd_pb2.KV_EVENT_KIND_RESYNC_REQUIRED,
            sequence=sequence,
            namespace_id=namespace_id,
            instance_id=self.arena.instance_id,
            resync_reason=reason,
        )

    def _subscribe(self, change: int) -> None:
        self._subscribers += change
        self.metrics.event_subscribers.inc(change)
        # The engine calls back only while someone listens: without
        # subscribers events are published lazily, by the next reader.
        self.engine.events.listener = self._on_event_opened if self._subscribers else None

    def _on_event_opened(self) -> None:
        # Called inside an engine call, on the loop: publish once this turn
        # of the loop is over, so one turn's changes go out together.
        if not self._publish_scheduled:
            self._publish_scheduled = True
            asyncio.get_running_loop().call_soon(self._publish_events)

    def _publish_events(self) -> None:
        self._publish_scheduled = False
        self.engine.events.flush()
        published, self._events_published = self._events_published, asyncio.Event()
        published.set()

    @rpc("ClusterLookup")
    async def ClusterLookup(self, request, context):
        if self.cluster is None:
            raise FailedPrecondition("this kvd is not in a cluster ([cluster] etcd_endpoints is empty)")
        keys = convert.cluster_lookup_keys(request, self.engine.limits.max_batch_keys)
        local = self.engine.lookup(request.namespace_id, keys)
        return await self.cluster.lookup(request.namespace_id, request.packed_keys, len(local))

    # ------------------------------------------------------------------ placement planning

    def _tenant_name(self) -> str:
        tenant = self._caller()
        return tenant.name if tenant is not None else DEFAULT_TENANT

    @rpc("PlanPlacement")
    async def PlanPlacement(self, request, context):
        return await self.planning.plan(request, self._tenant_name())

    @rpc("ReportStep")
    async def ReportStep(self, request, context):
        return self.planning.report(request, self._tenant_name())

    # ------------------------------------------------------------------ device plane

    def _device_plane(self):
        if self.device_plane is None:
            raise FailedPrecondition("this kvd has no device plane ([device] kind = \"off\")")
        return self.device_plane

    @rpc("RegisterPool")
    async def RegisterPool(self, request, context):
        plane = self._device_plane()
        await plane.sweep(self.clock.now_ms())
        spec = self.engine.namespace(request.namespace_id).spec
        pool = plane.register(request, spec.num_layers, spec.layer_bytes, self.clock.now_ms(), self._tenant_name())
        return kvd_pb2.RegisterPoolResponse(pool_id=pool.pool_id, lease_deadline_ms=pool.deadline_ms,
                                            flag_words=pool.flag_words)

    @rpc("UnregisterPool")
    async def UnregisterPool(self, request, context):
        await self._device_plane().unregister(request.client_id, request.pool_id)
        return kvd_pb2.UnregisterPoolResponse()

    def _device_pool(self, request, flags: dict[str, int]):
        plane = self._device_plane()
        pool = plane.pool(request.client_id, request.pool_id, request.namespace_id)
        plane.renew(pool, self.clock.now_ms())
        return plane, pool, plane.check_transfer(pool, request.keys, request.pages, flags, request.base)

    @rpc("SaveLayers")
    async def SaveLayers(self, request, context):
        plane, pool, pages = self._device_pool(request, {"engine_flag": request.engine_flag,
                                                         "kvd_flag": request.kvd_flag})
        distance = _offload_distance(request.offload_distance, len(pool.layout.layers))
        result = await self._reserve(request, 0)
        reserved = [i for i, status in enumerate(result.statuses) if status == ReserveStatus.RESERVED]
        offsets = self._reserved_offsets(result.slots)
        keys = [request.keys[i] for i in reserved]
        writing = {handle.key: handle.block for handle in result.lease.handles if handle.writable} \
            if result.lease is not None else {}
        try:
            done = await plane.save(pool, pages[reserved], [offsets[i] for i in reserved], request.engine_flag,
                                    request.kvd_flag, request.base, keys, [writing[key] for key in keys], distance)
        except BaseException:
            if keys:
                self.engine.commit(CommitRequest(request.namespace_id, request.client_id, result.lease.lease_id,
                                                 self.clock.now_ms(), abort_keys=keys))
            raise
        stored = 0
        if keys:
            stored, _ = self.engine.commit(CommitRequest(request.namespace_id, request.client_id,
                                                         result.lease.lease_id, self.clock.now_ms(), keys=keys))
            if self.disk_plane is not None:
                self.disk_plane.wake()
        return kvd_pb2.SaveLayersResponse(statuses=[int(status) for status in result.statuses], stored=stored,
                                          done_value=done)

    @rpc("LoadLayers")
    async def LoadLayers(self, request, context):
        plane, pool, pages = self._device_pool(request, {"kvd_flag": request.kvd_flag})
        get = kvd_pb2.GetRequest(namespace_id=request.namespace_id, client_id=request.client_id,
                                 keys=request.keys, parent_key=request.parent_key)
        await self._fetch_remote(get)
        lease, matched, tiers = await self._pinned_prefix(get, request.client_id)

        def landed() -> None:
            if lease is not None and not lease.ended:
                self.engine.leases.close(lease)

        try:
            done, from_tier = plane.load(pool, pages[:len(matched)], request.keys[:len(matched)], matched,
                                         self._offsets(lease, matched), request.kvd_flag, request.base, landed)
        except BaseException:
            landed()
            raise
        tiers = bytes(kvd_pb2.TIER_DEVICE if hit else tier for hit, tier in zip(from_tier, tiers))
        return kvd_pb2.LoadLayersResponse(matched=len(matched), done_value=done, tiers=tiers)

    @rpc("Stats")
    async def Stats(self, request, context):
        engine = self.engine
        return kvd_pb2.StatsResponse(
            version=__version__,
            instance_id=self.arena.instance_id,
            uptime_s=(self.clock.now_ms() - self.started_ms) / 1000.0,
            tiers=[
                kvd_pb2.TierStats(
                    tier=int(tier.tier_id),
                    blocks=tier.pool.resident_blocks,
                    bytes_used=tier.pool.occupied_bytes,
                    payload_bytes=tier.pool.used_bytes,
                    capacity_bytes=tier.pool.capacity_bytes,
                    # Pins hold blocks where clients map them.
                    pinned_blocks=engine.pinned_blocks if tier.caps.client_mappable else 0,
                    evictions=tier.counters.evictions,
                )
                for tier in engine.tiers
            ],
            namespaces=[
                kvd_pb2.NamespaceStats(
                    namespace_id=state.namespace_id,
                    model_id=state.spec.model_id,
                    tenant=state.spec.tenant,
                    blocks=len(state.index),
                    block_bytes=state.block_bytes,
                    hits=state.lookup_hits + state.get_hits,
                    misses=state.lookup_misses + state.get_misses,
                )
                for state in engine.namespaces()
            ],
            leases=len(engine.leases),
            leases_expired=engine.leases.expired_total,
            metrics=convert.metric_samples(self.metrics.registry) if request.include_metrics else [],
        )


def _offload_distance(distance: int, layers: int) -> int:
    """SaveLayers' offload_distance as the planner's (NONE for 0 or -1), or INVALID_ARGUMENT."""
    if distance in (0, NONE):
        return NONE
    if not 1 <= distance < layers:
        raise InvalidArgument(f"offload_distance must be -1 or 0 (every layer kept) or in [1, {layers - 1}] for "
                              f"{layers} layers, got {distance}")
    return distance


def _not_stored(statuses, stored: int, requested: int) -> NotDurable:
    """The error of a durable Put whose keys[stored:] were not stored (the rest are durable)."""
    blocked = statuses[stored] if stored < len(statuses) else ReserveStatus.NO_SPACE
    if blocked == ReserveStatus.IN_FLIGHT:
        code, why = "UNAVAILABLE", "another client is writing them now; retry once it has committed"
    else:
        code, why = "RESOURCE_EXHAUSTED", "the host tier has no slot to spare (every slot is pinned or being written)"
    return NotDurable(code, f"keys[{stored}:{requested}] were not stored, so they are not durable: {why}; the first "
                      f"{stored} are durable", stored, requested)
