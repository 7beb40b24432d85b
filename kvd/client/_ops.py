"""Client operations written once, driven by the sync and the async client: the protocol
they share, and the session every operation runs in.

Each operation is a generator that yields the RPCs it needs as
`(method_name, request)` and receives each response (or has the RPC's error
thrown into it), so the blocking `Client` and the asyncio `AsyncClient` run
the same decisions and differ only in how they call a stub. A server-streaming
method (one in STREAMING) answers with the open call; `(NEXT, call)` then
answers with its next message, or None once the stream has ended.

Here: the session (what a client knows about its daemon), connecting and mapping
the arena again after the daemon restarts, and releasing leases. The operations,
by job: `_reads.py` (Lookup, Prefetch, Gets), `_writes.py` (Puts, Reserve and
Commit, Delete), `_admin.py` (namespaces, Stats, Demote) and `_device_ops.py`
(the device plane, placement planning); `_channel.py` dials the daemon.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvd import arena_protocol
from kvd.client import _wire
from kvd.client._channel import call_metadata, resolve_token
from kvd.client._wire import ArenaMapping
from kvd.v1 import kvd_pb2, kvd_pb2_grpc

Call = tuple[str, Any]
Op = Generator[Call, Any, Any]
NEXT = "(next message)"
STREAMING = frozenset({"GetBlocks", "GetLayers"})
# A shared-memory Get of at least this many bytes streams (GetBlocks): the
# client copies the blocks that have landed while the daemon reads the rest
# from disk. Below it one unary Get costs less than opening a stream.
STREAMED_GET_MIN_BYTES = 16 << 20


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
    # Whether the daemon is in a cluster, as its answers said (None: not asked yet).
    in_cluster: bool | None = None

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


def release(session: Session, lease_ids: list[int]) -> Op:
    try:
        yield ("Release", kvd_pb2.ReleaseRequest(client_id=session.client_id, lease_ids=lease_ids))
    except grpc.RpcError as error:
        # Already gone (expired) is what a release wanted anyway.
        if error.code() != grpc.StatusCode.NOT_FOUND:
            raise


def arena_info(session: Session) -> Op:
    yield from connect(session)
    return session.info


def uses_shared_memory(session: Session) -> Op:
    yield from connect(session)
    return session.arena is not None
