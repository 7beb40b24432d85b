"""Tenants and bearer tokens (auth.mode = "token").

    client --authorization: Bearer <token>--> AuthInterceptor --tenant--> KvdService
                                                   |
                                       UNAUTHENTICATED / PERMISSION_DENIED

`AuthInterceptor` runs before every call of the kvd.v1.Kvd service (the
health service stays open, for probes). It takes the token from the call's
metadata and finds its tenant in the `TokenTable`: the SHA-256 of the
presented token is compared with `hmac.compare_digest` against the digest of
every token of every tenant, each time, so neither the result nor the time
it takes says which stored token came closest. No token, or one it does not
know: UNAUTHENTICATED. An administrative method (`ADMIN_METHODS`) called by
a tenant that is not an admin: PERMISSION_DENIED. Otherwise the call runs
with its tenant in `CURRENT_TENANT`, and the service keeps it inside what
that tenant owns:

* namespaces: the service resolves every request's namespace_id within the
  tenant (`Engine.tenant_namespace`); a tenant's namespaces are distinct
  engine namespaces even for identical specs (kvd.core.keys: `tenant`), so
  another tenant's namespace, its blocks and their keys are NOT_FOUND,
  exactly as if nobody had registered it;
* client ids: scoped by the tenant's name (`scoped_client_id`), so leases,
  and the per-client pin cap, are per tenant;
* models: a tenant registers and uses only namespaces of the model ids its
  `namespaces` patterns allow.

Tokens are never logged, never part of an error message, a metric or
`kvd config`; the daemon keeps only their digests.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import grpc

from kvd.config import TenantSettings
from kvd.core.lease import SCOPE_SEPARATOR
from kvd.errors import InvalidArgument

SERVICE_PREFIX = "/kvd.v1.Kvd/"
# Methods only an admin tenant may call: Stats shows every tenant's
# namespaces and the daemon's metrics; Demote moves every tenant's blocks;
# ListNamespaces shows, and DeleteNamespace deletes, any tenant's namespace.
ADMIN_METHODS = frozenset({"Stats", "Demote", "ListNamespaces", "DeleteNamespace"})
# Client ids a client chooses, at most (kvd.core.engine allows room for the scope).
MAX_CLIENT_ID_CHARS = 128
# A bearer token longer than this is refused unread (gRPC caps metadata at 8 KiB anyway).
MAX_TOKEN_CHARS = 4096
# Why a call was refused: the label values of kvd_auth_failures_total.
FAILURE_REASONS = ("missing_token", "unknown_token", "not_admin")


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    # Glob patterns over the model ids whose namespaces it may use.
    namespaces: tuple[str, ...]
    admin: bool = False

    def may_use(self, model_id: str) -> bool:
        return any(fnmatchcase(model_id, pattern) for pattern in self.namespaces)


# The tenant of the call being served; None without auth.
CURRENT_TENANT: ContextVar[Tenant | None] = ContextVar("kvd_tenant", default=None)


def tenant_of(settings: TenantSettings) -> Tenant:
    return Tenant(settings.name, settings.namespaces, settings.admin)


class TokenTable:
    """Token digests -> tenants; lookups compare every digest, in constant time."""

    def __init__(self, tenants: Sequence[TenantSettings]) -> None:
        self._entries = [(digest, tenant_of(settings)) for settings in tenants for digest in settings.token_digests]
        self._tenants = {settings.name: settings for settings in tenants}

    def reload(self, tenants: Sequence[TenantSettings]) -> str | None:
        """Take new token digests (SIGHUP: token rotation); None, or why nothing changed.

        Only tokens may change: the tenants, their namespaces, quotas and
        admin flags are wired into the engine and the service at start, so
        a file that changes them is refused whole and the old tokens stay.
        """
        new = {settings.name: settings for settings in tenants}
        if set(new) != set(self._tenants):
            return "the set of tenants differs from the one the daemon started with (restart to change it)"
        for name, settings in new.items():
            old = self._tenants[name]
            if (settings.namespaces, settings.host_bytes, settings.disk_bytes, settings.admin) != (
                    old.namespaces, old.host_bytes, old.disk_bytes, old.admin):
                return f"tenant {name!r}: only tokens may change without a restart"
        # One assignment: a call being authenticated sees the old list or the new one.
        self._entries = [(digest, tenant_of(settings)) for settings in tenants for digest in settings.token_digests]
        self._tenants = new
        return None

    def __len__(self) -> int:
        return len(self._entries)

    def authenticate(self, token: str) -> Tenant | None:
        presented = hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
        found = None
        for digest, tenant in self._entries:
            # No early exit: every digest is compared, whichever matches.
            if hmac.compare_digest(presented, digest):
                found = tenant
        return found


def bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> str | None:
    """The token of an `authorization: Bearer <token>` entry, or None."""
    for key, value in metadata or ():
        if key != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("latin-1")
        scheme, _, token = value.strip().partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token or len(token) > MAX_TOKEN_CHARS:
            return None
        return token
    return None


def scoped_client_id(tenant: Tenant | None, client_id: str) -> str:
    """The engine's name of a client: the tenant's name and the client's own id.

    Raises InvalidArgument for an id the engine would refuse anyway, before
    the scope makes it longer. An empty id stays empty, so that the engine
    refuses it wherever a client id is needed, as it does without tenants
    (scoped, it would be the tenant's name: a valid id).
    """
    if len(client_id) > MAX_CLIENT_ID_CHARS:
        raise InvalidArgument(f"client_id must be 1..{MAX_CLIENT_ID_CHARS} characters")
    if tenant is None or not client_id:
        return client_id
    if SCOPE_SEPARATOR in client_id:
        raise InvalidArgument("client_id must not contain NUL characters")
    return f"{tenant.name}{SCOPE_SEPARATOR}{client_id}"


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call of the Kvd service; see the module docstring.

    `on_refused(reason)` is called for every refused call, with one of
    FAILURE_REASONS (the daemon counts them in kvd_auth_failures_total).
    """

    def __init__(self, tokens: TokenTable, on_refused: Callable[[str], None]) -> None:
        self._tokens = tokens
        self._on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(SERVICE_PREFIX):
            return handler  # the health service, or an unknown method (UNIMPLEMENTED)
        token = bearer_token(handler_call_details.invocation_metadata)
        tenant = self._tokens.authenticate(token) if token is not None else None
        if tenant is None:
            reason = "missing_token" if token is None else "unknown_token"
            self._on_refused(reason)
            return _refusal(
                handler,
                grpc.StatusCode.UNAUTHENTICATED,
                "kvd needs a tenant's token: send the metadata `authorization: Bearer <token>`"
                if token is None
                else "kvd does not know this bearer token",
            )
        name = method[len(SERVICE_PREFIX):]
        if name in ADMIN_METHODS and not tenant.admin:
            self._on_refused("not_admin")
            return _refusal(
                handler,
                grpc.StatusCode.PERMISSION_DENIED,
                f"{name} is administrative; tenant {tenant.name!r} is not an admin",
            )
        return _with_tenant(handler, tenant)


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that refuses the call unread."""
    if handler.unary_stream is not None:

        async def refuse_stream(request, context):
            await context.abort(code, details)
            yield  # unreachable: makes this an async generator, as the method's kind wants

        return grpc.unary_stream_rpc_method_handler(refuse_stream, response_serializer=handler.response_serializer)

    async def refuse(request, context):
        await context.abort(code, details)

    return grpc.unary_unary_rpc_method_handler(refuse, response_serializer=handler.response_serializer)


def _with_tenant(handler: grpc.RpcMethodHandler, tenant: Tenant) -> grpc.RpcMethodHandler:
    """`handler`, run with CURRENT_TENANT set to `tenant` (each call runs in a task of its own)."""
    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def stream(request, context):
            CURRENT_TENANT.set(tenant)
            async for message in inner_stream(request, context):
                yield message

        return handler._replace(unary_stream=stream)
    inner = handler.unary_unary

    async def unary(request, context):
        CURRENT_TENANT.set(tenant)
        return await inner(request, context)

    return handler._replace(unary_unary=unary)
