"""The gRPC service: validates requests and drives the engine.

KvdService is the servicer gRPC calls; its handlers live by concern in
kvd/server/handlers/ (blocks: namespaces, Lookup, Puts, leases, Delete,
Prefetch; reads: Gets; events; admin: Stats, Demote, ListNamespaces,
DeleteNamespace; device: pools, SaveLayers, LoadLayers, placement
planning; cluster: ClusterLookup, and the holder's side of the peers'
ReadBlocks, PinBlocks and ReleasePins), each a part of this class; every
Kvd call runs under kvd.server.rpc's wrapper. It has every method of
kvd.v1.Kvd (kvd.server.registration registers each from the service's
descriptor, and a missing one stops the daemon's start), and builds its
answers in kvd.server.convert.
This module keeps what they share: the service's state, the tenant scope
of every request, and the drain.

Handlers run on the daemon's event loop and call the engine synchronously,
never awaiting in the middle of a state change, so each engine call is
atomic. Operating errors (KvdError) become a gRPC status here and only here;
anything else is a bug and surfaces as INTERNAL with a logged traceback.

Before any handler runs, its request is brought inside the caller's tenant
(`KvdService._resolve_tenant_ids`, kvd.server.auth): namespace ids and client ids are
replaced by the engine's ids of the caller's own. Without auth the caller
is no tenant, and only namespaces of no tenant are found.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any


from kvd.clock import Clock
from kvd.core.engine import Engine, namespace_not_found
from kvd.errors import (
    Unauthenticated,
)
from kvd.metrics import RpcMetrics
from kvd.server.auth import CURRENT_TENANT, Tenant, scoped_client_id
from kvd.server.handlers.admin import AdminHandlers
from kvd.server.handlers.blocks import BlockHandlers
from kvd.server.handlers.cluster import ClusterHandlers
from kvd.server.handlers.device import DeviceHandlers
from kvd.server.handlers.events import EventHandlers
from kvd.server.handlers.reads import ReadHandlers
from kvd.server.planning import Planning
from kvd.tiers.host import HostArena

if TYPE_CHECKING:
    from kvd.planes.disk import DiskPlane

log = logging.getLogger(__name__)


class KvdService(BlockHandlers, ReadHandlers, EventHandlers, AdminHandlers, DeviceHandlers, ClusterHandlers):
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
        # kvd.planes.cluster_fetch.ClusterFetch when its Gets fetch from peers (set by the daemon).
        self.cluster = None
        self.cluster_fetch = None
        # Blocks pinned for peers' NIXL reads, by lease id (kvd.server.handlers.cluster).
        self._peer_pins = {}
        # kvd.planes.device.DevicePlane when [device] kind is not "off" (set by the daemon).
        self.device_plane = None
        # [device] disk_loads_keep_host_copy: a LoadLayers' blocks read from disk stay in host memory.
        self.keep_disk_loads_in_host = True
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

    def _resolve_tenant_ids(self, request) -> None:
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


    # ------------------------------------------------------------------
    # KV events (kvd.core.events): WatchEvents and EventSnapshot
    #
    # A subscriber is a cursor into the engine's shared ring of recent
    # events, never a queue of its own: however slow its client, it holds at
    # most WATCH_READ_EVENTS events, plus what gRPC's flow-control window
    # buffers. When its next event has left the ring it is sent
    # RESYNC_REQUIRED and its stream ends: the client takes a snapshot and
    # watches again, the same path as a resume from a too-old sequence.


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


    # ------------------------------------------------------------------ placement planning


    # ------------------------------------------------------------------ device plane
