"""The daemon's half of kvd.arena_protocol: hand each client its arena file.

Served on the event loop: a request is one short line read with a
deadline (a client that connects and says nothing is dropped after
`REQUEST_TIMEOUT_S`), the answer one sendmsg. With tokens, the token is
checked with the gRPC interceptor's TokenTable, refusals are counted in
the same kvd_auth_failures_total, and the log names the peer's pid and
uid (SO_PEERCRED), never the token.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvd import arena_protocol
from kvd.server.auth import MAX_TOKEN_CHARS, TokenTable
from kvd.tiers.host import DEFAULT_TENANT, HostArena

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 2.0


class ArenaSocket:
    def __init__(self, path: Path, arena: HostArena, tokens: TokenTable | None,
                 on_refused: Callable[[str], None] = lambda reason: None,
                 request_timeout_s: float = REQUEST_TIMEOUT_S,
                 on_deposit: Callable[[str, list[int]], dict[str, Any]] | None = None,
                 on_ring: Callable[[str, str], tuple[dict[str, Any], int]] | None = None) -> None:
        self.path = path
        # The device plane's deposit (kvd.planes.device): keeps copies of the descriptors an
        # engine passes for its RegisterPool. None: no device plane, deposits are refused.
        self.on_deposit = on_deposit
        # The device plane's rings (DevicePlane.ring_fd): a pool's I/O ring for the tenant that registered it.
        self.on_ring = on_ring
        self.request_timeout_s = request_timeout_s
        self.arena = arena
        self.tokens = tokens
        self.on_refused = on_refused
        self.handed_out = 0
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()

    def start(self, spawn: Callable[..., asyncio.Task] | None = None) -> None:
        """Listen; the accept loop runs under `spawn` (the daemon's supervisor), if given."""
        """Bind (mode 0600 from the start, whatever the umask) and accept on the running loop."""
        self.path.unlink(missing_ok=True)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        previous_umask = os.umask(0o177)
        try:
            listener.bind(str(self.path))
        finally:
            os.umask(previous_umask)
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        spawn = spawn or asyncio.get_running_loop().create_task
        self._accepting = spawn(self._accept(), name="arena-socket")

    async def close(self) -> None:
        for task in [self._accepting, *self._connections]:
            if task is not None:
                task.cancel()
        for task in [self._accepting, *self._connections]:
            if task is not None:
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        self.path.unlink(missing_ok=True)

    async def _accept(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            connection, _ = await loop.sock_accept(self._listener)
            task = loop.create_task(self._serve(connection))
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    async def _serve(self, connection: socket.socket) -> None:
        received: list[int] = []  # descriptors the client passed; closed here whatever happens
        with connection:
            try:
                request = await asyncio.wait_for(self._read(connection, received), self.request_timeout_s)
                reply, fd = self.answer(request, connection, received)
                connection.sendmsg([arena_protocol.encode(reply)], arena_protocol.fds_message(fd) if fd >= 0 else [])
            except TimeoutError:
                log.warning("arena socket: no request in time", extra=_peer(connection))
            except OSError as error:
                log.warning("arena socket: connection failed", extra={**_peer(connection), "reason": str(error)})
            finally:
                for fd in received:
                    os.close(fd)

    async def _read(self, connection: socket.socket, received: list[int]) -> bytes:
        loop = asyncio.get_running_loop()
        data = b""
        while not data.endswith(b"\n") and len(data) <= arena_protocol.MAX_REQUEST_BYTES:
            await _readable(loop, connection)
            try:
                chunk, fds, _flags, _address = socket.recv_fds(
                    connection, arena_protocol.MAX_REQUEST_BYTES + 1 - len(data), arena_protocol.MAX_DEPOSIT_FDS)
            except BlockingIOError:
                continue
            received.extend(fds)
            if not chunk:
                break
            data += chunk
        return data

    def answer(self, data: bytes, connection: socket.socket, received: list[int] = ()) -> tuple[dict[str, Any], int]:
        """(reply, descriptor to pass or -1) for one request; `received`: descriptors passed with it."""
        if len(data) > arena_protocol.MAX_REQUEST_BYTES:
            return _refusal("INVALID_ARGUMENT", f"request longer than {arena_protocol.MAX_REQUEST_BYTES} bytes"), -1
        try:
            request = json.loads(data)
            if not isinstance(request, dict):
                raise ValueError
        except ValueError:
            return _refusal("INVALID_ARGUMENT", "the request is not one line of a JSON object"), -1
        instance_id = request.get("instance_id", "")
        if instance_id and instance_id != self.arena.instance_id:
            return _refusal("FAILED_PRECONDITION",
                            f"instance {str(instance_id)[:32]!r} is gone: the daemon restarted, call ArenaInfo again"), -1
        tenant = DEFAULT_TENANT
        if self.tokens is not None:
            token = request.get("token")
            if not isinstance(token, str) or not token or len(token) > MAX_TOKEN_CHARS:
                self.on_refused("missing_token")
                log.warning("arena socket: refused, no token", extra=_peer(connection))
                return _refusal("UNAUTHENTICATED", "no bearer token: send the tenant's token"), -1
            found = self.tokens.authenticate(token)
            if found is None:
                self.on_refused("unknown_token")
                log.warning("arena socket: refused, unknown token", extra=_peer(connection))
                return _refusal("UNAUTHENTICATED", "the token is not one of a configured tenant"), -1
            tenant = found.name
        if request.get("op") == "deposit":
            return self._deposit(tenant, request, list(received), connection), -1
        if request.get("op") == "ring":
            ring = request.get("ring")
            if self.on_ring is None:
                return _refusal("FAILED_PRECONDITION", "this kvd has no device plane ([device] kind = \"off\")"), -1
            if not isinstance(ring, str) or not ring or len(ring) > 64:
                return _refusal("INVALID_ARGUMENT", "ring: a RegisterPoolResponse.ring_token"), -1
            return self.on_ring(tenant, ring)
        layout = self.arena.layout
        self.handed_out += 1
        reply = {"ok": True, "instance_id": self.arena.instance_id, "arena_bytes": layout.arena_bytes,
                 "slot_bytes": layout.slot_bytes, "slot_count": layout.slot_count}
        return reply, self.arena.tenant_fd(tenant)


    def _deposit(self, tenant: str, request: dict[str, Any], fds: list[int],
                 connection: socket.socket) -> dict[str, Any]:
        if self.on_deposit is None:
            return _refusal("FAILED_PRECONDITION", "this kvd has no device plane ([device] kind = \"off\")")
        if request.get("count") != len(fds):
            return _refusal("INVALID_ARGUMENT", f"the request says {request.get('count')!r} descriptors and "
                                                f"{len(fds)} came (at most {arena_protocol.MAX_DEPOSIT_FDS})")
        reply = self.on_deposit(tenant, fds)
        log.info("arena socket: descriptors deposited", extra={**_peer(connection), "count": len(fds),
                                                               "accepted": reply.get("ok", False)})
        return reply


async def _readable(loop: asyncio.AbstractEventLoop, connection: socket.socket) -> None:
    """Until `connection` has something to read (or is closed)."""
    ready = loop.create_future()
    loop.add_reader(connection.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(connection.fileno())


def _refusal(code: str, message: str) -> dict[str, Any]:
    return {"ok": False, "code": code, "message": message}


def _peer(connection: socket.socket) -> dict[str, int]:
    try:
        pid, uid, gid = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    except OSError:
        return {}
    return {"peer_pid": pid, "peer_uid": uid, "peer_gid": gid}
