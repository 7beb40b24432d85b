"""Blocks between nodes over gRPC: a holder serves a peer its pinned blocks, a Get fetches a peer's prefix.

Holder (`serve`, the Cluster service's ReadBlocks). The blocks asked for
are pinned under a lease of the peer's own client id for as long as the
stream runs (a disk-only block is read into host memory first, as for any
Get), copied out in messages of about CHUNK_BYTES, each block with the
CRC-32C of each of its layers, computed from the pinned copy, and the lease is closed when the
stream ends, however it ends: nothing stays pinned for a peer.

Fetcher (`fetch_for_get`). A Get of a chain from its root that misses
locally asks the directory (ClusterLookup) which node holds more of it,
reserves host slots for the missing blocks, and streams them from the
longest holder under `cluster.fetch_timeout_s`. Each block is checked
(size and every layer's CRC-32C, one native call per message) before it is
written to its slot; the verified prefix is
sealed (these are ordinary local blocks from then on, published to the
directory like any other) and the rest of the reservation is aborted. A
peer that dies, is cut off or sends a wrong byte turns the rest of the
fetch into misses, never into wrong data. The Get then goes on as usual.

Over NIXL (`pin`, `release`, `_fetch_nixl`) the holder pins the blocks
under a lease and answers their arena offsets at once; it computes their
per-layer CRC-32Cs on a worker thread while the fetcher READs them into reserved
slots, and hands them over when the fetcher releases the pins. Pins still
held at that release were held for the whole READ; a release that finds
them gone (their lease ran out first) gives no checksums, and the read
blocks become misses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc
import numpy as np

from kvd.cluster.keys import split
from kvd.core.engine import KeysRequest, ReserveStatus
from kvd.errors import KvdError
from kvd.io.checksum import crc32c_chunks, crc32c_of_buffers
from kvd.server import convert
from kvd.v1 import kvd_pb2

log = logging.getLogger("kvd.cluster")

CHUNK_BYTES = 8 << 20
FETCH_CLIENT = "kvd-cluster-fetch"
PEER_CLIENT_PREFIX = "kvd-cluster-peer:"


@dataclass(slots=True)
class _Pin:
    node: str
    lease: object
    # layer_checksums of the pinned blocks, running on a worker thread.
    checksums: asyncio.Future


class ClusterBlocks:
    def __init__(self, service, node, fetch_timeout_s: float) -> None:
        self.service = service
        self.node = node
        self.fetch_timeout_s = fetch_timeout_s
        # Blocks sealed here from peers, by transport; fetches cut short.
        self.fetched_blocks = {"nixl": 0, "grpc": 0}
        self.failed_fetches = 0
        # Pins held for peers' NIXL reads, by lease id.
        self._pins: dict[int, _Pin] = {}

    # -- holder ---------------------------------------------------------------

    async def _pin_for_peer(self, request, context):
        """Pin what the holder has of the chain from `request.first` on, under the peer's own
        client id: (the namespace's spec, lease or None, arena offsets of the pinned blocks)."""
        engine = self.service.engine
        try:
            state = engine.namespace(request.namespace_id)
            keys = split(request.packed_keys)
            if len(request.packed_keys) % 32 or not keys or request.first >= len(keys):
                raise ValueError("packed_keys must be whole 32-byte keys, and first inside them")
            get = kvd_pb2.GetRequest(namespace_id=request.namespace_id, keys=keys[request.first:],
                                     parent_key=keys[request.first - 1] if request.first else b"",
                                     lease_ms=request.lease_ms)
            lease, matched, _, _ = await self.service._pinned_prefix(get, PEER_CLIENT_PREFIX + request.node)
        except KvdError as error:
            await context.abort(convert.status_of(error), error.message)
        except ValueError as error:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        offsets = engine.host.pool.offsets_of([engine.host_slot(block) for block in matched])
        return state.spec, lease, offsets

    async def serve(self, request, context):
        spec, lease, offsets = await self._pin_for_peer(request, context)
        arena = self.service.arena
        try:
            chunk = min(CHUNK_BYTES, self.service.max_message_bytes // 2)
            per_message = max(1, chunk // spec.block_bytes)
            for start in range(0, len(offsets), per_message):
                blocks, crcs = await asyncio.to_thread(copied_blocks, arena, offsets[start:start + per_message], spec)
                yield kvd_pb2.ReadBlocksResponse(first=request.first + start, blocks=blocks, crc32c=crcs.ravel().tolist())
        finally:
            if lease is not None and not lease.ended:
                self.service.engine.leases.close(lease)

    async def pin(self, request, context) -> kvd_pb2.PinBlocksResponse:
        """Pin blocks for a peer's one-sided READ until it releases them or lease_ms passes.
        Their CRC-32Cs are computed under the pins, on a worker thread while the peer READs,
        and handed over by `release`."""
        engine, arena = self.service.engine, self.service.arena
        spec, lease, offsets = await self._pin_for_peer(request, context)
        if lease is None or not offsets:
            if lease is not None:
                engine.leases.close(lease)
            return kvd_pb2.PinBlocksResponse(block_bytes=spec.block_bytes, arena_address=arena.address_at(0))
        loop = asyncio.get_running_loop()
        checksums = loop.run_in_executor(None, layer_checksums, arena, offsets, spec)
        self._pins[lease.lease_id] = _Pin(request.node, lease, checksums)
        self.node.transport.serving(+1)
        loop.call_later(max(lease.deadline_ms - self.service.clock.now_ms(), 0) / 1000 + 0.1,
                        self._expire, lease.lease_id)
        return kvd_pb2.PinBlocksResponse(lease_id=lease.lease_id, offsets=offsets, block_bytes=spec.block_bytes,
                                         arena_address=arena.address_at(0))

    async def release(self, node: str, lease_id: int) -> list[int] | None:
        """End a peer's pins; their CRC-32Cs, or None when they are not (or no longer) held:
        what the peer read is then not to be trusted."""
        pinned = self._pins.get(lease_id)
        if pinned is None or pinned.node != node:
            return None
        del self._pins[lease_id]
        try:
            checksums = await pinned.checksums
            held = not pinned.lease.ended
        finally:
            self._close(pinned)
        return checksums.ravel().tolist() if held else None

    def _expire(self, lease_id: int) -> None:
        pinned = self._pins.pop(lease_id, None)
        if pinned is not None:
            # The blocks stay pinned until the checksum thread is done reading them.
            pinned.checksums.add_done_callback(lambda _: self._close(pinned))

    def _close(self, pinned: _Pin) -> None:
        if not pinned.lease.ended:
            self.service.engine.leases.close(pinned.lease)
        self.node.transport.serving(-1)

    # -- fetcher --------------------------------------------------------------

    async def fetch_for_get(self, namespace_id: bytes, keys: list[bytes]) -> int:
        """Bring the part of `keys` (a chain from its root) that a peer holds and this node lacks."""
        engine = self.service.engine
        local = len(engine.lookup(namespace_id, keys))
        if local >= len(keys) or self.node.router.owners is None:
            return 0
        started = time.perf_counter()
        answer = await self.node.lookup(namespace_id, b"".join(keys), local)
        best = next((n for n in answer.nodes if not n.local and n.matched > local), None)
        if best is None:
            return 0
        log.debug("remote fetch: directory answered", extra={"peer": best.node, "matched": best.matched,
                                                             "lookup_ms": _ms(started, time.perf_counter())})
        transport = self.node.transport
        if transport is not None and transport.has_peer(best.node):
            fetched = await self._fetch_nixl(best.node, namespace_id, keys, local, best.matched)
            if fetched is not None:
                return fetched
        return await self._fetch(best.node, namespace_id, keys, local, best.matched)

    async def _fetch(self, peer: str, namespace_id: bytes, keys: list[bytes], first: int, end: int) -> int:
        stub = self.node.peers.stub(peer)
        if stub is None:
            return 0
        result = self._reserve(peer, namespace_id, keys, first, end)
        if result is None:
            return 0
        verified = await self._receive(stub, peer, namespace_id, keys, first, result)
        return self._seal(namespace_id, keys, first, result, verified, "grpc")

    def _reserve(self, peer: str, namespace_id: bytes, keys: list[bytes], first: int, end: int):
        """Host slots for keys[first:end] under a fetch lease; None when nothing could be reserved."""
        lease_ms = int(self.fetch_timeout_s * 1000) + 1000
        reserve = KeysRequest(namespace_id, FETCH_CLIENT, keys[first:end], lease_ms, self.service.clock.now_ms(),
                              parent_key=keys[first - 1] if first else b"")
        try:
            result = self.service.engine.reserve(reserve)
        except KvdError as error:
            log.info("remote fetch skipped: no room", extra={"peer": peer, "reason": error.message})
            return None
        return result if result.lease is not None else None

    def _seal(self, namespace_id: bytes, keys: list[bytes], first: int, result, verified: int,
              transport: str) -> int:
        """Seal the first `verified` reserved blocks and give the rest back: a cut-short fetch leaves
        misses, not holes."""
        sealed = self.service.engine.seal_prefix(result.lease, verified, self.service.clock.now_ms())
        self.fetched_blocks[transport] += sealed
        return sealed

    async def _fetch_nixl(self, peer: str, namespace_id: bytes, keys: list[bytes], first: int, end: int) -> int | None:
        """Pin on the holder, READ into reserved slots, release (which hands over the checksums),
        verify, seal; None: use the gRPC stream instead."""
        stub = self.node.peers.stub(peer)
        if stub is None:
            return None
        lease_ms = int(self.fetch_timeout_s * 1000) + 1000
        request = kvd_pb2.PinBlocksRequest(node=self.node.name, incarnation=self.node.member.incarnation,
                                           namespace_id=namespace_id, packed_keys=b"".join(keys[:end]), first=first,
                                           lease_ms=lease_ms)
        started = time.perf_counter()
        try:
            pin = await stub.PinBlocks(request, timeout=self.fetch_timeout_s, metadata=self.node.peers.metadata)
        except grpc.RpcError as error:
            log.info("NIXL pin refused; streaming instead", extra={"peer": peer, "reason": _describe(error)})
            return None
        log.debug("NIXL pin", extra={"peer": peer, "blocks": len(pin.offsets), "pin_ms": _ms(started, time.perf_counter())})
        released = False
        try:
            sealed, read = await self._read_pinned(stub, peer, namespace_id, keys, first, pin)
            released = True
            # A READ that failed (not a bad checksum) is tried again over the gRPC stream.
            return sealed if read else None
        finally:
            if not released:
                await self._release(stub, peer, pin.lease_id)

    async def _release(self, stub, peer: str, lease_id: int) -> list[int] | None:
        """Release the holder's pins: their CRC-32Cs, or None if the holder no longer held them."""
        if not lease_id:
            return None
        release = kvd_pb2.ReleasePinsRequest(node=self.node.name, incarnation=self.node.member.incarnation,
                                             lease_id=lease_id)
        try:
            response = await stub.ReleasePins(release, timeout=self.node.peers.timeout_s,
                                              metadata=self.node.peers.metadata)
        except grpc.RpcError as error:
            log.info("NIXL pins not released", extra={"peer": peer, "reason": _describe(error)})
            return None  # its lease ends the pins on its own
        return list(response.crc32c)

    async def _read_pinned(self, stub, peer: str, namespace_id: bytes, keys: list[bytes], first: int,
                           pin) -> tuple[int, bool]:
        """(blocks sealed, whether the READ itself completed); releases the pins either way."""
        engine, service = self.service.engine, self.service
        spec = engine.namespace(namespace_id).spec
        block_bytes = spec.block_bytes
        result = None
        if pin.offsets and pin.block_bytes == block_bytes:
            result = self._reserve(peer, namespace_id, keys, first, first + len(pin.offsets))
        if result is None:
            await self._release(stub, peer, pin.lease_id)
            return 0, True
        positions = [i for i, status in enumerate(result.statuses) if status == ReserveStatus.RESERVED]
        local = np.array([service.arena.address_at(engine.host.pool.offset_of(result.slots[i])) for i in positions],
                         dtype=np.uint64)
        remote = [pin.arena_address + pin.offsets[i] for i in positions]
        started = time.perf_counter()
        read = await self.node.transport.read(peer, local.tolist(), remote, block_bytes, self.fetch_timeout_s)
        read_at = time.perf_counter()
        # Released only now: pins that were still held at the release were held for the whole READ.
        expected = await self._release(stub, peer, pin.lease_id)
        verified = 0
        if not read:
            self.failed_fetches += 1
        elif expected is None or len(expected) != len(pin.offsets) * spec.num_layers:
            log.warning("NIXL read not verified: the holder's pins were gone", extra={"peer": peer})
        else:
            expected = np.array(expected, dtype=np.uint32).reshape(len(pin.offsets), spec.num_layers)[positions]
            verified = await self._verified_prefix(peer, first, local, spec, expected)
        verified_at = time.perf_counter()
        sealed = self._seal(namespace_id, keys, first, result, verified, "nixl")
        log.debug("NIXL fetch", extra={"peer": peer, "blocks": len(positions), "read_ms": _ms(started, read_at),
                                       "verify_ms": _ms(read_at, verified_at),
                                       "seal_ms": _ms(verified_at, time.perf_counter())})
        return sealed, read

    async def _verified_prefix(self, peer: str, first: int, addresses: np.ndarray, spec,
                               expected: np.ndarray) -> int:
        """How many of the blocks at `addresses`, in order, match their expected per-layer CRC-32Cs."""
        crcs = await asyncio.to_thread(crc32c_chunks, addresses, spec.layer_bytes, spec.num_layers)
        mismatch = np.flatnonzero((crcs != expected).any(axis=1))
        if len(mismatch):
            log.warning("NIXL read failed its CRC-32C check", extra={"peer": peer, "block": first + int(mismatch[0])})
            return int(mismatch[0])
        return len(expected)

    async def _receive(self, stub, peer: str, namespace_id: bytes, keys: list[bytes], first: int, result) -> int:
        """Stream the blocks into their reserved slots; returns how many reserved ones are verified, in order."""
        engine, arena = self.service.engine, self.service.arena
        spec = engine.namespace(namespace_id).spec
        end = first + len(result.statuses)
        request = kvd_pb2.ReadBlocksRequest(node=self.node.name, incarnation=self.node.member.incarnation,
                                            namespace_id=namespace_id, packed_keys=b"".join(keys[:end]), first=first,
                                            lease_ms=int(self.fetch_timeout_s * 1000))
        position, verified = first, 0
        try:
            async with asyncio.timeout(self.fetch_timeout_s):
                call = stub.ReadBlocks(request, timeout=self.fetch_timeout_s, metadata=self.node.peers.metadata)
                async for message in call:
                    good = await self._checked(message, position, end, spec)
                    for index, block in enumerate(message.blocks[:good], position - first):
                        if result.statuses[index] == ReserveStatus.RESERVED:
                            arena.write_at(engine.host.pool.offset_of(result.slots[index]), block)
                            verified += 1
                    position += good
                    if good < len(message.blocks):
                        raise ValueError(f"block {position} failed its size or per-layer CRC-32C check")
        except asyncio.CancelledError as error:
            if asyncio.current_task().cancelling():
                raise  # the Get itself was cancelled
            # The call was cancelled under us (its channel closed): the fetch failed, the Get goes on.
            self._cut_short(peer, position - first, error)
        except (grpc.RpcError, TimeoutError, ValueError) as error:
            self._cut_short(peer, position - first, error)
        return verified

    @staticmethod
    async def _checked(message, position: int, end: int, spec) -> int:
        """How many of a ReadBlocks message's blocks, in order, pass their per-layer CRC-32Cs;
        ValueError for a message out of place or of the wrong shape."""
        if message.first != position:
            raise ValueError(f"a ReadBlocks message for position {message.first}, expected {position}")
        count = len(message.blocks)
        if position + count > end:
            raise ValueError("more blocks than asked for")
        if len(message.crc32c) != count * spec.num_layers:
            raise ValueError(f"{len(message.crc32c)} checksums for {count} blocks of {spec.num_layers} layers")
        sized = next((i for i, block in enumerate(message.blocks) if len(block) != spec.block_bytes), count)
        if not sized:
            raise ValueError(f"block {position} is not {spec.block_bytes} bytes")
        crcs = await asyncio.to_thread(crc32c_of_buffers, message.blocks[:sized], spec.layer_bytes, spec.num_layers)
        expected = np.array(message.crc32c, dtype=np.uint32).reshape(count, spec.num_layers)[:sized]
        mismatch = np.flatnonzero((crcs != expected).any(axis=1))
        return int(mismatch[0]) if len(mismatch) else sized

    def _cut_short(self, peer: str, fetched: int, error: BaseException) -> None:
        self.failed_fetches += 1
        log.warning("remote fetch cut short", extra={"peer": peer, "fetched": fetched, "reason": _describe(error)})


def layer_checksums(arena, offsets, spec) -> np.ndarray:
    """(blocks, layers) CRC-32Cs of the blocks at `offsets` in the arena, in one native call."""
    addresses = np.asarray(offsets, dtype=np.uint64) + np.uint64(arena.address_at(0))
    return crc32c_chunks(addresses, spec.layer_bytes, spec.num_layers)


def copied_blocks(arena, offsets, spec) -> tuple[list[bytes], np.ndarray]:
    """Copies of the blocks at `offsets`, and their per-layer CRC-32Cs computed from the copies
    (while they are still in cache: one pass over the arena, not two)."""
    blocks = [arena.read_at(offset, spec.block_bytes) for offset in offsets]
    return blocks, crc32c_of_buffers(blocks, spec.layer_bytes, spec.num_layers)


def _ms(start: float, end: float) -> float:
    return round((end - start) * 1000, 2)


def _describe(error: BaseException) -> str:
    if isinstance(error, grpc.RpcError):
        return f"{error.code()}: {error.details()}"
    return f"{type(error).__name__}: {error}"
