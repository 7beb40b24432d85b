"""The reading operations: Lookup and ClusterLookup (what is stored, and where), Prefetch,
and the Gets: through the arena under a lease (unary, or streamed over GetBlocks), left
pinned in the arena (PinnedBlocks), or inline over gRPC without the arena.
See kvd.client._ops for how an operation runs."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from kvd.client import _wire
from kvd.client._ops import NEXT, STREAMING, Op, Session, arena_changed, connect, release, remap, remapping
from kvd.client._wire import ClusterLookupResult, GetResult, LookupResult, Namespace, NodeMatch, PrefetchResult
from kvd.core.keys import KEY_BYTES
from kvd.errors import NOT_IN_A_CLUSTER, FailedPrecondition
from kvd.v1 import kvd_pb2


def lookup(session: Session, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes,
           include_remote: bool | None = False, load_times: bool = False) -> Op:
    """include_remote None: where the daemon is in a cluster. The first such Lookup asks for the
    peers' blocks; a daemon outside a cluster refuses by name, and this client stops asking."""
    remote = session.in_cluster is not False if include_remote is None else include_remote
    request = kvd_pb2.LookupRequest(namespace_id=namespace.namespace_id, parent_key=parent_key,
                                    include_remote=remote, load_times=load_times)
    packed = b"".join(keys)
    if len(packed) == KEY_BYTES * len(keys):
        request.packed_keys = packed
    else:  # a key of the wrong size: the daemon names it (keys[i] is N bytes)
        request.keys.extend(keys)
    try:
        response = yield ("Lookup", request)
    except grpc.RpcError as error:
        if include_remote is not None or not remote or not _not_in_a_cluster(error):
            raise
        session.in_cluster = False
        request.include_remote = False
        response = yield ("Lookup", request)
    else:
        if remote:
            session.in_cluster = True
    return LookupResult(response.matched, list(response.tiers), list(response.load_s) if load_times else None)


def _not_in_a_cluster(error: grpc.RpcError) -> bool:
    return error.code() == grpc.StatusCode.FAILED_PRECONDITION and NOT_IN_A_CLUSTER in (error.details() or "")


def cluster_lookup(session: Session, namespace: Namespace, keys: Sequence[bytes], load_times: bool = False) -> Op:
    request = kvd_pb2.ClusterLookupRequest(namespace_id=namespace.namespace_id, packed_keys=b"".join(keys),
                                           load_times=load_times)
    response = yield ("ClusterLookup", request)
    nodes = [NodeMatch(n.node, n.address, n.matched, n.local, n.load_s if load_times else math.nan)
             for n in response.nodes]
    return ClusterLookupResult(nodes, response.segments, response.segments_unanswered)


def prefetch(session: Session, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes, wait: bool) -> Op:
    response = yield (
        "Prefetch",
        kvd_pb2.PrefetchRequest(namespace_id=namespace.namespace_id, keys=keys, parent_key=parent_key, wait=wait),
    )
    return PrefetchResult(response.matched, response.in_host, response.loading, response.queued, response.refused,
                          response.missing, response.limit, response.loaded)


def get_numpy(
    session: Session, namespace: Namespace, keys: Sequence[bytes], out: np.ndarray | None, parent_key: bytes
) -> Op:
    """The stored prefix of `keys` as (matched, *block_shape); into `out` if given."""
    return (yield from get(session, namespace, keys, out, parent_key)).blocks


def get(session: Session, namespace: Namespace, keys: Sequence[bytes], out: np.ndarray | None, parent_key: bytes
        ) -> Op:
    """The stored prefix of `keys`, and why it is not longer (a GetResult)."""
    if not keys:
        return GetResult(_wire.blocks_to_output(namespace, _wire.output_rows(namespace, 0, out), 0))
    yield from connect(session)
    if session.arena is not None and len(keys) * namespace.block_bytes >= session.streamed_get_min_bytes:
        return (yield from _get_streamed(session, namespace, keys, out, parent_key))
    response = yield from _arena_get(session, namespace, keys, parent_key)
    if response is None:
        return (yield from _get_inline(session, namespace, keys, out, parent_key))
    try:
        rows = _wire.output_rows(namespace, response.matched, out)
        if response.matched:
            session.arena.gather(response.offsets, namespace.block_bytes, rows)
    finally:
        if response.lease_id:
            yield from release(session, [response.lease_id])
    return GetResult(_wire.blocks_to_output(namespace, rows, response.matched), response.cut)


def _get_request(session: Session, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes
                 ) -> kvd_pb2.GetRequest:
    return kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, client_id=session.client_id, keys=keys,
                              lease_ms=session.lease_ms, parent_key=parent_key,
                              arena_instance_id=session.arena.instance_id)


def _arena_get(session: Session, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes) -> Op:
    """A Get answered with arena offsets under a lease; None when this client has no arena."""
    yield from connect(session)
    if session.arena is None:
        return None
    return (yield from remapping(session, lambda: ("Get", _get_request(session, namespace, keys, parent_key))))


def _get_streamed(
    session: Session, namespace: Namespace, keys: Sequence[bytes], out: np.ndarray | None, parent_key: bytes
) -> Op:
    """get_numpy over GetBlocks: each run of blocks copied out as soon as the daemon says it landed."""
    stream, first = yield from open_get_stream(session, "GetBlocks", namespace, keys, parent_key)
    if stream is None:  # the daemon restarted and this client can no longer map its arena
        return (yield from _get_inline(session, namespace, keys, out, parent_key))
    try:
        blocks = _wire.StreamedCopy(namespace, session.arena, first, out)
        message = first
        while message is not None:
            blocks.take_blocks(message)
            message = yield (NEXT, stream)
        if blocks.copied != blocks.matched:
            raise FailedPrecondition(f"GetBlocks ended with {blocks.copied} of its {blocks.matched} blocks "
                                     "reported ready")
    finally:
        stream.cancel()
        if first.lease_id:
            yield from release(session, [first.lease_id])
    return GetResult(blocks.blocks(), blocks.cut)


def open_get_stream(session: Session, method: str, namespace: Namespace, keys: Sequence[bytes],
                    parent_key: bytes) -> Op:
    """(open GetBlocks or GetLayers call, its first message), opened again once on the new arena
    if the daemon restarted since this client mapped its arena; (None, None) if it can map none now."""
    if method not in STREAMING:
        raise ValueError(f"{method} is not a streamed Get")
    yield from connect(session)
    if session.arena is None:
        return None, None
    stream = yield (method, _get_request(session, namespace, keys, parent_key))
    try:
        return stream, (yield from _first_message(stream))
    except grpc.RpcError as error:
        if not arena_changed(error):
            raise
    yield from remap(session)
    if session.arena is None:
        return None, None
    stream = yield (method, _get_request(session, namespace, keys, parent_key))
    return stream, (yield from _first_message(stream))


def _first_message(stream: Any) -> Op:
    message = yield (NEXT, stream)
    if message is None:
        raise FailedPrecondition("the daemon ended a streamed Get without a message")
    return message


def get_pinned(session: Session, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes) -> Op:
    """The stored prefix of `keys` left in the arena under a lease: (response, arena), for PinnedBlocks."""
    yield from connect(session)
    if session.arena is not None and not keys:
        return None, session.arena
    response = yield from _arena_get(session, namespace, keys, parent_key)
    if response is None:
        raise FailedPrecondition("get_pinned needs the daemon's shared-memory arena; use get_numpy")
    return response, session.arena


def _get_inline(
    session: Session, namespace: Namespace, keys: Sequence[bytes], out: np.ndarray | None, parent_key: bytes
) -> Op:
    batch = _wire.inline_batch_blocks(namespace, session.info.max_message_bytes)
    payloads: list[bytes] = []
    cut = kvd_pb2.GET_CUT_NONE
    for start in range(0, len(keys), batch):
        stop = min(start + batch, len(keys))
        response = yield (
            "Get",
            kvd_pb2.GetRequest(
                namespace_id=namespace.namespace_id,
                client_id=session.client_id,
                keys=keys[start:stop],
                inline=True,
                parent_key=keys[start - 1] if start else parent_key,
            ),
        )
        payloads.extend(response.blocks)
        if response.matched < stop - start:
            cut = response.cut
            break
    rows = _wire.output_rows(namespace, len(payloads), out)
    if payloads:
        rows[:] = np.frombuffer(b"".join(payloads), dtype=np.uint8).reshape(len(payloads), namespace.block_bytes)
    return GetResult(_wire.blocks_to_output(namespace, rows, len(payloads)), cut)
