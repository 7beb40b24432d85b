"""The peers' protocol (kvd.v1.Cluster) on the wire: the only module of kvd.cluster that imports kvd.v1.

Every Cluster message a node sends is built here from plain values, and every answer it
receives is read back into plain values here; so are the generated servicer base, stub
and registration. Both ends of each call are here: the directory's DirectoryUpdate and
DirectoryQuery (kvd.cluster.rpc serves them, kvd.cluster.node and kvd.cluster.router
call them), and the block calls ReadBlocks, PinBlocks and ReleasePins (kvd.cluster.peer_blocks
calls them, the holder's side in kvd.server.handlers.cluster answers them). The daemon's own
service, kvd.v1.Kvd, converts in kvd.server.convert.

A directory answer lists each node once per DirectoryQueryResponse (`nodes`); each segment's
holders are, key by key, a count (`holder_counts`, a byte) and that many little-endian u16
indices into `nodes` (`holders`).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from kvd.cluster.keys import split
from kvd.core.keys import KEY_BYTES
from kvd.v1 import kvd_pb2, kvd_pb2_grpc

# The generated service: the base the directory's servicer extends, and a peer's stub.
ClusterServicer = kvd_pb2_grpc.ClusterServicer
ClusterStub = kvd_pb2_grpc.ClusterStub


def add_cluster_service(servicer: ClusterServicer, server) -> None:
    """Serve kvd.v1.Cluster on `server` (a grpc.aio.Server)."""
    kvd_pb2_grpc.add_ClusterServicer_to_server(servicer, server)


def cluster_stub(channel) -> ClusterStub:
    return kvd_pb2_grpc.ClusterStub(channel)


def packed_keys(name: str, data: bytes, limit: int) -> list[bytes]:
    """The keys of a packed field (`name`, for the error): ValueError unless whole keys, at most `limit`."""
    if len(data) % KEY_BYTES:
        raise ValueError(f"{name}: {len(data)} bytes is not a whole number of {KEY_BYTES}-byte keys")
    if len(data) // KEY_BYTES > limit:
        raise ValueError(f"{name}: {len(data) // KEY_BYTES} keys, at most {limit}")
    return split(data)


# -- the directory ---------------------------------------------------------------------------------

def directory_update_request(node: str, incarnation: int, stored: Sequence[bytes],
                             removed: Sequence[bytes]) -> kvd_pb2.DirectoryUpdateRequest:
    return kvd_pb2.DirectoryUpdateRequest(node=node, incarnation=incarnation, stored_keys=b"".join(stored),
                                          removed_keys=b"".join(removed))


def directory_update_response(applied: int) -> kvd_pb2.DirectoryUpdateResponse:
    return kvd_pb2.DirectoryUpdateResponse(applied=applied)


def directory_query_request(segments: Sequence[bytes]) -> kvd_pb2.DirectoryQueryRequest:
    """A DirectoryQuery of `segments`, each a segment's keys packed."""
    return kvd_pb2.DirectoryQueryRequest(segments=segments)


def directory_query_response(answers: Sequence[Sequence[Sequence[str]]]) -> kvd_pb2.DirectoryQueryResponse:
    """A shard's answers, segment by segment, each the holders of each key of it."""
    names: dict[str, int] = {}
    order: list[str] = []
    segments = [_encode_answer(answer, names, order) for answer in answers]
    return kvd_pb2.DirectoryQueryResponse(nodes=order, segments=segments)


def _encode_answer(answer: Sequence[Sequence[str]], names: dict[str, int], order: list[str]) -> kvd_pb2.SegmentHolders:
    counts, holders = bytearray(), bytearray()
    for key_holders in answer:
        counts.append(len(key_holders))
        for node in key_holders:
            index = names.get(node)
            if index is None:
                index = names[node] = len(order)
                order.append(node)
            holders += struct.pack("<H", index)
    return kvd_pb2.SegmentHolders(holder_counts=bytes(counts), holders=bytes(holders))


def _decode_answer(segment: kvd_pb2.SegmentHolders, nodes: Sequence[str]) -> list[tuple[str, ...]]:
    """One segment's holders, key by key; ValueError (or IndexError) when the answer is malformed."""
    indices = struct.unpack(f"<{len(segment.holders) // 2}H", segment.holders)
    if sum(segment.holder_counts) != len(indices) or any(i >= len(nodes) for i in indices):
        raise ValueError("a directory answer whose holder counts and indices disagree")
    answer, at = [], 0
    for count in segment.holder_counts:
        answer.append(tuple(nodes[i] for i in indices[at:at + count]))
        at += count
    return answer


def query_answers(response: kvd_pb2.DirectoryQueryResponse, segments: int) -> list[list[tuple[str, ...]]] | None:
    """A DirectoryQuery's answer for its `segments` segments, key by key; None when it is malformed."""
    if len(response.segments) != segments:
        return None
    try:
        return [_decode_answer(segment, response.nodes) for segment in response.segments]
    except (ValueError, IndexError):
        return None


# -- the blocks: ReadBlocks, PinBlocks, ReleasePins ----------------------------------------------

@dataclass(frozen=True, slots=True)
class PeerPin:
    """Blocks a holder pinned for a one-sided READ, until they are released or `lease_id` runs out
    (0: nothing pinned)."""

    lease_id: int
    # Where each block is in the holder's arena, from `arena_address`.
    offsets: list[int]
    block_bytes: int
    arena_address: int
    # The NIXL metadata of the one region the holder lets this node READ for these blocks.
    grant: bytes


def read_blocks_request(node: str, incarnation: int, namespace_id: bytes, keys: Sequence[bytes], first: int,
                        lease_ms: int) -> kvd_pb2.ReadBlocksRequest:
    """ReadBlocks of keys[first:] (`keys`: the chain from its root), asked by member `node`."""
    return kvd_pb2.ReadBlocksRequest(node=node, incarnation=incarnation, namespace_id=namespace_id,
                                     packed_keys=b"".join(keys), first=first, lease_ms=lease_ms)


def read_blocks_response(first: int, blocks: Sequence[bytes], crcs: Sequence[int]) -> kvd_pb2.ReadBlocksResponse:
    """One message of a ReadBlocks stream: blocks from position `first`, their per-layer CRC-32Cs."""
    return kvd_pb2.ReadBlocksResponse(first=first, blocks=blocks, crc32c=crcs)


def read_blocks_part(message: kvd_pb2.ReadBlocksResponse) -> tuple[int, list[bytes], list[int]]:
    """(position of the first block, the blocks, their per-layer CRC-32Cs block by block)."""
    return message.first, list(message.blocks), list(message.crc32c)


def pin_blocks_request(node: str, incarnation: int, namespace_id: bytes, keys: Sequence[bytes], first: int,
                       lease_ms: int) -> kvd_pb2.PinBlocksRequest:
    """PinBlocks of keys[first:] (`keys`: the chain from its root), asked by member `node`."""
    return kvd_pb2.PinBlocksRequest(node=node, incarnation=incarnation, namespace_id=namespace_id,
                                    packed_keys=b"".join(keys), first=first, lease_ms=lease_ms)


def pin_blocks_response(block_bytes: int, lease_id: int = 0, offsets: Sequence[int] = (), arena_address: int = 0,
                        grant: bytes = b"") -> kvd_pb2.PinBlocksResponse:
    """PinBlocks answered: nothing pinned (lease_id 0), or the pins and the grant to READ them."""
    return kvd_pb2.PinBlocksResponse(lease_id=lease_id, offsets=offsets, block_bytes=block_bytes,
                                     arena_address=arena_address, grant=grant)


def peer_pin(response: kvd_pb2.PinBlocksResponse) -> PeerPin:
    return PeerPin(response.lease_id, list(response.offsets), response.block_bytes, response.arena_address,
                   response.grant)


def release_pins_request(node: str, incarnation: int, lease_id: int) -> kvd_pb2.ReleasePinsRequest:
    return kvd_pb2.ReleasePinsRequest(node=node, incarnation=incarnation, lease_id=lease_id)


def release_pins_response(crcs: Sequence[int]) -> kvd_pb2.ReleasePinsResponse:
    """ReleasePins answered: the released blocks' per-layer CRC-32Cs, block by block."""
    return kvd_pb2.ReleasePinsResponse(crc32c=crcs)


def released_checksums(response: kvd_pb2.ReleasePinsResponse) -> list[int]:
    return list(response.crc32c)


def price_blocks_request(namespace_id: bytes, packed: bytes) -> kvd_pb2.PriceBlocksRequest:
    return kvd_pb2.PriceBlocksRequest(namespace_id=namespace_id, packed_keys=packed)


def price_blocks_response(matched: int, load_s: float) -> kvd_pb2.PriceBlocksResponse:
    return kvd_pb2.PriceBlocksResponse(matched=matched, load_s=load_s)


def price(response: kvd_pb2.PriceBlocksResponse) -> tuple[int, float]:
    """(leading keys the node holds, seconds until they could be in its host memory)."""
    return response.matched, response.load_s
