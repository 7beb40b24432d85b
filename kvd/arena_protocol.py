"""How a co-located client gets the host arena: a file descriptor over a unix socket.

    client                                        daemon (kvd.server.arena_socket)
      | connect <unix_socket>.arena                   |
      | {"token": "...", "instance_id": "..."}\\n  --> |  authenticate (auth.mode = "token")
      | <-- {"ok": true, "arena_bytes": ...}\\n        |
      |     + SCM_RIGHTS: the tenant's arena memfd     |
      | mmap(fd)                                      |

One JSON line each way, then the daemon closes the connection. A second
request, {"op": "deposit", "count": n, "token": ...} sent with n descriptors
(SCM_RIGHTS), hands an engine's pool memory to the device plane: the reply
{"ok": true, "ticket": "..."} names them for RegisterPool (deposit_fds). A third,
{"op": "ring", "ring": "<ring token>"}, answers a pool's I/O ring's memfd to the
tenant that registered the pool (RegisterPoolResponse.ring_token). A refusal
is {"ok": false, "code": "<grpc status name>", "message": "..."} and no
descriptor. The socket sits next to the gRPC unix socket, with the same
mode (0600, or 0660 for server.unix_socket_group), so whoever may call
the daemon may ask; with tokens, the token decides which tenant's file
comes back. A daemon without a unix socket offers no arena.

This module is the client's half and what both halves share.
"""

from __future__ import annotations

import array
import json
import os
import socket
from pathlib import Path
from typing import Any

from kvd.errors import (FailedPrecondition, InvalidArgument, KvdError, NotFound, PermissionDenied, ResourceExhausted,
                        Unauthenticated)

SUFFIX = ".arena"
# How a FAILED_PRECONDITION about a replaced arena begins: the client maps
# the new arena and tries once more.
ARENA_CHANGED = "the arena changed"
# A request longer than this is refused unread (a token is at most 4 KiB).
MAX_REQUEST_BYTES = 8192
MAX_REPLY_BYTES = 4096
TIMEOUT_S = 5.0
# Descriptors one deposit may pass (an engine's pool: one per layer, and its flag words).
MAX_DEPOSIT_FDS = 1024

_ERRORS: dict[str, type[KvdError]] = {
    "UNAUTHENTICATED": Unauthenticated,
    "PERMISSION_DENIED": PermissionDenied,
    "FAILED_PRECONDITION": FailedPrecondition,
    "INVALID_ARGUMENT": InvalidArgument,
    "RESOURCE_EXHAUSTED": ResourceExhausted,
    "NOT_FOUND": NotFound,
}


def socket_path(unix_socket: Path) -> Path:
    """The arena socket of a daemon whose gRPC socket is `unix_socket`."""
    return unix_socket.with_name(unix_socket.name + SUFFIX)


def socket_path_for_target(target: str) -> Path | None:
    """The arena socket next to a gRPC target of the form unix:PATH or unix://PATH (None for TCP)."""
    if not target.startswith("unix:"):
        return None
    path = target[len("unix:"):]
    if path.startswith("//"):
        path = path[2:]
    return socket_path(Path(path)) if path else None


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"


def receive_arena(path: Path, token: str | None, instance_id: str,
                  timeout_s: float = TIMEOUT_S, ring: str = "") -> tuple[int, dict[str, Any]]:
    """(the arena's file descriptor, the daemon's reply) from the socket at `path`; with `ring`
    (a RegisterPoolResponse.ring_token), that pool's I/O ring's instead.

    OSError when the socket cannot be reached; a KvdError when the daemon
    refuses (its status and message) or answers with something that is
    not the protocol. The caller owns (and closes) the descriptor."""
    request: dict[str, Any] = {"instance_id": instance_id} if not ring else {"op": "ring", "ring": ring}
    if token:
        request["token"] = token
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(timeout_s)
        connection.connect(str(path))
        connection.sendall(encode(request))
        reply_bytes = b""
        fds: list[int] = []
        while not reply_bytes.endswith(b"\n"):
            chunk, received, _flags, _address = socket.recv_fds(connection, MAX_REPLY_BYTES, 1)
            fds.extend(received)
            if not chunk:
                break
            reply_bytes += chunk
            if len(reply_bytes) > MAX_REPLY_BYTES:
                break
    try:
        reply = json.loads(reply_bytes)
        if not isinstance(reply, dict):
            raise ValueError("not an object")
    except ValueError:
        _close(fds)
        raise InvalidArgument(f"the arena socket {path} answered {reply_bytes[:80]!r}, not kvd's protocol") from None
    if not reply.get("ok"):
        _close(fds)
        error = _ERRORS.get(str(reply.get("code")), KvdError)
        raise error(f"arena socket: {reply.get('message', 'refused')}")
    if len(fds) != 1:
        _close(fds)
        raise InvalidArgument(f"the arena socket {path} sent {len(fds)} descriptors, not one")
    return fds[0], reply


def deposit_fds(path: Path, token: str | None, fds: list[int], timeout_s: float = TIMEOUT_S) -> str:
    """Pass `fds` to the daemon for a RegisterPool (the device plane); returns the ticket its
    handles name as deposit:<ticket>:<index>. The caller still owns (and closes) its `fds`."""
    request: dict[str, Any] = {"op": "deposit", "count": len(fds)}
    if token:
        request["token"] = token
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(timeout_s)
        connection.connect(str(path))
        socket.send_fds(connection, [encode(request)], fds)
        reply_bytes = b""
        while not reply_bytes.endswith(b"\n") and len(reply_bytes) <= MAX_REPLY_BYTES:
            chunk = connection.recv(MAX_REPLY_BYTES)
            if not chunk:
                break
            reply_bytes += chunk
    try:
        reply = json.loads(reply_bytes)
    except ValueError:
        raise InvalidArgument(f"the arena socket {path} answered {reply_bytes[:80]!r}, not kvd's protocol") from None
    if not isinstance(reply, dict) or not reply.get("ok"):
        message = reply.get("message", "refused") if isinstance(reply, dict) else "refused"
        raise _ERRORS.get(str(reply.get("code")) if isinstance(reply, dict) else "", KvdError)(
            f"arena socket: {message}")
    return str(reply["ticket"])


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def fds_message(fd: int) -> list[tuple[int, int, bytes]]:
    """The ancillary data that passes `fd` (sendmsg)."""
    return [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
