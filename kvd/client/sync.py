"""The blocking client: runs the client's operations (kvd.client._ops, and by job _reads, _writes,
_admin and _device_ops) over a grpc channel."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import numpy as np

from kvd.client import _admin, _channel, _device_ops, _ops, _reads, _wire, _writes
from kvd.client._wire import ClusterLookupResult, GetResult, LookupResult, Namespace, PrefetchResult
from kvd.client.events import EventSnapshot, EventWatch, SnapshotParts, snapshot_request, watch_request
from kvd.client.namespaces import NamespaceDeleted, NamespaceInfo
from kvd.client.pinned import PinnedBlocks, ReservedBlocks
from kvd.core.keys import NamespaceSpec
from kvd.errors import FailedPrecondition
from kvd.v1 import kvd_pb2


class Client(_ops.ClientBase):
    """A blocking kvd client.

    `target`: "unix:///path/kvd.sock" or "host:port". `use_shared_memory`:
    None maps the daemon's arena when it can and falls back to inline bytes;
    True requires the arena; False never maps it. Every RPC has `timeout_s`.
    `token`: a tenant's bearer token, for a daemon with auth.mode = "token"
    (default: $KVD_TOKEN). `tls`: a TlsConfig, for a TCP listener with TLS.
    `streamed_get_min_bytes`: a get_numpy of at least this many bytes
    streams (GetBlocks) and copies blocks out while later ones are still
    read from disk (default 16 MiB).
    """

    def __init__(self, target: str, *, tls: _channel.TlsConfig | None = None, **options: Any) -> None:
        credentials, channel_options = _channel.channel_arguments(tls)
        if credentials is None:
            self._channel = grpc.insecure_channel(target, options=channel_options)
        else:
            self._channel = grpc.secure_channel(target, credentials, options=channel_options)
        super().__init__(target, self._channel, **options)

    def _run(self, op: _ops.Op) -> Any:
        try:
            call = next(op)
            while True:
                try:
                    response = self._call(*call)
                except grpc.RpcError as error:
                    call = op.throw(error)
                else:
                    call = op.send(response)
        except StopIteration as done:
            return done.value

    def _call(self, method: str, request: Any) -> Any:
        if method == _ops.NEXT:
            return next(request, None)
        # A streaming method answers with its iterator at once.
        return getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata)

    def close(self) -> None:
        self.session.close()
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def uses_shared_memory(self) -> bool:
        return self._run(_ops.uses_shared_memory(self.session))

    def arena_info(self) -> kvd_pb2.ArenaInfoResponse:
        """The daemon's host arena: slot_bytes, slot_count, max_message_bytes, ..."""
        return self._run(_ops.arena_info(self.session))

    def register_namespace(self, spec: NamespaceSpec) -> Namespace:
        return self._run(_admin.register_namespace(self.session, spec))

    def lookup(self, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes = b"",
               include_remote: bool | None = False, load_times: bool = False) -> LookupResult:
        """The stored prefix of `keys`; include_remote: also what a peer holds (TIER_REMOTE), in a
        cluster (None: where the daemon is in one; a daemon outside a cluster is asked once);
        load_times: also how long each part would take to load now (LookupResult.load_s)."""
        return self._run(_reads.lookup(self.session, namespace, keys, parent_key, include_remote,
                                                 load_times))

    def cluster_lookup(self, namespace: Namespace, keys: Sequence[bytes],
                       load_times: bool = False) -> ClusterLookupResult:
        """Which nodes of the cluster hold how much of the chain `keys` (given from its root); with
        `load_times`, also how soon each could have its part in its host memory (NodeMatch.load_s)."""
        return self._run(_reads.cluster_lookup(self.session, namespace, keys, load_times))

    def prefetch(
        self, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes = b"", wait: bool = False
    ) -> PrefetchResult:
        """Ask for the stored prefix of `keys` to be read from disk into host memory ahead of a Get.

        Returns as soon as the daemon has queued the reads (wait=False), or
        once they are done (wait=True). Blocks only on disk are read at a
        lower priority than Gets; a Get of one still being read waits for
        it and gets verified bytes. At most disk.prefetch_max_blocks reads
        are in flight in the daemon: past that the rest is refused, which
        is not an error (see PrefetchResult). Without a disk tier nothing
        needs reading and the result only reports what is stored.
        """
        return self._run(_reads.prefetch(self.session, namespace, keys, parent_key, wait))

    def put(
        self, namespace: Namespace, keys: Sequence[bytes], blocks: Any, parent_key: bytes = b"", durable: bool = False
    ) -> int:
        """Store the blocks of `keys` not yet stored; returns how many were written.

        durable=True: returns only once every block of `keys` is on disk (then
        len(keys)), or raises NotDurableError saying how many leading keys
        are durable and why the next is not (see kvd.client._writes.put)."""
        return self._run(_writes.put(self.session, namespace, keys, blocks, parent_key, durable))

    def get_numpy(
        self, namespace: Namespace, keys: Sequence[bytes], out: np.ndarray | None = None, parent_key: bytes = b""
    ) -> np.ndarray:
        """The stored prefix of `keys` as (matched, *block_shape); into `out` if given."""
        return self._run(_reads.get_numpy(self.session, namespace, keys, out, parent_key))

    def get(self, namespace: Namespace, keys: Sequence[bytes], out: np.ndarray | None = None,
            parent_key: bytes = b"") -> GetResult:
        """get_numpy, and why the prefix is not longer: `result.corrupt` when the next block
        failed its checksum on disk (kvd dropped it: recompute it), rather than never stored."""
        return self._run(_reads.get(self.session, namespace, keys, out, parent_key))

    def get_pinned(self, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes = b"") -> PinnedBlocks:
        """The stored prefix of `keys` left in the daemon's arena, pinned there until released:
        read-only views, no copy (kvd.client.pinned). Needs the shared-memory arena."""
        response, arena = self._run(_reads.get_pinned(self.session, namespace, keys, parent_key))
        if response is None:
            return PinnedBlocks(namespace, arena, 0, (), 0, lambda ids: None)
        return PinnedBlocks(namespace, arena, response.matched, response.offsets, response.lease_id,
                            lambda ids: self._run(_ops.release(self.session, ids)))

    def reserve(self, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes = b"") -> ReservedBlocks:
        """Slots in the daemon's arena for a Put the caller fills in place, then commits
        (kvd.client.pinned). Needs the shared-memory arena."""
        response = self._run(_writes.reserve_slots(self.session, namespace, keys, parent_key))
        return ReservedBlocks(self._run, self.session, namespace, keys, parent_key, response)

    def get_layers(
        self, namespace: Namespace, keys: Sequence[bytes], out: np.ndarray | None = None, parent_key: bytes = b""
    ) -> Iterator[tuple[int, np.ndarray]]:
        """Yield (layers_ready, blocks) as the stored prefix lands, layer by layer.

        blocks is (matched, *block_shape), a view of `out` (or of a new
        array) in which layers [0, layers_ready) of every block are filled;
        use only the newest one: `matched` can shrink if a block read from
        disk turns out corrupt. Needs the shared-memory arena. One numpy copy
        per layer, whatever the number of blocks.
        """
        stream, first = self._run(_reads.open_get_stream(self.session, "GetLayers", namespace, keys, parent_key))
        if stream is None:
            raise FailedPrecondition("get_layers needs the daemon's shared-memory arena; use get_numpy")
        layers = _wire.StreamedCopy(namespace, self.session.arena, first, out)
        try:
            message = first
            while message is not None:
                yield layers.take_layers(message)
                message = self._call(_ops.NEXT, stream)
        finally:
            stream.cancel()
            if first.lease_id:
                self._run(_ops.release(self.session, [first.lease_id]))

    def get_tensor(self, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes = b"") -> Any:
        """The stored prefix of `keys` as a CPU torch tensor of the namespace dtype."""
        from kvd.client.tensors import rows_to_tensor

        return rows_to_tensor(self.get_numpy(namespace, keys, parent_key=parent_key), namespace.spec.kv_dtype)

    def delete(self, namespace: Namespace, keys: Sequence[bytes]) -> tuple[int, int]:
        """Remove blocks (and their descendants); returns (deleted, pinned)."""
        return self._run(_writes.delete(self.session, namespace, keys))

    def register_pool(self, namespace: Namespace, layers: Sequence[bytes], num_blocks: int, flags: bytes,
                      lease_ms: int = 0, page_stride: int = 0, v_offset: int = 0,
                      io_ring: bool = False) -> kvd_pb2.RegisterPoolResponse:
        """Register an engine's paged KV pool (IPC handles, one per layer, and its flag words' handle;
        page_stride and v_offset for pools that keep K and V apart, io_ring to read disk hits through
        the pool's I/O ring, see the proto); kvd.client.device.DevicePool is the engine-side helper."""
        return self._run(_device_ops.register_pool(self.session, namespace, layers, num_blocks, flags, lease_ms,
                                                   page_stride, v_offset, io_ring))

    def unregister_pool(self, pool_id: int) -> None:
        self._run(_device_ops.unregister_pool(self.session, pool_id))

    def save_layers(self, namespace: Namespace, pool_id: int, keys: Sequence[bytes], pages: Sequence[int],
                    engine_flag: int, kvd_flag: int, base: int, parent_key: bytes = b"",
                    offload_distance: int = -1) -> kvd_pb2.SaveLayersResponse:
        """kvd copies the blocks of `keys` out of the pool's `pages`, layer by layer (see the proto);
        with a device tier, it keeps there the layers a plan at `offload_distance` keeps on the GPU."""
        return self._run(_device_ops.save_layers(self.session, namespace, pool_id, keys, pages, engine_flag, kvd_flag,
                                                 base, parent_key, offload_distance))

    def load_layers(self, namespace: Namespace, pool_id: int, keys: Sequence[bytes], pages: Sequence[int],
                    kvd_flag: int, base: int, parent_key: bytes = b"",
                    cancel_flag: int | None = None) -> kvd_pb2.LoadLayersResponse:
        """kvd copies the stored prefix of `keys` into the pool's `pages`, flagging each layer;
        storing `base` into flags[cancel_flag] cancels what is not yet issued (see the proto)."""
        return self._run(_device_ops.load_layers(self.session, namespace, pool_id, keys, pages, kvd_flag, base,
                                                 parent_key, cancel_flag))

    def stats(self) -> kvd_pb2.StatsResponse:
        return self._run(_admin.stats(self.session))

    def demote(self) -> kvd_pb2.DemoteResponse:
        """Drop the host copies a lower tier also holds, so the next Get of them reads
        the disk (an admin call; see the proto): (blocks, bytes) demoted, blocks kept."""
        return self._run(_admin.demote(self.session))

    def namespaces(self, tenant: str = "") -> list[NamespaceInfo]:
        """Every namespace the daemon knows (of `tenant` only, if given): ids, tenant, spec (whose
        model_revision is the identity an engine's connector records), blocks and bytes per tier,
        hits and misses (an admin call; see kvd.client.namespaces)."""
        return self._run(_admin.namespaces(self.session, tenant))

    def find_namespace(self, name_or_id: str, tenant: str = "") -> NamespaceInfo:
        """The one namespace `name_or_id` names: its model_id, its id, or an id prefix of at least
        8 hex digits (kvd.client.namespaces.resolve_namespace); an admin call."""
        return self._run(_admin.find_namespace(self.session, name_or_id, tenant))

    def delete_namespace(self, namespace: str | NamespaceInfo, tenant: str = "") -> NamespaceDeleted:
        """Remove every block of a namespace from every tier, durably (an admin call; see the proto's
        DeleteNamespaceRequest): the one `namespace` names (as find_namespace), or that very one.
        Its registration stays: engines using it simply miss."""
        return self._run(_admin.delete_namespace(self.session, namespace, tenant))

    def plan_placement(self, request: kvd_pb2.PlanPlacementRequest) -> kvd_pb2.PlanPlacementResponse:
        """A decode batch's KV placement (kvd.planner; docs/planner.md)."""
        return self._run(_device_ops.plan_placement(self.session, request))

    def report_step(self, request: kvd_pb2.ReportStepRequest) -> kvd_pb2.ReportStepResponse:
        """One observed decode step for a plan profile; the answer says whether to plan again."""
        return self._run(_device_ops.report_step(self.session, request))

    def watch_events(self, namespace: Namespace, from_sequence: int = 0, instance_id: str = "") -> EventWatch:
        """Subscribe to the namespace's KV events: an iterator of KvEvent.

        Returns once the daemon has registered the subscription: from then on
        every event from `from_sequence` (0: only events after this call) is
        delivered in order, without gaps. `instance_id` (from a snapshot or an
        earlier watch) makes the daemon refuse sequence numbers of another
        instance. Raises ResyncRequired, here or while iterating, when events
        were missed: take a new event_snapshot and watch from its sequence + 1
        (see kvd.client.events). The stream has no deadline; close the watch,
        or use it in a `with` block, to end it.
        """
        return EventWatch(
            self._stub.WatchEvents(watch_request(namespace, from_sequence, instance_id), metadata=self._metadata)
        )

    def event_snapshot(self, namespace: Namespace) -> EventSnapshot:
        """The blocks the namespace serves and their tiers, right after event `sequence`."""
        parts = SnapshotParts()
        for message in self._stub.EventSnapshot(snapshot_request(namespace), timeout=self.timeout_s,
                                                metadata=self._metadata):
            parts.add(message)
        return parts.result()
