"""The cluster's calls: ClusterLookup from clients, and the holder's side of the peers' block calls.

A part of kvd.server.service.KvdService (its handlers by concern); they share the
service's state and reach each other's helpers through self.

The holder serves ReadBlocks, PinBlocks and ReleasePins of the peers' Cluster
service (kvd.cluster.rpc checks the cluster credential and that the caller
is a live member, then hands the call here). The blocks asked for are
pinned through the Get path (`_pinned_prefix`: a disk-only block is read
into host memory first, as for any Get), under a lease of the peer's own
client id:

- ReadBlocks copies them out in messages of about CHUNK_BYTES, each block
  with the CRC-32C of each of its layers, computed from the pinned copy,
  and closes the lease when the stream ends, however it ends: nothing stays
  pinned for a peer.
- PinBlocks, for a peer's one-sided NIXL READ, answers their arena offsets
  and the grant of the namespace's tenant's view of the arena (the only
  memory of this node the peer can READ; kvd.cluster.nixl_transport) at
  once, and computes their per-layer CRC-32Cs on a worker thread while
  the peer READs; ReleasePins ends the pins and hands the CRC-32Cs over.
  Pins still held at that release were held for the whole READ; a release
  that finds them gone (their lease ran out first) gives no checksums, and
  the blocks read become the peer's misses.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import grpc
import numpy as np

from kvd.cluster import wire
from kvd.cluster.keys import split
from kvd.core.keys import PackedKeys
from kvd.core.lease_use import ReadPin
from kvd.core.requests import KeysRequest
from kvd.errors import FailedPrecondition, KvdError
from kvd.io.checksum import crc32c_chunks, crc32c_of_buffers
from kvd.server import convert
from kvd.server.rpc import rpc

CHUNK_BYTES = 8 << 20
PEER_CLIENT_PREFIX = "kvd-cluster-peer:"


@dataclass(slots=True)
class PeerPins:
    """Blocks pinned for a peer's READ, until it releases them or their lease runs out."""

    node: str
    pin: ReadPin
    # layer_checksums of the pinned blocks, running on a worker thread.
    checksums: asyncio.Future


class ClusterHandlers:
    @rpc("ClusterLookup")
    async def ClusterLookup(self, request, context):
        if self.cluster is None:
            raise FailedPrecondition("this kvd is not in a cluster ([cluster] etcd_endpoints is empty)")
        keys = convert.cluster_lookup_keys(request, self.engine.limits.max_batch_keys)
        local = self.engine.lookup(request.namespace_id, keys)
        answer = await self.cluster.lookup(request.namespace_id, request.packed_keys, len(local))
        if request.load_times:
            own = self._price(request.namespace_id, local)
            nodes = [dataclasses.replace(node, load_s=own) if node.local else node for node in answer.nodes]
            answer = dataclasses.replace(answer, nodes=await self.cluster.price(request.namespace_id,
                                                                                request.packed_keys, nodes))
        return convert.cluster_lookup_response(answer, request.load_times)

    def _price(self, namespace_id: bytes, matched) -> float:
        """Seconds until the `matched` blocks could all be in this node's host memory (kvd.planner.load_time)."""
        return float(self._load_seconds(namespace_id, convert.tiers(self.engine, matched))[-1]) if matched else 0.0

    async def price_blocks_for_peer(self, namespace_id: bytes, packed: bytes) -> tuple[int, float]:
        """PriceBlocks: how much of a chain this node holds, and how soon it could all be in host memory."""
        try:
            matched = self.engine.lookup(namespace_id, PackedKeys(packed))
        except KvdError:  # a namespace this node never registered: it holds none of it
            return 0, 0.0
        return len(matched), self._price(namespace_id, matched)

    # -- the holder ---------------------------------------------------------------

    async def _pin_for_peer(self, request, context):
        """Pin what this node has of the chain from `request.first` on, under the peer's own client
        id: (the namespace's spec, the pins (closed once by the caller), their arena offsets)."""
        try:
            state = self.engine.namespace(request.namespace_id)
            keys = split(request.packed_keys)
            if len(request.packed_keys) % 32 or not keys or request.first >= len(keys):
                raise ValueError("packed_keys must be whole 32-byte keys, and first inside them")
            get = KeysRequest(request.namespace_id, PEER_CLIENT_PREFIX + request.node, keys[request.first:],
                              request.lease_ms, self.clock.now_ms(),
                              parent_key=keys[request.first - 1] if request.first else b"")
            lease, _, _, _, offsets = await self._pinned_prefix(get, PEER_CLIENT_PREFIX + request.node)
        except KvdError as error:
            await context.abort(convert.status_of(error), error.message)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        return state.spec, ReadPin(self.engine, lease), offsets

    async def read_blocks_for_peer(self, request, context):
        """ReadBlocks: the pinned blocks streamed with their per-layer CRC-32Cs; the pins end with the stream."""
        spec, pin, offsets = await self._pin_for_peer(request, context)
        try:
            chunk = min(CHUNK_BYTES, self.max_message_bytes // 2)
            per_message = max(1, chunk // spec.block_bytes)
            for start in range(0, len(offsets), per_message):
                blocks, crcs = await asyncio.to_thread(copied_blocks, self.arena, offsets[start:start + per_message],
                                                       spec)
                yield wire.read_blocks_response(request.first + start, blocks, crcs.ravel().tolist())
        finally:
            pin.release()

    async def pin_blocks_for_peer(self, request, context):
        """PinBlocks: pin blocks for a peer's one-sided READ until it releases them or lease_ms passes.
        Their CRC-32Cs are computed under the pins, on a worker thread while the peer READs, and
        handed over by `release_pins_of_peer`."""
        arena = self.arena
        spec, pin, offsets = await self._pin_for_peer(request, context)
        lease = pin.lease
        if lease is None or not offsets:
            pin.release()
            return wire.pin_blocks_response(spec.block_bytes)
        # The peer READs through the namespace's tenant's own view of the arena (see nixl_transport).
        view = arena.tenant_view(spec.tenant)
        try:
            grant = await self.cluster.transport.grant(view, arena.layout.arena_bytes)
        except BaseException:
            pin.release()
            raise
        loop = asyncio.get_running_loop()
        checksums = loop.run_in_executor(None, layer_checksums, arena, offsets, spec)
        self._peer_pins[lease.lease_id] = PeerPins(request.node, pin, checksums)
        self.cluster.transport.serving(+1)
        loop.call_later(max(lease.deadline_ms - self.clock.now_ms(), 0) / 1000 + 0.1,
                        self._expire_peer_pins, lease.lease_id)
        return wire.pin_blocks_response(spec.block_bytes, lease_id=lease.lease_id, offsets=offsets, arena_address=view,
                                        grant=grant)

    async def release_pins_of_peer(self, node: str, lease_id: int) -> list[int] | None:
        """ReleasePins: end a peer's pins; their CRC-32Cs, or None when they are not (or no longer)
        held: what the peer read is then not to be trusted."""
        pinned = self._peer_pins.get(lease_id)
        if pinned is None or pinned.node != node:
            return None
        del self._peer_pins[lease_id]
        try:
            checksums = await pinned.checksums
            held = not pinned.pin.lease.ended
        finally:
            self._close_peer_pins(pinned)
        return checksums.ravel().tolist() if held else None

    def _expire_peer_pins(self, lease_id: int) -> None:
        pinned = self._peer_pins.pop(lease_id, None)
        if pinned is not None:
            # The blocks stay pinned until the checksum thread is done reading them.
            pinned.checksums.add_done_callback(lambda _: self._close_peer_pins(pinned))

    def _close_peer_pins(self, pinned: PeerPins) -> None:
        pinned.pin.release()
        self.cluster.transport.serving(-1)


def layer_checksums(arena, offsets, spec) -> np.ndarray:
    """(blocks, layers) CRC-32Cs of the blocks at `offsets` in the arena, in one native call."""
    addresses = np.asarray(offsets, dtype=np.uint64) + np.uint64(arena.address_at(0))
    return crc32c_chunks(addresses, spec.layer_bytes, spec.num_layers)


def copied_blocks(arena, offsets, spec) -> tuple[list[bytes], np.ndarray]:
    """Copies of the blocks at `offsets`, and their per-layer CRC-32Cs computed from the copies
    (while they are still in cache: one pass over the arena, not two)."""
    blocks = [arena.read_at(offset, spec.block_bytes) for offset in offsets]
    return blocks, crc32c_of_buffers(blocks, spec.layer_bytes, spec.num_layers)
