"""The daemons' Cluster service and the client side of it.

`DirectoryServicer` serves kvd.v1.Cluster on the daemon's listener: a
holder's DirectoryUpdate lands in this node's DirectoryShard, a router's
DirectoryQuery reads it, and a fetching peer's ReadBlocks, PinBlocks and
ReleasePins go on to the holder's side of them (kvd.server.handlers.cluster).
Every call must carry the cluster credential; an update, and every call
for blocks, must come from a live member under its current incarnation (so
a node that left, or a process that restarted, cannot write entries for
the one that replaced it).

`Peers` keeps one gRPC channel per live peer, opened on join and closed on
leave, and makes the calls with the credential and a deadline.

The messages of both are built and read in kvd.cluster.wire.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable, Sequence

import grpc

from kvd.cluster import wire
from kvd.cluster.directory import DirectoryShard
from kvd.cluster.members import Member, MemberView
from kvd.core.keys import KEY_BYTES

log = logging.getLogger("kvd.cluster")

SECRET_METADATA = "x-kvd-cluster-secret"
SERVICE_NAME = "kvd.v1.Cluster"
MAX_QUERY_KEYS = 1 << 16
MAX_UPDATE_KEYS = 1 << 18
# Longer than any node-to-node call's deadline (config caps them at 60 s).
CLOSE_GRACE_S = 61.0


class DirectoryServicer(wire.ClusterServicer):
    def __init__(self, shard: DirectoryShard, view: MemberView, secret: bytes, serves_nixl: Callable[[], bool]) -> None:
        self.shard = shard
        self.view = view
        self.secret = secret
        # Whether this node has a NIXL agent for peers' READs (it opens when the node joins).
        self.serves_nixl = serves_nixl
        # The holder's side of ReadBlocks, PinBlocks, ReleasePins and PriceBlocks (the kvd service,
        # kvd.server.handlers.cluster); set by the daemon.
        self.holder = None

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> None:
        sent = dict(context.invocation_metadata() or ()).get(SECRET_METADATA, "")
        if not self.secret or not hmac.compare_digest(sent.encode(), self.secret):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "a node-to-node call needs the cluster credential")

    async def _check_member(self, request, context: grpc.aio.ServicerContext) -> None:
        member = self.view.get(request.node)
        if member is None or member.incarnation != request.incarnation:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{request.node!r} incarnation {request.incarnation} is not a live member here")

    async def ReadBlocks(self, request, context):
        await self._authenticate(context)
        await self._check_member(request, context)
        if self.holder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node serves no blocks yet")
        async for message in self.holder.read_blocks_for_peer(request, context):
            yield message

    async def PinBlocks(self, request, context):
        await self._authenticate(context)
        await self._check_member(request, context)
        if self.holder is None or not self.serves_nixl():
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this node has no NIXL agent; use ReadBlocks")
        return await self.holder.pin_blocks_for_peer(request, context)

    async def ReleasePins(self, request, context):
        await self._authenticate(context)
        await self._check_member(request, context)
        checksums = (await self.holder.release_pins_of_peer(request.node, request.lease_id)
                     if self.holder is not None else None)
        if checksums is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no pins of {request.node!r} under lease {request.lease_id}")
        return wire.release_pins_response(checksums)

    async def PriceBlocks(self, request, context):
        await self._authenticate(context)
        if self.holder is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this node serves no blocks yet")
        try:
            wire.packed_keys("packed_keys", request.packed_keys, MAX_QUERY_KEYS)  # whole keys, not too many
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        matched, load_s = await self.holder.price_blocks_for_peer(request.namespace_id, request.packed_keys)
        return wire.price_blocks_response(matched, load_s)

    async def DirectoryUpdate(self, request, context):
        await self._authenticate(context)
        await self._check_member(request, context)
        try:
            stored = wire.packed_keys("stored_keys", request.stored_keys, MAX_UPDATE_KEYS)
            removed = wire.packed_keys("removed_keys", request.removed_keys, MAX_UPDATE_KEYS)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        if request.reset:
            self.shard.drop_node(request.node)
        applied = self.shard.remove(request.node, removed) + self.shard.add(request.node, stored)
        return wire.directory_update_response(applied)

    async def DirectoryQuery(self, request, context):
        await self._authenticate(context)
        total = sum(len(segment) for segment in request.segments) // KEY_BYTES
        if total > MAX_QUERY_KEYS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{total} keys in one query, at most {MAX_QUERY_KEYS}")
        try:
            segments = [wire.packed_keys(f"segments[{i}]", data, MAX_QUERY_KEYS) for i, data in enumerate(request.segments)]
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return query_response(self.shard, segments)


def query_response(shard: DirectoryShard, segments: Sequence[Sequence[bytes]]):
    """The DirectoryQueryResponse of this node's `shard` for `segments`, each a list of keys."""
    return wire.directory_query_response([shard.query(keys) for keys in segments])


class Peers:
    """One channel per live peer; calls carry the credential and a deadline."""

    def __init__(self, self_name: str, secret: bytes, timeout_s: float, max_message_bytes: int = 64 << 20,
                 credentials: grpc.ChannelCredentials | None = None, server_name: str = "") -> None:
        self.self_name = self_name
        self.options = [("grpc.max_receive_message_length", max_message_bytes),
                        ("grpc.max_send_message_length", max_message_bytes)]
        if server_name:
            self.options.append(("grpc.ssl_target_name_override", server_name))
        # TLS (mutual where peers ask for a client certificate) or plaintext.
        self.credentials = credentials
        self.metadata = ((SECRET_METADATA, secret.decode()),)
        self.timeout_s = timeout_s
        self._stubs: dict[str, tuple[grpc.aio.Channel, wire.ClusterStub]] = {}

    def join(self, member: Member) -> None:
        if member.name == self.self_name:
            return
        self.leave(member)
        if self.credentials is not None:
            channel = grpc.aio.secure_channel(member.address, self.credentials, options=self.options)
        else:
            channel = grpc.aio.insecure_channel(member.address, options=self.options)
        self._stubs[member.name] = (channel, wire.cluster_stub(channel))

    def leave(self, member: Member) -> None:
        entry = self._stubs.pop(member.name, None)
        if entry is not None:
            # Calls in flight end by their own deadlines (a dead peer's fail
            # then); closing without a grace would cancel them, and a
            # cancelled call raises CancelledError into the Get waiting on it.
            asyncio.get_running_loop().create_task(entry[0].close(grace=CLOSE_GRACE_S))

    def stub(self, name: str) -> wire.ClusterStub | None:
        entry = self._stubs.get(name)
        return entry[1] if entry is not None else None

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
