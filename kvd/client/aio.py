"""The asyncio client: runs the client's operations (kvd.client._ops, and by job _reads, _writes,
_admin and _device_ops) over a grpc.aio channel."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import numpy as np

from kvd.client import _admin, _channel, _device_ops, _ops, _reads, _wire, _writes
from kvd.client._wire import ClusterLookupResult, GetResult, LookupResult, Namespace, PrefetchResult
from kvd.client.events import AsyncEventWatch, EventSnapshot, SnapshotParts, snapshot_request, watch_request
from kvd.client.namespaces import NamespaceDeleted, NamespaceInfo
from kvd.client.pinned import AsyncPinnedBlocks, AsyncReservedBlocks
from kvd.core.keys import NamespaceSpec
from kvd.errors import FailedPrecondition
from kvd.v1 import kvd_pb2


class AsyncClient(_ops.ClientBase):
    """The asyncio twin of kvd.client.Client; same arguments, same methods, awaited."""

    def __init__(self, target: str, *, tls: _channel.TlsConfig | None = None, **options: Any) -> None:
        credentials, channel_options = _channel.channel_arguments(tls)
        if credentials is None:
            self._channel = grpc.aio.insecure_channel(target, options=channel_options)
        else:
            self._channel = grpc.aio.secure_channel(target, credentials, options=channel_options)
        super().__init__(target, self._channel, **options)

    async def _run(self, op: _ops.Op) -> Any:
        try:
            call = next(op)
            while True:
                try:
                    response = await self._call(*call)
                except grpc.RpcError as error:
                    call = op.throw(error)
                else:
                    call = op.send(response)
        except StopIteration as done:
            return done.value

    async def _call(self, method: str, request: Any) -> Any:
        if method == _ops.NEXT:
            message = await request.read()
            return None if message is grpc.aio.EOF else message
        call = getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)
        return call if method in _ops.STREAMING else await call

    async def close(self) -> None:
        self.session.close()
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def uses_shared_memory(self) -> bool:
        return await self._run(_ops.uses_shared_memory(self.session))

    async def arena_info(self) -> kvd_pb2.ArenaInfoResponse:
        """The daemon's host arena: slot_bytes, slot_count, max_message_bytes, ..."""
        return await self._run(_ops.arena_info(self.session))

    async def register_namespace(self, spec: NamespaceSpec) -> Namespace:
        return await self._run(_admin.register_namespace(self.session, spec))

    async def lookup(self, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes = b"",
                     include_remote: bool | None = False, load_times: bool = False) -> LookupResult:
        """The stored prefix of `keys`; include_remote: also what a peer holds (TIER_REMOTE), in a
        cluster (None: where the daemon is in one; a daemon outside a cluster is asked once);
        load_times: also how long each part would take to load now (LookupResult.load_s)."""
        return await self._run(_reads.lookup(self.session, namespace, keys, parent_key, include_remote,
                                                 load_times))

    async def cluster_lookup(self, namespace: Namespace, keys: Sequence[bytes],
                             load_times: bool = False) -> ClusterLookupResult:
        """Which nodes of the cluster hold how much of the chain `keys` (given from its root); with
        `load_times`, also how soon each could have its part in its host memory (NodeMatch.load_s)."""
        return await self._run(_reads.cluster_lookup(self.session, namespace, keys, load_times))

    async def prefetch(
        self, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes = b"", wait: bool = False
    ) -> PrefetchResult:
        """As Client.prefetch: read a prefix from disk into host memory ahead of a Get."""
        return await self._run(_reads.prefetch(self.session, namespace, keys, parent_key, wait))

    async def put(
        self, namespace: Namespace, keys: Sequence[bytes], blocks: Any, parent_key: bytes = b"", durable: bool = False
    ) -> int:
        return await self._run(_writes.put(self.session, namespace, keys, blocks, parent_key, durable))

    async def get_numpy(
        self, namespace: Namespace, keys: Sequence[bytes], out: np.ndarray | None = None, parent_key: bytes = b""
    ) -> np.ndarray:
        return await self._run(_reads.get_numpy(self.session, namespace, keys, out, parent_key))

    async def get(self, namespace: Namespace, keys: Sequence[bytes], out: np.ndarray | None = None,
                  parent_key: bytes = b"") -> GetResult:
        """Client.get: the blocks and why there are not more."""
        return await self._run(_reads.get(self.session, namespace, keys, out, parent_key))

    async def get_layers(
        self, namespace: Namespace, keys: Sequence[bytes], out: np.ndarray | None = None, parent_key: bytes = b""
    ) -> AsyncIterator[tuple[int, np.ndarray]]:
        """Client.get_layers as an async iterator: `async for layers_ready, blocks in ...`."""
        stream, first = await self._run(_reads.open_get_stream(self.session, "GetLayers", namespace, keys, parent_key))
        if stream is None:
            raise FailedPrecondition("get_layers needs the daemon's shared-memory arena; use get_numpy")
        layers = _wire.StreamedCopy(namespace, self.session.arena, first, out)
        try:
            message = first
            while message is not None:
                yield layers.take_layers(message)
                message = await self._call(_ops.NEXT, stream)
        finally:
            stream.cancel()
            if first.lease_id:
                await self._run(_ops.release(self.session, [first.lease_id]))

    async def get_pinned(self, namespace: Namespace, keys: Sequence[bytes],
                         parent_key: bytes = b"") -> AsyncPinnedBlocks:
        """As Client.get_pinned; release with `async with` or `await held.release()`."""
        response, arena = await self._run(_reads.get_pinned(self.session, namespace, keys, parent_key))
        if response is None:
            return AsyncPinnedBlocks(namespace, arena, 0, (), 0, self._release_leases)
        return AsyncPinnedBlocks(namespace, arena, response.matched, response.offsets, response.lease_id,
                                 self._release_leases)

    async def reserve(self, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes = b"") -> AsyncReservedBlocks:
        """As Client.reserve; `await slots.commit(...)`, released with `async with`."""
        response = await self._run(_writes.reserve_slots(self.session, namespace, keys, parent_key))
        return AsyncReservedBlocks(self._run, self.session, namespace, keys, parent_key, response)

    async def _release_leases(self, lease_ids: list[int]) -> None:
        await self._run(_ops.release(self.session, lease_ids))

    async def get_tensor(self, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes = b"") -> Any:
        from kvd.client.tensors import rows_to_tensor

        array = await self.get_numpy(namespace, keys, parent_key=parent_key)
        return rows_to_tensor(array, namespace.spec.kv_dtype)

    async def delete(self, namespace: Namespace, keys: Sequence[bytes]) -> tuple[int, int]:
        return await self._run(_writes.delete(self.session, namespace, keys))

    async def stats(self) -> kvd_pb2.StatsResponse:
        return await self._run(_admin.stats(self.session))

    async def demote(self) -> kvd_pb2.DemoteResponse:
        """Drop the host copies a lower tier also holds (an admin call; see the proto)."""
        return await self._run(_admin.demote(self.session))

    async def namespaces(self, tenant: str = "") -> list[NamespaceInfo]:
        """Every namespace the daemon knows, with its blocks per tier (an admin call; Client.namespaces)."""
        return await self._run(_admin.namespaces(self.session, tenant))

    async def find_namespace(self, name_or_id: str, tenant: str = "") -> NamespaceInfo:
        """The one namespace `name_or_id` names (an admin call; Client.find_namespace)."""
        return await self._run(_admin.find_namespace(self.session, name_or_id, tenant))

    async def delete_namespace(self, namespace: str | NamespaceInfo, tenant: str = "") -> NamespaceDeleted:
        """Every block of a namespace removed from every tier, durably (an admin call; Client.delete_namespace)."""
        return await self._run(_admin.delete_namespace(self.session, namespace, tenant))

    async def plan_placement(self, request: kvd_pb2.PlanPlacementRequest) -> kvd_pb2.PlanPlacementResponse:
        """A decode batch's KV placement (kvd.planner; docs/planner.md)."""
        return await self._run(_device_ops.plan_placement(self.session, request))

    async def report_step(self, request: kvd_pb2.ReportStepRequest) -> kvd_pb2.ReportStepResponse:
        """One observed decode step for a plan profile; the answer says whether to plan again."""
        return await self._run(_device_ops.report_step(self.session, request))

    async def watch_events(self, namespace: Namespace, from_sequence: int = 0, instance_id: str = "") -> AsyncEventWatch:
        """As Client.watch_events; iterate the result with `async for`."""
        call = self._stub.WatchEvents(watch_request(namespace, from_sequence, instance_id), metadata=self._metadata)
        return await AsyncEventWatch(call).start()

    async def event_snapshot(self, namespace: Namespace) -> EventSnapshot:
        """As Client.event_snapshot."""
        parts = SnapshotParts()
        async for message in self._stub.EventSnapshot(snapshot_request(namespace), timeout=self.timeout_s,
                                                      metadata=self._metadata):
            parts.add(message)
        return parts.result()
