"""Stopping the gRPC server: knowing what still runs, and not waiting for calls nobody will serve.

grpc.aio's `server.stop(grace)` waits until every call gRPC holds has ended,
then cancels what is left once `grace` is over. On its own it has two faults:

* It says nothing of what it waited for. `RpcTracker`, the server's first
  interceptor, knows every call gRPC handed to kvd, by method, from the
  moment it is dispatched (before its request message is read) until its
  handler has answered. `stop_server` logs one warning naming the methods
  still running, and how many of each, when the grace period runs out.

* gRPC can strand a call that arrives just as the shutdown starts. In
  grpcio 1.85's core (src/core/server/server.cc), a new call is checked
  against `ShutdownCalled()` in `Server::CallData::PublishNewRpc` and only
  then queued by `RealRequestMatcher::MatchOrQueue`; a shutdown that runs in
  between has already failed every requested call and zombified the pending
  list, so the call is put on the pending list after that and stays there,
  never dispatched and never cancelled, until the next
  `MaybeFinishShutdown` (a channel or listener going away) or the
  `cancel_all_calls` at the end of the grace period. With one client
  connection nothing else goes away: the drain takes the whole grace period
  and the client waits for its deadline (DEADLINE_EXCEEDED). No kvd handler
  ever sees such a call, so nothing in kvd could answer it: once every call
  gRPC did hand over has ended, and nothing new came for
  `STRANDED_SETTLE_S`, `stop_server` cancels whatever gRPC still holds.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

log = logging.getLogger(__name__)

# Quiet time (no call running, none dispatched or ended) after which the
# calls gRPC still holds are taken for stranded and cancelled. A dispatched
# call reaches the tracker within two turns of the event loop.
STRANDED_SETTLE_S = 0.2
# How often the drain looks at the calls still running.
POLL_S = 0.05
# gRPC's own cancellation comes this long after kvd's, which logs first.
BACKSTOP_S = 1.0


class RpcTracker(grpc.aio.ServerInterceptor):
    """Every call gRPC has handed to the service and not yet finished, by method.

    A call is counted from its dispatch, before its request is read, until
    the task grpc.aio runs it in has ended (its status sent), whatever
    happens in between: a request that never arrives, an aborted handler,
    a cancellation. Must be the server's first interceptor.
    """

    def __init__(self) -> None:
        self._calls: dict[asyncio.Task, str] = {}
        # time.monotonic() of the last dispatch or end.
        self.last_change = time.monotonic()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        task = asyncio.current_task()
        if task is not None and task not in self._calls:
            self._calls[task] = handler_call_details.method
            self.last_change = time.monotonic()
            task.add_done_callback(self._ended)
        return await continuation(handler_call_details)

    def _ended(self, task: asyncio.Task) -> None:
        self._calls.pop(task, None)
        self.last_change = time.monotonic()

    def running(self) -> dict[str, int]:
        """Calls running, by method ("kvd.v1.Kvd/Get"), most first."""
        counts = collections.Counter(method.lstrip("/") for method in self._calls.values())
        return dict(counts.most_common())


def describe(running: dict[str, int]) -> str:
    """"kvd.v1.Kvd/WatchEvents=2, kvd.v1.Kvd/Get=1" ("none" when empty)."""
    return ", ".join(f"{method}={count}" for method, count in running.items()) or "none"


async def stop_server(server: Any, grace_s: float, tracker: RpcTracker,
                      settle_s: float = STRANDED_SETTLE_S, poll_s: float = POLL_S) -> None:
    """`server.stop(grace_s)`, that logs what the grace period cut short and
    cancels calls gRPC stranded (see the module's docstring) once every
    call the service was handed has ended.

    `server` is a grpc.aio.Server; a second `server.stop(0)` meanwhile (the
    daemon's second signal) ends the wait at once.
    """
    started = time.monotonic()
    deadline = started + grace_s
    # kvd ends the grace period itself, to know what was still running.
    stopping = asyncio.ensure_future(server.stop(grace_s + BACKSTOP_S))
    try:
        while not stopping.done():
            now = time.monotonic()
            await asyncio.wait({stopping}, timeout=max(0.0, min(poll_s, deadline - now)))
            if stopping.done():
                break
            now = time.monotonic()
            running = tracker.running()
            if now >= deadline:
                if running:
                    total = sum(running.values())
                    log.warning(
                        "grace period of %gs over with %d RPCs still running (%s): cancelling them",
                        grace_s, total, describe(running),
                        extra={"grace_period_s": grace_s, "rpcs_running": total, "rpcs": describe(running)},
                    )
                await server.stop(0)
                break
            if not running and now - max(started, tracker.last_change) >= settle_s:
                log.info(
                    "every RPC handed to kvd has ended but gRPC has not stopped: cancelling what it still holds "
                    "(calls it never dispatched)",
                    extra={"waited_s": round(now - started, 3)},
                )
                await server.stop(0)
                break
        await stopping
    finally:
        if not stopping.done():
            # The drain itself was cancelled: leave nothing running.
            stopping.cancel()
