"""Daemon lifecycle: start every part in order, drain and stop in reverse.

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
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd import __version__, arena_protocol
from kvd.clock import Clock, MonotonicClock
from kvd.config import Config, HostConfig, ServerConfig, TenantSettings, load_tenants, parse_address
from kvd.core.engine import Engine, EngineLimits
from kvd.core.events import EventLog
from kvd.core.policy import DiskPolicies
from kvd.core.quota import TenantQuota
from kvd.core.slot_pool import class_sizes
from kvd.errors import ConfigError, StartupFailed
from kvd.metrics import ArenaCollector, ClusterCollector, DeviceCollector, DiskIoMetrics, make_registry
from kvd.server.arena_socket import ArenaSocket
from kvd.server.cluster_blocks import ClusterBlocks
from kvd.server.auth import FAILURE_REASONS, AuthInterceptor, TokenTable
from kvd.server.drain import RpcTracker, describe, stop_server
from kvd.server.health import HealthService
from kvd.supervisor import Supervisor
from kvd.server.registration import add_kvd_service
from kvd.server.service import KvdService
from kvd.tiers.host import ArenaLayout, HostArena, shmem_huge_page_bytes

log = logging.getLogger("kvd.daemon")

SERVICE_NAME = "kvd.v1.Kvd"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, and extras."""

    _standard = set(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in self._standard:
                entry[key] = value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def sd_notify(state: str) -> bool:
    """Send a systemd notification if NOTIFY_SOCKET is set; True if sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True


def watchdog_interval_s(environ: dict[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 keep-alives: half of systemd's WATCHDOG_USEC
    (sd_watchdog_enabled's rule), or None when no watchdog watches this process."""
    environ = os.environ if environ is None else environ
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2_000_000


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
        self.tokens: TokenTable | None = None
        self.arena_socket: ArenaSocket | None = None
        self.cluster = None  # kvd.cluster.node.ClusterNode with [cluster] etcd_endpoints
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
        tls = _tls_credentials(config.server)
        state_dir = Path(config.state_dir)
        try:
            state_dir.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise OSError(f"cannot create state_dir {state_dir}: {error.strerror or error}") from None
        layout = ArenaLayout.from_capacity(config.host.capacity_bytes, config.host.slot_bytes)
        recovery = await self._open_tiers(layout)
        self.engine = _build_engine(config, layout, self.host_classes, self.disk_plane, tenants)
        if self.arena.per_tenant:
            pool, arena = self.engine.host.pool, self.arena
            self.engine.claim_host_slot = lambda slot, tenant: arena.claim_range(
                pool.offset_of(slot), pool.slot_bytes_of(slot), tenant)
        if self.disk_plane is not None:
            indexed = await self.disk_plane.recover(self.engine, recovery)
            log.info("disk tier recovered", extra={"indexed_blocks": indexed})
            self.disk_plane.start(self.supervisor)
        registry, rpc_metrics = make_registry(self.engine)
        if self.disk_plane is not None:
            schedule = self.disk_plane.io.schedule
            disk_metrics = DiskIoMetrics(registry, self.disk_plane.io.queued, self.disk_plane.io_bytes,
                                         self.disk_plane.drive_states, self.disk_plane.recovery_lost_blocks,
                                         lambda: schedule.counters.slack_writes,
                                         lambda: self.disk_plane.counters.chunks, self.disk_plane.totals,
                                         self.disk_plane.oldest_unwritten_s)
            self.disk_plane.io.on_job = disk_metrics.observe_job
        self._prepare_cluster()
        self._build_server(tenants, rpc_metrics)
        await self._listen(tls, rpc_metrics)
        arena, arena_socket = self.arena, self.arena_socket
        registry.register(ArenaCollector(lambda: arena_socket.handed_out if arena_socket else 0,
                                         lambda: arena.reassigned_slots, shmem_huge_page_bytes))
        if self.device_plane is not None:
            registry.register(DeviceCollector(self.device_plane.counters))
        _log_exposure(config, tenants)
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        self._join_cluster(registry)
        self._serve_metrics(registry)
        self._sweeper = self.supervisor.spawn(self._sweep_leases(), name="lease-sweeper")
        self._write_endpoints(state_dir)
        self._announce_ready(layout)

    def _prepare_cluster(self) -> None:
        """With etcd endpoints configured: the cluster node (the etcd client is imported only then)."""
        if not self.config.cluster.etcd_endpoints:
            return
        try:
            from kvd.cluster.node import ClusterNode
        except ImportError as error:
            raise ConfigError("cluster.etcd_endpoints",
                              f"the cluster needs the etcd client (pip install 'kvd[cluster]'): {error}") from None
        self.cluster = ClusterNode(self.config, self.engine, self.arena)

    def _join_cluster(self, registry) -> None:
        cluster = self.cluster
        if cluster is None:
            return
        config = self.config
        cluster.start(self.bound_tcp_port, config.disk.capacity_bytes * len(config.disk.directories),
                      self.supervisor.spawn)
        blocks = cluster.servicer.blocks
        registry.register(ClusterCollector(lambda: len(cluster.view), cluster.joined.is_set,
                                           lambda: cluster.membership.sessions, lambda: blocks.fetched_blocks,
                                           lambda: blocks.failed_fetches))

    async def _open_tiers(self, layout: ArenaLayout):
        """Create the host arena and open the disk tier (its recovery, if any, to index next)."""
        config = self.config
        # With tenants, every tenant's slots are in memory of its own (kvd.tiers.host).
        per_tenant = config.auth.mode == "token"
        self.host_classes = host_slot_classes(config.host, layout, per_tenant)
        granule = self.host_classes[-1]
        self.arena = HostArena(layout, prefault=config.host.prefault, huge_pages=config.host.huge_pages,
                               per_tenant=per_tenant, granule_bytes=granule)
        self.device_plane = _open_device_plane(config, self.arena)
        if not config.disk.directories:
            return None
        from kvd.planes.disk import DiskPlane

        sd_notify("STATUS=recovering the disk tier")
        self.disk_plane = DiskPlane(config.disk, self.arena)
        started = time.monotonic()
        recovery = await self.disk_plane.open()
        log.info(
            "disk tier opened",
            extra={"records": recovery.records, "blocks": recovery.block_count,
                   "truncated_bytes": recovery.truncated_bytes, "dropped": recovery.dropped.total,
                   "open_s": round(time.monotonic() - started, 3)},
        )
        return recovery

    def _build_server(self, tenants: list[TenantSettings], rpc_metrics) -> None:
        """The gRPC server with its interceptors, the kvd service and the health service."""
        config = self.config
        options = [
            ("grpc.max_receive_message_length", config.server.max_message_bytes),
            ("grpc.max_send_message_length", config.server.max_message_bytes),
            ("grpc.so_reuseport", 0),
        ]
        interceptors = [self.rpcs]  # first: it sees every call, refused ones too
        if config.auth.mode == "token":
            for reason in FAILURE_REASONS:
                rpc_metrics.auth_failures.labels(reason)  # exported at 0 from the start
            self.tokens = TokenTable(tenants)
            interceptors.append(
                AuthInterceptor(self.tokens, lambda reason: rpc_metrics.auth_failures.labels(reason).inc())
            )
        socket_path = config.unix_socket_path
        self.server = grpc.aio.server(options=options, maximum_concurrent_rpcs=config.server.max_concurrent_rpcs,
                                      interceptors=interceptors)
        self.service = KvdService(
            self.engine, self.arena, self.clock, rpc_metrics, config.server.max_message_bytes, self.disk_plane,
            max_subscribers=config.events.max_subscribers, auth_required=config.auth.mode == "token",
            arena_socket=str(arena_protocol.socket_path(socket_path.resolve())) if socket_path else "",
        )
        self.service.device_plane = self.device_plane
        self.service.on_bug = self.supervisor.fail
        # Bytes that are not a valid request message get INVALID_ARGUMENT, not UNKNOWN.
        add_kvd_service(self.service, self.server,
                        lambda method: rpc_metrics.total.labels(method, "INVALID_ARGUMENT").inc())
        if self.cluster is not None:
            self.cluster.register(self.server)
            self.service.cluster = self.cluster
            blocks = ClusterBlocks(self.service, self.cluster, config.cluster.fetch_timeout_s)
            self.cluster.servicer.blocks = blocks
            if config.cluster.fetch_on_get:
                self.service.cluster_blocks = blocks
        self.health = HealthService()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)

    async def _listen(self, tls, rpc_metrics) -> None:
        """Bind the listeners (owner-only Unix socket, TCP with TLS if set), start serving, open the arena socket."""
        config = self.config
        socket_path = config.unix_socket_path
        if socket_path is not None:
            socket_path.parent.mkdir(parents=True, exist_ok=True)
            socket_path.unlink(missing_ok=True)
            # The socket inherits the umask: make it owner-only while it is created.
            previous_umask = os.umask(0o177)
            try:
                _listen(lambda: self.server.add_insecure_port(f"unix:{socket_path.resolve()}"),
                        "server.unix_socket", str(socket_path))
            finally:
                os.umask(previous_umask)
        if config.server.tcp_address:
            address = config.server.tcp_address
            self.bound_tcp_port = _listen(
                (lambda: self.server.add_secure_port(address, tls)) if tls is not None
                else (lambda: self.server.add_insecure_port(address)),
                "server.tcp_address", address)
        await self.server.start()
        if socket_path is None:
            return
        self.arena_socket = ArenaSocket(
            arena_protocol.socket_path(socket_path.resolve()), self.arena, self.tokens,
            lambda reason: rpc_metrics.auth_failures.labels(reason).inc(),
            request_timeout_s=config.server.arena_request_timeout_s,
            on_deposit=self.device_plane.deposit if self.device_plane is not None else None,
        )
        self.arena_socket.start(self.supervisor.spawn)
        for path in (socket_path, self.arena_socket.path):
            os.chmod(path, 0o600)
            if config.server.unix_socket_group:
                _give_socket_to_group(path, config.server.unix_socket_group)

    def _serve_metrics(self, registry) -> None:
        address = self.config.metrics.address
        if not address:
            return
        from prometheus_client import start_http_server

        host, port = parse_address("metrics.address", address)
        try:
            self._metrics_server, _thread = start_http_server(port, addr=host, registry=registry)
        except OSError as error:
            raise OSError(f"cannot serve metrics on {address} (metrics.address): "
                          f"{error.strerror or error}") from None
        self.bound_metrics_port = self._metrics_server.server_port

    def _announce_ready(self, layout: ArenaLayout) -> None:
        socket_path = self.config.unix_socket_path
        log.info(
            "kvd ready",
            extra={
                "version": __version__,
                "unix_socket": str(socket_path) if socket_path else "",
                "tcp_port": self.bound_tcp_port or 0,
                "metrics_port": getattr(self, "bound_metrics_port", 0),
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
            self._watchdog = self.supervisor.spawn(self._keep_alive(interval_s), name="watchdog")

    def _write_endpoints(self, state_dir: Path) -> None:
        """Record where this instance listens, for `kvd status` and tests."""
        endpoints = {
            "pid": os.getpid(),
            "unix_socket": str(self.config.unix_socket_path.resolve()) if self.config.unix_socket_path else "",
            "tcp_port": self.bound_tcp_port or 0,
            "metrics_port": getattr(self, "bound_metrics_port", 0),
            "arena_socket": str(self.arena_socket.path) if self.arena_socket else "",
        }
        temporary = state_dir / "endpoints.json.tmp"
        temporary.write_text(json.dumps(endpoints))
        temporary.replace(state_dir / "endpoints.json")

    async def _keep_alive(self, interval_s: float) -> None:
        while True:
            sd_notify("WATCHDOG=1")
            await asyncio.sleep(interval_s)

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


def _listen(add_port, setting: str, address: str) -> int:
    """Add a gRPC listener; OSError naming the setting when it cannot be bound
    (grpc raises RuntimeError, or returns port 0)."""
    try:
        port = add_port()
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address} ({setting}): the address is in use or not available")
    return port


def _open_device_plane(config: Config, arena: HostArena):
    """The device plane over the arena ([device] kind), or None when it is off."""
    if config.device.kind == "off":
        return None
    from kvd.device import DeviceError, open_device
    from kvd.planes.device import DevicePlane
    from kvd.planes.device_tier import DeviceTier

    settings = config.device
    try:
        devices = _open_devices(settings.kind, settings.index, settings.count, open_device)
        tier = DeviceTier(devices[0], settings.tier_bytes, settings.tier_slot_bytes or config.host.slot_bytes) \
            if settings.tier_bytes else None
        plane = DevicePlane(devices, arena.address_at(0), arena.layout.arena_bytes, settings.max_pools,
                            settings.pool_lease_ms, settings.flag_timeout_ms, tier=tier)
    except DeviceError as error:
        raise StartupFailed(f"[device] kind = {settings.kind!r}, index {settings.index}, count {settings.count}: "
                            f"{error}") from None
    for device in devices:
        log.info("device plane on", extra={"device": f"{device.kind}:{device.index}", "device_uuid": device.uuid,
                                           "tier_slots": tier.slot_count if tier and device is devices[0] else 0})
    return plane


def _open_devices(kind: str, index: int, count: int, open_device) -> list:
    """Devices index .. index + count - 1 of `kind`; count 0: from index to the last the driver shows."""
    from kvd.device import NoDevice

    devices = []
    while count == 0 or len(devices) < count:
        try:
            devices.append(open_device(kind, index + len(devices)))
        except NoDevice:
            if count or not devices:  # (count 0: the first index past the last GPU ends the list)
                raise
            break
    return devices


def _build_engine(config: Config, layout: ArenaLayout, host_classes: tuple[int, ...], disk_plane,
                  tenants: list[TenantSettings]) -> Engine:
    return Engine(
        host_slot_count=layout.slot_count,
        host_slot_bytes=layout.slot_bytes,
        host_min_slot_bytes=host_classes[-1],
        policy=config.host.policy,
        high_watermark=config.host.high_watermark,
        low_watermark=config.host.low_watermark,
        limits=EngineLimits(
            lease_ms_default=config.leases.default_ms,
            lease_ms_max=config.leases.max_ms,
            max_leases=config.leases.max_leases,
            max_pins_per_client=config.leases.max_pins_per_client,
        ),
        disk_slot_count=disk_plane.slot_count if disk_plane else 0,
        disk_slot_bytes=config.disk.slot_bytes,
        disk_min_slot_bytes=disk_plane.config.class_bytes[-1] if disk_plane else 0,
        events=EventLog(config.events.ring_events, config.events.ring_keys),
        disk_policies=DiskPolicies(
            eviction=config.disk.policy,
            admission_min_hits=config.disk.admission_min_hits,
            promotion=config.disk.promotion,
        ),
        tenant_quotas=[TenantQuota(tenant.name, tenant.host_bytes, tenant.disk_bytes) for tenant in tenants],
    )


def _tls_credentials(server: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS (mutual with a client CA) for the TCP listener, or None; ConfigError naming an unreadable file."""
    if not server.tls_cert_file:
        return None

    def read(name: str, path: str) -> bytes:
        try:
            return Path(path).read_bytes()
        except OSError as error:
            raise ConfigError(f"server.{name}", f"cannot read {path}: {error.strerror}") from None

    chain = read("tls_cert_file", server.tls_cert_file)
    key = read("tls_key_file", server.tls_key_file)
    client_ca = read("tls_client_ca_file", server.tls_client_ca_file) if server.tls_client_ca_file else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def host_slot_classes(host: HostConfig, layout: ArenaLayout, per_tenant: bool) -> tuple[int, ...]:
    """The host tier's slot sizes, largest (the arena's slot, a page) first.

    With tenants the arena can take one memory mapping per smallest slot
    (kvd.tiers.host.HostArena.claim_range), so the smallest classes are
    dropped, with a warning, until the kernel's vm.max_map_count holds
    that many; if even one slot size does not fit, the start is refused."""
    sizes = class_sizes(layout.slot_bytes, min(host.min_slot_bytes, layout.slot_bytes))
    if not per_tenant:
        return sizes
    limit = _max_map_count()
    kept = sizes
    while len(kept) > 1 and layout.arena_bytes // kept[-1] + MAP_COUNT_HEADROOM > limit:
        kept = kept[:-1]
    if kept != sizes:
        log.warning("with tenants, the smallest host slots would need more memory mappings than "
                    "vm.max_map_count allows; using larger ones", extra={
                        "min_slot_bytes": kept[-1], "configured_min_slot_bytes": sizes[-1], "max_map_count": limit})
    slot_count = layout.slot_count
    if slot_count + MAP_COUNT_HEADROOM > limit:
        raise ConfigError(
            "host.slot_bytes",
            f"with tenants (auth.mode = \"token\") the arena can need one memory mapping per slot: "
            f"{slot_count} slots and the kernel allows {limit} mappings (vm.max_map_count); "
            f"use larger slots or raise vm.max_map_count above {slot_count + MAP_COUNT_HEADROOM}",
        )
    return kept


# Memory mappings of the interpreter, the libraries and the I/O engine, beside the arena's.
MAP_COUNT_HEADROOM = 4096


def _max_map_count() -> int:
    try:
        return int(Path("/proc/sys/vm/max_map_count").read_text())
    except (OSError, ValueError):
        return 1 << 62


def _give_socket_to_group(path: Path, group: str) -> None:
    """Mode 0660 and group `group` (a name or a number) for the unix socket."""
    import grp

    try:
        gid = int(group) if group.isdigit() else grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError("server.unix_socket_group", f"no group named {group!r}") from None
    try:
        os.chown(path, -1, gid)
    except PermissionError:
        raise ConfigError(
            "server.unix_socket_group", f"cannot give the socket to group {group!r}: kvd's user must be a member of it"
        ) from None
    os.chmod(path, 0o660)


def _log_exposure(config: Config, tenants: list[TenantSettings]) -> None:
    """One line on who may call kvd, and a warning where that is anyone on a network."""
    server = config.server
    tls = "mutual" if server.tls_client_ca_file else ("on" if server.tls_cert_file else "off")
    log.info(
        "access",
        extra={
            "auth_mode": config.auth.mode,
            "tenants": ",".join(tenant.name for tenant in tenants),
            "admins": ",".join(tenant.name for tenant in tenants if tenant.admin),
            "tcp_tls": tls if server.tcp_address else "",
            "unix_socket_group": server.unix_socket_group,
        },
    )
    if not server.tcp_address:
        return
    host, _ = parse_address("server.tcp_address", server.tcp_address)
    if host in ("127.0.0.1", "::1", "localhost"):
        return
    if config.auth.mode == "none":
        log.warning(
            "TCP listener is not on loopback and auth.mode is none: whoever reaches it can read and write every block",
            extra={"tcp_address": server.tcp_address},
        )
    elif not server.tls_cert_file:
        log.warning(
            "TCP listener is not on loopback and has no TLS: bearer tokens and blocks cross the network in clear",
            extra={"tcp_address": server.tcp_address},
        )


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
