"""The gRPC service: validates requests and drives the engine.

Handlers run on the daemon's event loop and call the engine synchronously,
never awaiting in the middle of a state change, so each engine call is
atomic. Operating errors (KvdError) become a gRPC status here and only here;
anything else is a bug and surfaces as INTERNAL with a logged traceback.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvd import __version__
from kvd.clock import Clock
from kvd.core.engine import Engine, ReserveStatus
from kvd.errors import InvalidArgument, KvdError, ResourceExhausted
from kvd.metrics import RpcMetrics
from kvd.server import convert
from kvd.tiers.host import HostArena
from kvd.v1 import kvd_pb2, kvd_pb2_grpc

log = logging.getLogger(__name__)

Request = TypeVar("Request")
Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]


def rpc(method: str) -> Callable[[Handler], Handler]:
    """Measure an RPC and map operating errors to their gRPC status."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def wrapper(self: KvdService, request: Any, context: grpc.aio.ServicerContext) -> Any:
            metrics = self.metrics
            metrics.in_flight.inc()
            started = time.perf_counter()
            code = "OK"
            try:
                return await handler(self, request, context)
            except KvdError as error:
                code = error.code
                await context.abort(convert.status_of(error), error.message)
            except grpc.aio.AbortError:
                raise
            except Exception:
                code = "INTERNAL"
                log.exception("internal error in %s", method)
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the daemon log")
            finally:
                metrics.in_flight.dec()
                metrics.duration.labels(method).observe(time.perf_counter() - started)
                metrics.total.labels(method, code).inc()

        return wrapper

    return decorate


class KvdService(kvd_pb2_grpc.KvdServicer):
    def __init__(
        self, engine: Engine, arena: HostArena, clock: Clock, metrics: RpcMetrics, max_message_bytes: int
    ) -> None:
        self.engine = engine
        self.arena = arena
        self.clock = clock
        self.metrics = metrics
        self.max_message_bytes = max_message_bytes
        self.started_ms = clock.now_ms()

    @rpc("RegisterNamespace")
    async def RegisterNamespace(self, request, context):
        if not request.HasField("spec"):
            raise InvalidArgument("spec must be set")
        spec = convert.spec_from_proto(request.spec)
        known = len(self.engine.namespaces())
        state = self.engine.register_namespace(spec)
        slot_bytes = self.arena.layout.slot_bytes
        if len(self.engine.namespaces()) > known and state.block_bytes * 2 <= slot_bytes:
            log.warning(
                "namespace blocks fill at most half a host slot; set host.slot_bytes near the block size",
                extra={
                    "model_id": spec.model_id,
                    "block_bytes": state.block_bytes,
                    "slot_bytes": slot_bytes,
                    "slot_use_percent": round(100.0 * state.block_bytes / slot_bytes, 1),
                },
            )
        return kvd_pb2.RegisterNamespaceResponse(
            namespace_id=state.namespace_id, block_bytes=state.block_bytes, layer_bytes=state.spec.layer_bytes
        )

    @rpc("ArenaInfo")
    async def ArenaInfo(self, request, context):
        layout = self.arena.layout
        return kvd_pb2.ArenaInfoResponse(
            shm_name=self.arena.shm_name,
            arena_bytes=layout.arena_bytes,
            slot_bytes=layout.slot_bytes,
            slot_count=layout.slot_count,
            instance_id=self.arena.instance_id,
            max_message_bytes=self.max_message_bytes,
        )

    @rpc("Lookup")
    async def Lookup(self, request, context):
        matched = self.engine.lookup(request.namespace_id, list(request.keys), request.parent_key)
        return kvd_pb2.LookupResponse(matched=len(matched), tiers=convert.tiers(matched))

    @rpc("Reserve")
    async def Reserve(self, request, context):
        result = self.engine.reserve(
            request.namespace_id,
            request.client_id,
            request.parent_key,
            list(request.keys),
            request.lease_ms,
            self.clock.now_ms(),
        )
        slot_bytes = self.arena.layout.slot_bytes
        return kvd_pb2.ReserveResponse(
            lease_id=result.lease.lease_id if result.lease else 0,
            lease_deadline_ms=result.lease.deadline_ms if result.lease else 0,
            statuses=[int(status) for status in result.statuses],
            offsets=[slot * slot_bytes if slot >= 0 else 0 for slot in result.slots],
        )

    @rpc("Commit")
    async def Commit(self, request, context):
        convert.ack_supported(request.ack)
        sealed, aborted = self.engine.commit(
            request.namespace_id,
            request.client_id,
            request.lease_id,
            request.keys,
            request.abort_keys,
            self.clock.now_ms(),
        )
        return kvd_pb2.CommitResponse(sealed=sealed, aborted=aborted)

    @rpc("PutInline")
    async def PutInline(self, request, context):
        convert.ack_supported(request.ack)
        state = self.engine.namespace(request.namespace_id)
        if len(request.blocks) != len(request.keys):
            raise InvalidArgument(f"{len(request.keys)} keys but {len(request.blocks)} blocks; send one block per key")
        for position, payload in enumerate(request.blocks):
            if len(payload) != state.block_bytes:
                raise InvalidArgument(
                    f"blocks[{position}] is {len(payload)} bytes; this namespace's blocks are {state.block_bytes} bytes"
                )
        now_ms = self.clock.now_ms()
        result = self.engine.reserve(
            request.namespace_id, request.client_id, request.parent_key, request.keys, 0, now_ms
        )
        sealed = 0
        if result.lease is not None:
            # Reserve, copy and seal without an await in between: no other
            # request can observe the half-written blocks.
            for position, status in enumerate(result.statuses):
                if status == ReserveStatus.RESERVED:
                    self.arena.write(result.slots[position], request.blocks[position])
            sealed, _ = self.engine.commit(
                request.namespace_id, request.client_id, result.lease.lease_id, [], [], now_ms
            )
        return kvd_pb2.PutInlineResponse(statuses=[int(status) for status in result.statuses], sealed=sealed)

    @rpc("Get")
    async def Get(self, request, context):
        if request.inline:
            state = self.engine.namespace(request.namespace_id)
            matched = self.engine.peek(request.namespace_id, list(request.keys), request.parent_key)
            response_bytes = len(matched) * (state.block_bytes + 8)
            if response_bytes > self.max_message_bytes:
                raise ResourceExhausted(
                    f"an inline Get of {len(matched)} blocks is {response_bytes} bytes, over the "
                    f"{self.max_message_bytes}-byte message limit; ask for at most "
                    f"{max(1, self.max_message_bytes // (state.block_bytes + 8) - 1)} keys per call"
                )
            blocks = [self.arena.read(block.host_slot, state.block_bytes) for block in matched]
            return kvd_pb2.GetResponse(matched=len(matched), blocks=blocks, tiers=convert.tiers(matched))
        lease, matched = self.engine.get(
            request.namespace_id,
            request.client_id,
            list(request.keys),
            request.lease_ms,
            self.clock.now_ms(),
            request.parent_key,
        )
        slot_bytes = self.arena.layout.slot_bytes
        return kvd_pb2.GetResponse(
            matched=len(matched),
            lease_id=lease.lease_id if lease else 0,
            lease_deadline_ms=lease.deadline_ms if lease else 0,
            offsets=[block.host_slot * slot_bytes for block in matched],
            tiers=convert.tiers(matched),
        )

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
        return kvd_pb2.DeleteResponse(deleted=deleted, pinned=pinned)

    @rpc("Stats")
    async def Stats(self, request, context):
        engine = self.engine
        host = engine.host
        return kvd_pb2.StatsResponse(
            version=__version__,
            instance_id=self.arena.instance_id,
            uptime_s=(self.clock.now_ms() - self.started_ms) / 1000.0,
            tiers=[
                kvd_pb2.TierStats(
                    tier=kvd_pb2.TIER_HOST,
                    blocks=host.resident_blocks,
                    bytes_used=host.occupied_bytes,
                    payload_bytes=host.used_bytes,
                    capacity_bytes=host.capacity_bytes,
                    pinned_blocks=engine.pinned_blocks,
                    evictions=host.counters.evictions,
                )
            ],
            namespaces=[
                kvd_pb2.NamespaceStats(
                    namespace_id=state.namespace_id,
                    model_id=state.spec.model_id,
                    blocks=len(state.index),
                    block_bytes=state.block_bytes,
                    hits=state.lookup_hits + state.get_hits,
                    misses=state.lookup_misses + state.get_misses,
                )
                for state in engine.namespaces()
            ],
            leases=len(engine.leases),
            leases_expired=engine.leases.expired_total,
        )
