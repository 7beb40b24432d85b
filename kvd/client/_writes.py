"""The writing operations: put (through the arena with Reserve and Commit, or inline with
PutInline, acknowledged in host memory or durable on disk), reserve for callers that fill the
slots themselves, the durable commit PinnedBlocks shares, and Delete.
See kvd.client._ops for how an operation runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from kvd.client import _wire
from kvd.client._ops import Op, Session, connect, release, remapping
from kvd.client._wire import Namespace
from kvd.client.errors import NotDurableError
from kvd.errors import FailedPrecondition
from kvd.v1 import kvd_pb2

# Reserve statuses a chain goes on after: the key is stored already, or reserved by this call.
CONTINUING = (kvd_pb2.RESERVE_STATUS_RESERVED, kvd_pb2.RESERVE_STATUS_EXISTS)


def put(
    session: Session, namespace: Namespace, keys: Sequence[bytes], blocks: Any, parent_key: bytes = b"",
    durable: bool = False,
) -> Op:
    """Store the blocks not yet stored; returns how many this call wrote,
    or with durable, how many of `keys` are durable: all of them.

    durable: return only once EVERY block of `keys` is durable on disk,
    those this call wrote and those already stored alike (a retry of a
    durable put after a timeout is as durable as a first try); otherwise
    raise NotDurableError, which says how many leading keys are durable
    and why the others are not (host memory full, another client writing
    them, a disk error, the disk tier or the tenant's disk quota full).
    Without durable, a short count means the daemon stopped storing (host
    memory full, or another client writing the next key).
    """
    rows = _wire.as_rows(namespace, blocks, len(keys))
    if not keys:
        return 0
    yield from connect(session)
    if durable:
        yield from _put_durable(session, namespace, keys, rows, parent_key)
        return len(keys)  # it raised otherwise
    if session.arena is None:
        return (yield from _put_inline(session, namespace, keys, rows, parent_key, kvd_pb2.ACK_HOST))
    return (yield from _put_shared(session, namespace, keys, rows, parent_key))


def reserve(session: Session, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes = b"") -> Op:
    """Reserve arena slots for the keys (the Reserve response), mapping the
    arena of a restarted daemon first; None when that arena cannot be mapped.
    Callers that write the slots themselves (engine connectors) use it alone."""
    return (yield from remapping(session, lambda: (
        "Reserve",
        kvd_pb2.ReserveRequest(
            namespace_id=namespace.namespace_id,
            client_id=session.client_id,
            parent_key=parent_key,
            keys=keys,
            lease_ms=session.lease_ms,
            arena_instance_id=session.arena.instance_id,
        ),
    )))


def reserve_slots(session: Session, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes) -> Op:
    """reserve for ReservedBlocks: connects first, and FailedPrecondition without the arena."""
    yield from connect(session)
    response = None
    if session.arena is not None:
        response = yield from reserve(session, namespace, keys, parent_key)
    if response is None or session.arena is None:
        raise FailedPrecondition("reserve needs the daemon's shared-memory arena; use put")
    return response


def _reserve_and_scatter(
    session: Session, namespace: Namespace, keys: Sequence[bytes], rows: np.ndarray, parent_key: bytes
) -> Op:
    """Reserve the keys and copy the reserved run's blocks into the arena:
    (Reserve response, start, stop of the run), or None when the daemon
    restarted and its new arena could not be mapped (then go inline)."""
    response = yield from reserve(session, namespace, keys, parent_key)
    if session.arena is None:
        return None
    start, stop = _wire.reserved_run(response.statuses)
    if start < stop:
        try:
            session.arena.scatter(rows[start:stop], response.offsets[start:stop])
        except BaseException:
            yield from release(session, [response.lease_id])
            raise
    return response, start, stop


def commit(session: Session, namespace: Namespace, lease_id: int, ack: int) -> Op:
    """Commit what a Reserve's lease reserved, once its slots are filled; `ack`: ACK_HOST or ACK_DURABLE."""
    yield ("Commit", kvd_pb2.CommitRequest(
        namespace_id=namespace.namespace_id, client_id=session.client_id, lease_id=lease_id, ack=ack))


def _put_shared(
    session: Session, namespace: Namespace, keys: Sequence[bytes], rows: np.ndarray, parent_key: bytes
) -> Op:
    """One Reserve and Commit through the arena; how many blocks it wrote."""
    reserved = yield from _reserve_and_scatter(session, namespace, keys, rows, parent_key)
    if reserved is None:
        return (yield from _put_inline(session, namespace, keys, rows, parent_key, kvd_pb2.ACK_HOST))
    response, start, stop = reserved
    if start < stop:
        yield from commit(session, namespace, response.lease_id, kvd_pb2.ACK_HOST)
    return stop - start


def _put_shared_durable(
    session: Session, namespace: Namespace, keys: Sequence[bytes], rows: np.ndarray, parent_key: bytes
) -> Op:
    """One durable round through the arena: (written, Reserve statuses, or
    None if it went inline), or NotDurableError counting from keys[0].

    Blocks Reserve reserved are committed with ACK_DURABLE; since a block is
    only ever on disk with its whole prefix, that makes the stored keys
    before them durable too. Without a reservation, the stored prefix
    Reserve found is made durable with MakeDurable: it may be in host
    memory only, and a retry must not trust it.
    """
    try:
        reserved = yield from _reserve_and_scatter(session, namespace, keys, rows, parent_key)
    except grpc.RpcError as error:
        raise NotDurableError.from_rpc(error, 0, len(keys)) from None  # nothing stored (host memory full, ...)
    if reserved is None:
        return (yield from _put_inline(session, namespace, keys, rows, parent_key, kvd_pb2.ACK_DURABLE)), None
    response, start, stop = reserved
    return (yield from commit_durable(session, namespace, keys, parent_key, response, start, stop))


def commit_durable(session: Session, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes,
                   response: kvd_pb2.ReserveResponse, start: int, stop: int) -> Op:
    """Commit the filled run [start, stop) of a Reserve of `keys` with ACK_DURABLE, or make the
    stored prefix durable when nothing was reserved: (written, statuses), or NotDurableError."""
    statuses = list(response.statuses)
    if start < stop:
        try:
            yield from commit(session, namespace, response.lease_id, kvd_pb2.ACK_DURABLE)
        except grpc.RpcError as error:
            # Its count starts after the stored prefix, which is durable once
            # any block after it is (and not known to be otherwise).
            made = NotDurableError.from_rpc(error, 0, len(keys)).durable
            raise NotDurableError.from_rpc(error, start if made else 0, len(keys)) from None
        return stop - start, statuses
    stored = _leading(statuses, (kvd_pb2.RESERVE_STATUS_EXISTS,))
    if stored:
        try:
            yield ("MakeDurable", kvd_pb2.MakeDurableRequest(
                namespace_id=namespace.namespace_id, parent_key=parent_key, keys=keys[:stored]))
        except grpc.RpcError as error:
            raise NotDurableError.from_rpc(error, 0, len(keys)) from None
    return 0, statuses


def _put_durable(
    session: Session, namespace: Namespace, keys: Sequence[bytes], rows: np.ndarray, parent_key: bytes
) -> Op:
    """put(durable=True): every key durable, or NotDurableError."""
    if session.arena is None:
        return (yield from _put_inline(session, namespace, keys, rows, parent_key, kvd_pb2.ACK_DURABLE))
    written, statuses = yield from _put_shared_durable(session, namespace, keys, rows, parent_key)
    if statuses is not None:  # (None: it went inline after a restart of the daemon, all durable)
        check_all_stored(statuses)
    return written


def check_all_stored(statuses: Sequence[int]) -> None:
    """NotDurableError unless every key of a durable put is stored (the leading ones are durable)."""
    stored = _leading(statuses, CONTINUING)
    if stored < len(statuses):
        raise _not_stored(statuses[stored], stored, len(statuses))


def _leading(statuses: Sequence[int], kinds: tuple[int, ...]) -> int:
    """How many leading statuses are of `kinds`."""
    count = 0
    while count < len(statuses) and statuses[count] in kinds:
        count += 1
    return count


def _not_stored(blocked: int, durable: int, requested: int) -> NotDurableError:
    if blocked == kvd_pb2.RESERVE_STATUS_IN_FLIGHT:
        code, why = grpc.StatusCode.UNAVAILABLE, "another client is writing them now; retry once it has committed"
    else:
        code, why = grpc.StatusCode.RESOURCE_EXHAUSTED, "the host tier has no slot to spare (every slot is pinned)"
    return NotDurableError(code, f"keys[{durable}:{requested}] were not stored, so they are not durable: {why}; "
                           f"the first {durable} are durable", durable, requested)


def _put_inline(
    session: Session, namespace: Namespace, keys: Sequence[bytes], rows: np.ndarray, parent_key: bytes, ack: int
) -> Op:
    """Puts through gRPC messages, in batches under the daemon's message limit.
    With ACK_DURABLE every batch is all durable, or NotDurableError counting from keys[0]."""
    batch = _wire.inline_batch_blocks(namespace, session.info.max_message_bytes)
    written = 0
    for start in range(0, len(keys), batch):
        stop = min(start + batch, len(keys))
        request = kvd_pb2.PutInlineRequest(
            namespace_id=namespace.namespace_id,
            client_id=session.client_id,
            parent_key=keys[start - 1] if start else parent_key,
            keys=keys[start:stop],
            blocks=[row.tobytes() for row in rows[start:stop]],
            ack=ack,
        )
        try:
            response = yield ("PutInline", request)
        except grpc.RpcError as error:
            if ack != kvd_pb2.ACK_DURABLE:
                raise
            raise NotDurableError.from_rpc(error, 0, stop - start).shifted(start, len(keys)) from None
        written += response.sealed
        if response.statuses and response.statuses[-1] not in CONTINUING:
            break  # the chain stopped (full, or another writer): no parent for the rest
    return written


def delete(session: Session, namespace: Namespace, keys: Sequence[bytes]) -> Op:
    response = yield ("Delete", kvd_pb2.DeleteRequest(namespace_id=namespace.namespace_id, keys=keys))
    return response.deleted, response.pinned
