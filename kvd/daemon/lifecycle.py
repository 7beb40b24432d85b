"""Daemon lifecycle: start every part in order, drain and stop in reverse. The parts are built by
kvd.daemon.planes (arena, planes, engine), kvd.daemon.serving (gRPC server, listeners, arena
socket) and kvd.daemon.prometheus (collectors, metrics endpoint); this module holds their order,
the signals and the background tasks (lease sweeper, watchdog).

Start:  tenants file and TLS files read -> arena created (memfd files, one
        per tenant with auth.mode = "token") and pre-faulted -> engine ->
        gRPC listeners (unix socket 0600, or 0660 for
        server.unix_socket_group; TCP, with TLS if configured; auth.mode =
        "token": every Kvd call authenticated by kvd.server.auth) -> the
        arena socket next to the unix socket, same mode
        (kvd.server.arena_socket) -> health SERVING ->
        metrics endpoint -> lease sweeper -> READY logged (and sd_notify:
        READY=1 only once disk recovery is done and the listeners answer;
        then WATCHDOG=1 every half WATCHDOG_USEC while the event loop runs).
Stop (SIGTERM/SIGINT, or `Daemon.shutdown()`; idempotent):
        health NOT_SERVING (health Watch streams end) -> event streams end
        (UNAVAILABLE), starved Gets stop waiting for write-back -> the arena
        socket closes -> listeners stop accepting and in-flight RPCs get
        `grace_period_s` to finish (kvd.server.drain: one warning names the
        RPCs still running when it is over; calls gRPC holds but never
        dispatched are cancelled once every other one has ended) -> every
        lease ends -> metrics endpoint stops -> arena files closed and
        unmapped (clients keep what they mapped). A second signal during
        the drain cuts the grace period short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2

from kvd import __version__
from kvd.clock import Clock, MonotonicClock
from kvd.config import Config, TenantSettings, load_tenants
from kvd.core.engine import Engine
from kvd.daemon.logs import setup_logging
from kvd.daemon.planes import (build_engine, claim_slots_for_tenants, new_disk_plane, open_arena, open_device_plane,
                               open_disk_plane, recover_disk)
from kvd.daemon.prometheus import serve_metrics, watch_arena, watch_cluster, watch_disk_plane
from kvd.daemon.serving import (SERVICE_NAME, add_cluster, add_health, grpc_server, kvd_service, listen, log_exposure,
                                new_arena_socket, new_cluster_node, restrict_sockets, serve_kvd, tls_credentials,
                                token_table, write_endpoints)
from kvd.daemon.systemd import keep_alive, sd_notify, watchdog_interval_s
from kvd.errors import ConfigError, StartupFailed
from kvd.metrics import make_registry
from kvd.server.arena_socket import ArenaSocket
from kvd.server.auth import TokenTable
from kvd.server.drain import RpcTracker, describe, stop_server
from kvd.server.health import HealthService
from kvd.server.service import KvdService
from kvd.supervisor import Supervisor
from kvd.tiers.host import ArenaLayout, HostArena

log = logging.getLogger("kvd.daemon")


class Daemon:
    def __init__(self, config: Config, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        self.arena: HostArena | None = None
        self.engine: Engine | None = None
        self.disk_plane = None  # kvd.planes.disk.DiskPlane when a disk tier is configured
        self.device_plane = None  # kvd.planes.device.DevicePlane with [device] kind other than "off"
        self.server: grpc.aio.Server | None = None
        self.service: KvdService | None = None
        self.health: HealthService | None = None
        # Every call gRPC handed over and that has not ended (the drain's view).
        self.rpcs = RpcTracker()
        self._metrics_server = None
        self._sweeper: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        self._stop = asyncio.Event()
        self._stopped = False
        self.bound_tcp_port: int | None = None
        self.bound_metrics_port = 0
        self.tokens: TokenTable | None = None
        self.arena_socket: ArenaSocket | None = None
        self.cluster = None  # kvd.cluster.node.ClusterNode with [cluster] etcd_endpoints
        self.cluster_fetch = None  # and its kvd.planes.cluster_fetch.ClusterFetch
        # Long-lived tasks and threads: a failure of one stops the daemon with exit status 1.
        self.supervisor = Supervisor()
        self.supervisor.on_failure(self._background_failed)
        self.exit_status = 0

    def reload_tokens(self) -> None:
        """SIGHUP: re-read the tenants file and take its token digests (rotation without a restart).

        A file that cannot be read, or that changes more than tokens, is
        refused with an error in the log; the tokens in use stay.
        """
        if self.tokens is None:
            log.warning("SIGHUP ignored: auth.mode is not token")
            return
        try:
            tenants = load_tenants(self.config.auth.tenants_file)
        except ConfigError as error:
            log.error("tenants file not reloaded", extra={"reason": str(error)})
            return
        refusal = self.tokens.reload(tenants)
        if refusal is not None:
            log.error("tenants file not reloaded", extra={"reason": refusal})
            return
        log.info("tenant tokens reloaded", extra={"tenants": len(tenants)})

    async def start(self) -> None:
        config = self.config
        # Tenants and TLS files first: a mistake in them stops the start
        # before anything is created.
        tenants: list[TenantSettings] = load_tenants(config.auth.tenants_file) if config.auth.mode == "token" else []
        tls = tls_credentials(config.server)
        state_dir = Path(config.state_dir)
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise OSError(f"cannot create state_dir {state_dir}: {error.strerror or error}") from None
        layout = ArenaLayout.from_capacity(config.host.capacity_bytes, config.host.slot_bytes)
        recovery = await self._open_tiers(layout)
        self.engine = build_engine(config, layout, self.host_classes, self.disk_plane, tenants)
        if self.arena.per_tenant:
            claim_slots_for_tenants(self.engine, self.arena)
        if self.disk_plane is not None:
            await recover_disk(self.disk_plane, self.engine, recovery)
            self.disk_plane.start(self.supervisor)
        registry, rpc_metrics = make_registry(self.engine)
        if self.disk_plane is not None:
            watch_disk_plane(registry, self.disk_plane)
        self.cluster = new_cluster_node(config, self.engine, self.arena)
        self._build_server(tenants, rpc_metrics)
        await self._listen(tls, rpc_metrics)
        watch_arena(registry, self.arena, self.arena_socket, self.device_plane)
        log_exposure(config, tenants)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self._join_cluster(registry)
        if config.metrics.address:
            self._metrics_server = serve_metrics(config.metrics.address, registry)
            self.bound_metrics_port = self._metrics_server.server_port
        self._sweeper = self.supervisor.spawn(self._sweep_leases(), name="lease-sweeper")
        write_endpoints(state_dir, config, self.bound_tcp_port, self.bound_metrics_port, self.arena_socket)
        self._announce_ready(layout)

    async def _open_tiers(self, layout: ArenaLayout):
        """Create the host arena and open the disk tier (its recovery, if any, to index next)."""
        config = self.config
        self.arena, self.host_classes = open_arena(config, layout)
        self.device_plane = open_device_plane(config, self.arena)
        self.disk_plane = new_disk_plane(config, self.arena)
        if self.disk_plane is None:
            return None
        return await open_disk_plane(self.disk_plane)

    def _build_server(self, tenants: list[TenantSettings], rpc_metrics) -> None:
        """The gRPC server with its interceptors, the kvd service, the cluster's and the health service."""
        config = self.config
        if config.auth.mode == "token":
            self.tokens = token_table(tenants, rpc_metrics)
        self.server = grpc_server(config.server, self.rpcs, self.tokens, rpc_metrics)
        self.service = kvd_service(config, self.engine, self.arena, self.clock, rpc_metrics,
                                   disk_plane=self.disk_plane, device_plane=self.device_plane,
                                   on_bug=self.supervisor.fail)
        serve_kvd(self.server, self.service, rpc_metrics)
        if self.cluster is not None:
            self.cluster_fetch = add_cluster(self.cluster, self.server, self.service, config)
        self.health = add_health(self.server)

    async def _listen(self, tls, rpc_metrics) -> None:
        """Bind the listeners and start serving, then open the arena socket; both sockets get the same mode."""
        config = self.config
        self.bound_tcp_port = await listen(self.server, config, tls)
        self.arena_socket = new_arena_socket(config, self.arena, self.tokens, rpc_metrics, self.device_plane)
        if self.arena_socket is None:
            return
        self.arena_socket.start(self.supervisor.spawn)
        restrict_sockets(config.server, [config.unix_socket_path, self.arena_socket.path])

    def _join_cluster(self, registry) -> None:
        cluster = self.cluster
        if cluster is None:
            return
        config = self.config
        cluster.start(self.bound_tcp_port, config.disk.capacity_bytes * len(config.disk.directories),
                      self.supervisor.spawn)
        watch_cluster(registry, cluster, self.cluster_fetch)

    def _announce_ready(self, layout: ArenaLayout) -> None:
        socket_path = self.config.unix_socket_path
        log.info(
            "kvd ready",
            extra={
                "version": __version__,
                "unix_socket": str(socket_path) if socket_path else "",
                "tcp_port": self.bound_tcp_port or 0,
                "metrics_port": self.bound_metrics_port,
                "per_tenant_arena": self.arena.per_tenant,
                "host_slots": layout.slot_count,
                "host_slot_bytes": layout.slot_bytes,
            },
        )
        sd_notify("READY=1\nSTATUS=serving")
        interval_s = watchdog_interval_s()
        if interval_s is not None:
            # Sent from the event loop, so a loop that stops turning (a
            # blocking call, a deadlock) stops the keep-alives and systemd
            # restarts the daemon. They go on through the drain.
            self._watchdog = self.supervisor.spawn(keep_alive(interval_s), name="watchdog")

    async def _sweep_leases(self) -> None:
        interval_s = self.config.leases.sweep_interval_ms / 1000.0
        while True:
            await asyncio.sleep(interval_s)
            expired = self.engine.expire(self.clock.now_ms())
            if expired:
                log.info("leases expired", extra={"count": expired})
            if self.device_plane is not None:
                await self.device_plane.sweep(self.clock.now_ms())

    def _background_failed(self, what: str, error: BaseException) -> None:
        """A supervised task or thread failed (logged by the supervisor): NOT_SERVING, then stop."""
        self.exit_status = 1
        if self.health is not None:
            asyncio.get_running_loop().create_task(self.health.enter_graceful_shutdown())
        self._stop.set()

    def request_stop(self) -> None:
        if self._stop.is_set() and self.server is not None:
            # A second signal during the drain: stop waiting for in-flight RPCs.
            running = self.rpcs.running()
            log.warning("second stop signal: cancelling in-flight requests (%s)", describe(running),
                        extra={"rpcs_running": sum(running.values()), "rpcs": describe(running)})
            asyncio.get_running_loop().create_task(self.server.stop(0))
        self._stop.set()

    async def wait(self) -> None:
        await self._stop.wait()

    async def shutdown(self) -> None:
        """Drain and stop; safe to call more than once. The tiers are synced and
        closed whatever the drain met (finally)."""
        if self._stopped:
            return
        self._stopped = True
        started = time.monotonic()
        sd_notify("STOPPING=1")
        log.info("draining", extra={"grace_period_s": self.config.server.grace_period_s})
        try:
            await self._drain()
        finally:
            leases = await self._close_planes(started)
            self._release_files()
            await _cancelled(self._watchdog)
        log.info(
            "stopped",
            extra={"leases_closed": leases, "drain_s": round(time.monotonic() - started, 3),
                   "exit_status": self.exit_status},
        )

    async def _drain(self) -> None:
        """Leave the cluster, end the streams, let in-flight RPCs finish, stop the sweeper."""
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        if self.cluster is not None:
            # Leave first, so that peers stop sending work here during the drain.
            await self.cluster.close()
        if self.service is not None:
            # Event streams never finish on their own, and starved Gets
            # would wait for write-back: end them now rather than at the end
            # of the grace period.
            self.service.start_draining()
        if self.arena_socket is not None:
            await self.arena_socket.close()
        if self.server is not None:
            running = self.rpcs.running()
            log.info("waiting for in-flight RPCs", extra={"rpcs_running": sum(running.values()),
                                                          "rpcs": describe(running)})
            await stop_server(self.server, self.config.server.grace_period_s, self.rpcs)
        await _cancelled(self._sweeper)

    async def _close_planes(self, started: float) -> int:
        """Close the device plane, every lease, then the disk plane (queued writes get what is
        left of the grace period; then sync and close); the leases closed."""
        leases = 0
        try:
            if self.device_plane is not None:
                await self.device_plane.close()  # every pool's stream drained before the arena goes
            leases = self.engine.close_all_leases() if self.engine is not None else 0
        finally:
            if self.disk_plane is not None:
                remaining_s = max(0.0, self.config.server.grace_period_s - (time.monotonic() - started))
                await self.disk_plane.close(remaining_s)
        return leases

    def _release_files(self) -> None:
        """The metrics server, the arena, the socket and endpoints.json."""
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
        if self.arena is not None:
            self.arena.close()
        socket_path = self.config.unix_socket_path
        # A start that failed may have left no socket, or a state_dir that is not a directory.
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            if socket_path is not None:
                socket_path.unlink()
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            (Path(self.config.state_dir) / "endpoints.json").unlink()


async def _cancelled(task: asyncio.Task | None) -> None:
    """Cancel a background task of the daemon and wait until it has ended (a failure
    of its own was reported by the supervisor already)."""
    if task is None:
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _serve(config: Config) -> int:
    daemon = Daemon(config)
    loop = asyncio.get_running_loop()
    handled = (signal.SIGTERM, signal.SIGINT)
    for signum in handled:
        loop.add_signal_handler(signum, daemon.request_stop)
    loop.add_signal_handler(signal.SIGHUP, daemon.reload_tokens)
    try:
        try:
            await daemon.start()
        except OSError as error:
            # What the system refused at start (a port in use, a directory
            # that cannot be created, ...): one line and exit 2, not a traceback.
            raise StartupFailed(_describe_os_error(error)) from None
        await daemon.wait()
    finally:
        await daemon.shutdown()
        for signum in (*handled, signal.SIGHUP):
            loop.remove_signal_handler(signum)
    return daemon.exit_status


def _describe_os_error(error: OSError) -> str:
    """An OSError as one line: what failed, on which file, and why."""
    if error.filename is not None and error.strerror:
        return f"{error.strerror}: {error.filename}"
    return str(error) or type(error).__name__


def serve(config: Config) -> int:
    """Run the daemon on uvloop until SIGTERM or SIGINT (0), or until a supervised task
    or thread fails (1: kvd.supervisor)."""
    import uvloop

    setup_logging(config.log.level, config.log.format)
    return uvloop.run(_serve(config))
