"""A fetching node's calls to the node that holds a chain, in plain values.

kvd.planes.cluster_fetch decides what to fetch, reserves, checks and
seals; what it asks of the cluster is here, and only here do the peers'
stubs, the cluster credential, the calls' deadlines and gRPC's errors
appear (the messages themselves are built and read in kvd.cluster.wire):

- `holder`: the directory's longest holder of a chain past this node's own
  prefix (the routing ClusterLookup uses);
- `read_blocks`: the holder's ReadBlocks stream, as (position of the first
  block, blocks, their per-layer CRC-32Cs); a call that fails, or whose
  channel closes under it, ends it with PeerCallFailed;
- `pin`, `read`, `release`: PinBlocks, a one-sided NIXL READ of the pinned
  blocks, and ReleasePins, which hands over their CRC-32Cs.

It reads the node's peers, transport and member record when called: the
NIXL agent and the member record exist only once the node has joined.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import grpc

from kvd.cluster import wire
from kvd.cluster.wire import PeerPin  # what `pin` answers
from kvd.errors import PeerCallFailed

if TYPE_CHECKING:
    from kvd.cluster.node import ClusterNode

log = logging.getLogger("kvd.cluster")


class PeerBlocks:
    def __init__(self, node: ClusterNode) -> None:
        self.node = node

    async def holder(self, namespace_id: bytes, keys: Sequence[bytes], local: int) -> tuple[str, int] | None:
        """(node, blocks it holds) of the peer the directory says holds the most of `keys` (a chain
        from its root), when that is more than this node's `local`; None before the node knows
        its members, or when no peer has more."""
        if self.node.router.owners is None:
            return None
        started = time.perf_counter()
        answer = await self.node.lookup(namespace_id, b"".join(keys), local)
        best = next((match for match in answer.nodes if not match.local and match.matched > local), None)
        if best is None:
            return None
        log.debug("remote fetch: directory answered", extra={"peer": best.node, "matched": best.matched,
                                                             "lookup_ms": _elapsed_ms(started)})
        return best.node, best.matched

    def reachable(self, peer: str) -> bool:
        """Whether this node has a channel to `peer` (it is a live member)."""
        return self.node.peers.stub(peer) is not None

    def over_nixl(self, peer: str) -> bool:
        """Whether `peer`'s arena can be READ with NIXL (both nodes have an agent, connected)."""
        transport = self.node.transport
        return transport is not None and transport.has_peer(peer)

    async def read_blocks(self, peer: str, namespace_id: bytes, keys: Sequence[bytes], first: int, lease_ms: int,
                          timeout_s: float) -> AsyncIterator[tuple[int, list[bytes], list[int]]]:
        """ReadBlocks of keys[first:] (`keys`: the chain from its root), held by the holder under
        `lease_ms` while it streams: each message as (position of its first block, its blocks,
        their per-layer CRC-32Cs block by block). PeerCallFailed when the call fails."""
        stub = self.node.peers.stub(peer)
        if stub is None:
            raise PeerCallFailed(f"no channel to {peer!r}: it is not a member")
        request = wire.read_blocks_request(self.node.name, self.node.member.incarnation, namespace_id, keys, first,
                                           lease_ms)
        try:
            async for message in stub.ReadBlocks(request, timeout=timeout_s, metadata=self.node.peers.metadata):
                yield wire.read_blocks_part(message)
        except grpc.RpcError as error:
            raise PeerCallFailed(describe(error)) from None
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():
                raise  # the fetch itself was cancelled, or ran out of time
            # The call was cancelled under us (its channel closed when the peer left).
            raise PeerCallFailed("CancelledError: the call's channel closed") from None

    async def pin(self, peer: str, namespace_id: bytes, keys: Sequence[bytes], first: int, lease_ms: int,
                  timeout_s: float) -> PeerPin | None:
        """PinBlocks of keys[first:] (`keys`: the chain from its root), for a READ; None when the
        peer cannot be reached or refuses (no NIXL agent, this node not yet a member there): the
        blocks are then streamed instead."""
        stub = self.node.peers.stub(peer)
        if stub is None:
            return None
        request = wire.pin_blocks_request(self.node.name, self.node.member.incarnation, namespace_id, keys, first,
                                          lease_ms)
        started = time.perf_counter()
        try:
            pin = await stub.PinBlocks(request, timeout=timeout_s, metadata=self.node.peers.metadata)
        except grpc.RpcError as error:
            log.info("NIXL pin refused; streaming instead", extra={"peer": peer, "reason": describe(error)})
            return None
        log.debug("NIXL pin", extra={"peer": peer, "blocks": len(pin.offsets),
                                     "pin_ms": _elapsed_ms(started)})
        return wire.peer_pin(pin)

    async def read(self, peer: str, pin: PeerPin, local: list[int], remote: list[int], length: int,
                   timeout_s: float) -> tuple[bool, asyncio.Future | None]:
        """One-sided READ of `length` bytes from each of `peer`'s `remote` addresses (inside what
        `pin` granted) into the `local` ones: (False when it failed or ran past `timeout_s`, and a
        future when it could not be cancelled: it may write into `local` until that future is done)."""
        return await self.node.transport.read(peer, local, remote, length, timeout_s, pin.grant)

    async def release(self, peer: str, lease_id: int) -> list[int] | None:
        """ReleasePins: the pinned blocks' per-layer CRC-32Cs, block by block; None when nothing was
        pinned, or the holder no longer held the pins (their lease ran out) or could not be told
        (its lease then ends them on its own)."""
        if not lease_id:
            return None
        stub = self.node.peers.stub(peer)
        if stub is None:
            log.info("NIXL pins not released", extra={"peer": peer, "reason": "it is not a member"})
            return None
        release = wire.release_pins_request(self.node.name, self.node.member.incarnation, lease_id)
        try:
            response = await stub.ReleasePins(release, timeout=self.node.peers.timeout_s,
                                              metadata=self.node.peers.metadata)
        except grpc.RpcError as error:
            log.info("NIXL pins not released", extra={"peer": peer, "reason": describe(error)})
            return None
        return wire.released_checksums(response)


def _elapsed_ms(started: float) -> float:
    return round((time.perf_counter() - started) * 1000, 2)


def describe(error: grpc.RpcError) -> str:
    return f"{error.code()}: {error.details()}"
