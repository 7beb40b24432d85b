"""How every handler runs: measured, its operating errors mapped to a gRPC status, a broken
invariant handed to the daemon's supervisor (kvd.server.service's handlers wear these)."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvd.errors import KvdError, NotDurable
from kvd.invariants import InvariantError
from kvd.metrics import RpcMetrics
from kvd.server import convert
log = logging.getLogger("kvd.server.service")

Handler = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Any]]
StreamHandler = Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[Any]]


@contextlib.asynccontextmanager
async def _measured(metrics: RpcMetrics, method: str, context: grpc.aio.ServicerContext,
                    on_bug: Callable[[str, BaseException], None] | None = None) -> AsyncIterator[None]:
    """Measure one RPC and map operating errors to their gRPC status. A broken invariant
    is a bug: the caller gets INTERNAL, and `on_bug` (the daemon's supervisor) stops kvd."""
    metrics.in_flight.inc()
    started = time.perf_counter()
    code = "OK"
    try:
        yield
    except KvdError as error:
        code = error.code
        if isinstance(error, NotDurable):
            context.set_trailing_metadata(error.trailers())
        await context.abort(convert.status_of(error), error.message)
    except grpc.aio.AbortError:
        raise
    except InvariantError as error:
        code = "INTERNAL"
        if on_bug is None:
            log.exception("invariant broken in %s", method)
        else:
            on_bug(f"the {method} handler", error)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; kvd stops (see its log)")
    except Exception:
        code = "INTERNAL"
        log.exception("internal error in %s", method)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method}; see the daemon log")
    finally:
        metrics.in_flight.dec()
        metrics.duration.labels(method).observe(time.perf_counter() - started)
        metrics.total.labels(method, code).inc()


def rpc(method: str) -> Callable[[Handler], Handler]:
    """A unary handler, measured, with operating errors mapped to their status."""

    def decorate(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
            async with _measured(self.metrics, method, context, self.on_bug):
                self._resolve_tenant_ids(request)
                return await handler(self, request, context)

        return wrapper

    return decorate


def stream_rpc(method: str) -> Callable[[StreamHandler], StreamHandler]:
    """The same for a server-streaming handler (an async generator)."""

    def decorate(handler: StreamHandler) -> StreamHandler:
        @functools.wraps(handler)
        async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with _measured(self.metrics, method, context, self.on_bug):
                self._resolve_tenant_ids(request)
                async for message in handler(self, request, context):
                    yield message

        return wrapper

    return decorate
