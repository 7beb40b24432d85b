"""grpc.health.v1.Health, with Watch streams that end when the daemon drains.

grpc_health's own aio HealthServicer keeps every Watch stream open until
its client leaves, through a drain too: one watcher (gRPC client-side
health checking, a proxy) would hold the server's stop for the whole grace
period. Here `enter_graceful_shutdown` sets every service NOT_SERVING, each
watcher is sent that and its stream ends (OK), and a Watch that starts
during the drain gets NOT_SERVING and the end at once. Check and the rest
of Watch behave as grpc_health's: NOT_FOUND for a service never set,
SERVICE_UNKNOWN to a watcher of one.
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ServingStatus = health_pb2.HealthCheckResponse.ServingStatus


class HealthService(health_pb2_grpc.HealthServicer):
    def __init__(self) -> None:
        self._statuses: dict[str, int] = {"": health_pb2.HealthCheckResponse.SERVING}
        self._draining = False
        # Set, and replaced by a fresh one, on every change: watchers wait on it.
        self._changed = asyncio.Event()

    async def Check(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext):
        status = self._statuses.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext) -> None:
        sent = None
        while True:
            changed = self._changed
            status = self._statuses.get(request.service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN)
            if status != sent:
                await context.write(health_pb2.HealthCheckResponse(status=status))
                sent = status
                continue  # it may have changed while the write waited
            if self._draining:
                return
            await changed.wait()

    async def set(self, service: str, status: ServingStatus) -> None:
        """Set a service's status; ignored once draining."""
        if self._draining:
            return
        self._statuses[service] = status
        self._publish()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good; every Watch stream ends once it has said so."""
        if self._draining:
            return
        self._draining = True
        for service in self._statuses:
            self._statuses[service] = health_pb2.HealthCheckResponse.NOT_SERVING
        self._publish()

    def _publish(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()
