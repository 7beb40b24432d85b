"""Client operations written once, driven by the sync and the async client.

Each operation is a generator that yields the RPCs it needs as
`(method_name, request)` and receives each response (or has the RPC's error
thrown into it), so the blocking `Client` and the asyncio `AsyncClient` run
the same decisions and differ only in how they call a stub. A server-streaming
method (one in STREAMING) answers with the open call; `(NEXT, call)` then
answers with its next message, or None once the stream has ended.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvd import arena_protocol
from kvd.client import _wire
from kvd.client._wire import (ArenaMapping, ClusterLookupResult, GetResult, LookupResult, Namespace, NodeMatch,
                             PrefetchResult)
from kvd.client.errors import NotDurableError
from kvd.core.keys import KEY_BYTES, NamespaceSpec
from kvd.errors import FailedPrecondition
from kvd.v1 import kvd_pb2, kvd_pb2_grpc

Call = tuple[str, Any]
Op = Generator[Call, Any, Any]
NEXT = "(next message)"
STREAMING = frozenset({"GetBlocks", "GetLayers"})
# A shared-memory Get of at least this many bytes streams (GetBlocks): the
# client copies the blocks that have landed while the daemon reads the rest
# from disk. Below it one unary Get costs less than opening a stream.
STREAMED_GET_MIN_BYTES = 16 << 20

CHANNEL_MESSAGE_BYTES = 1 << 30
# The bearer token when a client is given none (a daemon with auth.mode = "token").
TOKEN_ENV = "KVD_TOKEN"
CONTINUING = (kvd_pb2.RESERVE_STATUS_RESERVED, kvd_pb2.RESERVE_STATUS_EXISTS)


RECONNECT_BACKOFF_MS = (100, 2_000)  # first and longest wait before dialling a lost daemon again


def channel_options() -> list[tuple[str, int]]:
    # The daemon enforces its own, smaller limit and names it in its error;
    # the client only refuses absurd sizes.
    return [
        ("grpc.max_receive_message_length", CHANNEL_MESSAGE_BYTES),
        ("grpc.max_send_message_length", CHANNEL_MESSAGE_BYTES),
        # The daemon is on this node: after it restarts, dial again within
        # seconds, not after gRPC's default backoff of up to two minutes
        # (an engine's connector would miss every request meanwhile).
        ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
        ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
    ]


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """TLS to a daemon's TCP listener (server.tls_cert_file), as PEM files.

    ca_file: the CAs to trust (None: the system's). cert_file and key_file:
    this client's certificate chain and key, for a daemon that requires
    them (server.tls_client_ca_file). server_name: the name to check the
    daemon's certificate for, when it is not the target's host.
    """

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        def read(path: str | None) -> bytes | None:
            return Path(path).read_bytes() if path else None

        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("TlsConfig needs both cert_file and key_file, or neither")
        return grpc.ssl_channel_credentials(read(self.ca_file), read(self.key_file), read(self.cert_file))

    def options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def channel_arguments(tls: TlsConfig | None) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    """(credentials or None for a plaintext channel, channel options)."""
    if tls is None:
        return None, channel_options()
    return tls.credentials(), channel_options() + tls.options()


def resolve_token(token: str | None) -> str | None:
    """The bearer token: the one given, else $KVD_TOKEN, else None."""
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    return token or None


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata every call carries: the bearer token, if any (else $KVD_TOKEN)."""
    token = resolve_token(token)
    return (("authorization", f"Bearer {token}"),) if token else None


@dataclass(slots=True)
class Session:
    """What a client knows about its daemon."""

    client_id: str
    use_shared_memory: bool | None
    lease_ms: int = 0
    target: str = ""
    # The bearer token (None: none); never shown.
    token: str | None = field(default=None, repr=False)
    # A shared-memory Get of at least this many bytes goes over GetBlocks.
    streamed_get_min_bytes: int = STREAMED_GET_MIN_BYTES
    info: kvd_pb2.ArenaInfoResponse | None = None
    arena: ArenaMapping | None = None
    connected: bool = field(default=False)

    def close(self) -> None:
        if self.arena is not None:
            self.arena.close()
            self.arena = None


class ClientBase:
    """State both clients share; subclasses only add how a stub is called."""

    def __init__(
        self,
        target: str,
        channel: Any,
        *,
        client_id: str | None = None,
        use_shared_memory: bool | None = None,
        timeout_s: float = 30.0,
        lease_ms: int = 0,
        token: str | None = None,
        streamed_get_min_bytes: int = STREAMED_GET_MIN_BYTES,
    ) -> None:
        self.target = target
        self.timeout_s = timeout_s
        token = resolve_token(token)
        self.session = Session(client_id or _wire.new_client_id(), use_shared_memory, lease_ms, target, token,
                               streamed_get_min_bytes)
        self._stub = kvd_pb2_grpc.KvdStub(channel)
        # Sent with every call; never logged or shown (repr, errors).
        self._metadata = call_metadata(token)

    @property
    def client_id(self) -> str:
        return self.session.client_id


def connect(session: Session) -> Op:
    if session.connected:
        return
    session.info = yield ("ArenaInfo", kvd_pb2.ArenaInfoRequest())
    session.connected = True
    if session.use_shared_memory is False:
        return
    # The arena socket next to the unix socket this client dialled (the
    # daemon's own path may differ in another mount namespace), else the
    # one the daemon names.
    path = arena_protocol.socket_path_for_target(session.target)
    if path is None and session.info.arena_socket:
        path = Path(session.info.arena_socket)
    try:
        if path is None:
            raise OSError("the daemon offers no shared memory (it has no unix socket)")
        session.arena = ArenaMapping.receive(path, session.token, session.info)
    except OSError:
        if session.use_shared_memory:
            raise
        session.arena = None


def arena_changed(error: BaseException) -> bool:
    """Whether a call failed because the daemon's arena is not the one this client mapped."""
    return (isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.FAILED_PRECONDITION
            and (error.details() or "").startswith(arena_protocol.ARENA_CHANGED))


def remap(session: Session) -> Op:
    """Forget the arena of a daemon instance that is gone and map the current one."""
    session.close()
    session.connected = False
    yield from connect(session)


def remapping(session: Session, call: Callable[[], Call]) -> Op:
    """One shared-memory call, made again once after mapping the new arena
    if the daemon restarted since this client mapped its arena. Without the
    check the client would write into (or read from) the old instance's
    memory while the daemon sealed (or served) its own slots."""
    try:
        return (yield call())
    except grpc.RpcError as error:
        if not arena_changed(error):
            raise
    yield from remap(session)
    if session.arena is None:
        return None
    return (yield call())


def register_namespace(session: Session, spec: NamespaceSpec) -> Op:
    response = yield ("RegisterNamespace", kvd_pb2.RegisterNamespaceRequest(spec=_wire.spec_message(spec)))
    return _wire.namespace_from(spec, response)


def lookup(session: Session, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes,
           include_remote: bool = False) -> Op:
    request = kvd_pb2.LookupRequest(namespace_id=namespace.namespace_id, parent_key=parent_key,
                                    include_remote=include_remote)
    packed = b"".join(keys)
    if len(packed) == KEY_BYTES * len(keys):
        request.packed_keys = packed
    else:  # a key of the wrong size: the daemon names it (keys[i] is N bytes)
        request.keys.extend(keys)
    response = yield ("Lookup", request)
    return LookupResult(response.matched, list(response.tiers))


def cluster_lookup(session: Session, namespace: Namespace, keys: Sequence[bytes]) -> Op:
    request = kvd_pb2.ClusterLookupRequest(namespace_id=namespace.namespace_id, packed_keys=b"".join(keys))
    response = yield ("ClusterLookup", request)
    nodes = [NodeMatch(n.node, n.address, n.matched, n.local) for n in response.nodes]
    return ClusterLookupResult(nodes, response.segments, response.segments_unanswered)


def prefetch(session: Session, namespace: Namespace, keys: Sequence[bytes], parent_key: bytes, wait: bool) -> Op:
    response = yield (
        "Prefetch",
        kvd_pb2.PrefetchRequest(namespace_id=namespace.namespace_id, keys=keys, parent_key=parent_key, wait=wait),
    )
    return PrefetchResult(response.matched, response.in_host, response.loading, response.queued, response.refused,
                          response.missing, response.limit, response.loaded)


def release(session: Session, lease_ids: list[int]) -> Op:
    try:
        yield ("Release", kvd_pb2.ReleaseRequest(client_id=session.client_id, lease_ids=lease_ids))
    except grpc.RpcError as error:
        # Already gone (expired) is what a release wanted anyway.
        if error.code() != grpc.StatusCode.NOT_FOUND:
            raise


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


def _commit(session: Session, namespace: Namespace, lease_id: int, ack: int) -> Op:
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
        yield from _commit(session, namespace, response.lease_id, kvd_pb2.ACK_HOST)
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
            yield from _commit(session, namespace, response.lease_id, kvd_pb2.ACK_DURABLE)
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


def delete(session: Session, namespace: Namespace, keys: Sequence[bytes]) -> Op:
    response = yield ("Delete", kvd_pb2.DeleteRequest(namespace_id=namespace.namespace_id, keys=keys))
    return response.deleted, response.pinned


def stats(session: Session) -> Op:
    return (yield ("Stats", kvd_pb2.StatsRequest()))


def demote(session: Session) -> Op:
    return (yield ("Demote", kvd_pb2.DemoteRequest()))


def plan_placement(session: Session, request: kvd_pb2.PlanPlacementRequest) -> Op:
    return (yield ("PlanPlacement", request))


def report_step(session: Session, request: kvd_pb2.ReportStepRequest) -> Op:
    return (yield ("ReportStep", request))


def arena_info(session: Session) -> Op:
    yield from connect(session)
    return session.info


def uses_shared_memory(session: Session) -> Op:
    yield from connect(session)
    return session.arena is not None


def register_pool(session: Session, namespace: Namespace, layers: Sequence[bytes], num_blocks: int, flags: bytes,
                  lease_ms: int, page_stride: int = 0, v_offset: int = 0) -> Op:
    response = yield ("RegisterPool", kvd_pb2.RegisterPoolRequest(
        namespace_id=namespace.namespace_id, client_id=session.client_id, layers=layers, num_blocks=num_blocks,
        flags=flags, lease_ms=lease_ms, page_stride_bytes=page_stride, v_offset_bytes=v_offset))
    return response


def unregister_pool(session: Session, pool_id: int) -> Op:
    yield ("UnregisterPool", kvd_pb2.UnregisterPoolRequest(client_id=session.client_id, pool_id=pool_id))


def save_layers(session: Session, namespace: Namespace, pool_id: int, keys: Sequence[bytes], pages: Sequence[int],
                engine_flag: int, kvd_flag: int, base: int, parent_key: bytes, offload_distance: int) -> Op:
    response = yield ("SaveLayers", kvd_pb2.SaveLayersRequest(
        namespace_id=namespace.namespace_id, client_id=session.client_id, pool_id=pool_id, parent_key=parent_key,
        keys=keys, pages=pages, engine_flag=engine_flag, kvd_flag=kvd_flag, base=base,
        offload_distance=offload_distance))
    return response


def load_layers(session: Session, namespace: Namespace, pool_id: int, keys: Sequence[bytes], pages: Sequence[int],
                kvd_flag: int, base: int, parent_key: bytes) -> Op:
    response = yield ("LoadLayers", kvd_pb2.LoadLayersRequest(
        namespace_id=namespace.namespace_id, client_id=session.client_id, pool_id=pool_id, parent_key=parent_key,
        keys=keys, pages=pages, kvd_flag=kvd_flag, base=base))
    return response
