"""The daemon's edge: the gRPC server with its interceptors and services (kvd, health, the
cluster's), its listeners (a unix socket, owner-only or given to a group; TCP, with TLS if
configured), the arena socket beside the unix socket, endpoints.json that says where they all
are, and the access line that says who may call.

kvd.daemon.lifecycle builds and starts them in order at start and drains them at stop.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2_grpc

from kvd import arena_protocol
from kvd.clock import Clock
from kvd.cluster.peer_blocks import PeerBlocks
from kvd.config import Config, ServerConfig, TenantSettings, parse_address
from kvd.core.engine import Engine
from kvd.errors import ConfigError
from kvd.planes.cluster_fetch import ClusterFetch
from kvd.server.arena_socket import ArenaSocket
from kvd.server.auth import FAILURE_REASONS, AuthInterceptor, TokenTable
from kvd.server.drain import RpcTracker
from kvd.server.health import HealthService
from kvd.server.registration import add_kvd_service
from kvd.server.service import KvdService
from kvd.tiers.host import HostArena

if TYPE_CHECKING:
    from kvd.cluster.node import ClusterNode
    from kvd.metrics import RpcMetrics
    from kvd.planes.device import DevicePlane
    from kvd.planes.disk import DiskPlane

log = logging.getLogger("kvd.daemon")

SERVICE_NAME = "kvd.v1.Kvd"


def tls_credentials(server: ServerConfig) -> grpc.ServerCredentials | None:
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


def token_table(tenants: list[TenantSettings], rpc_metrics: RpcMetrics) -> TokenTable:
    """The tenants' bearer tokens (auth.mode = "token"), each reason for a refusal exported at 0 from the start."""
    for reason in FAILURE_REASONS:
        rpc_metrics.auth_failures.labels(reason)
    return TokenTable(tenants)


def grpc_server(server: ServerConfig, rpcs: RpcTracker, tokens: TokenTable | None,
                rpc_metrics: RpcMetrics) -> grpc.aio.Server:
    """The gRPC server, with its limits and interceptors: the drain's tracker first (it sees every call,
    refused ones too), then, with tokens, authentication."""
    options = [
        ("grpc.max_receive_message_length", server.max_message_bytes),
        ("grpc.max_send_message_length", server.max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]
    interceptors = [rpcs]
    if tokens is not None:
        interceptors.append(AuthInterceptor(tokens, lambda reason: rpc_metrics.auth_failures.labels(reason).inc()))
    return grpc.aio.server(options=options, maximum_concurrent_rpcs=server.max_concurrent_rpcs,
                           interceptors=interceptors)


def kvd_service(config: Config, engine: Engine, arena: HostArena, clock: Clock, rpc_metrics: RpcMetrics, *,
                disk_plane: DiskPlane | None, device_plane: DevicePlane | None, on_bug) -> KvdService:
    """The kvd service over the engine and the planes; a bug it meets goes to `on_bug` (the supervisor)."""
    socket_path = config.unix_socket_path
    service = KvdService(
        engine, arena, clock, rpc_metrics, config.server.max_message_bytes, disk_plane,
        max_subscribers=config.events.max_subscribers, auth_required=config.auth.mode == "token",
        arena_socket=str(arena_protocol.socket_path(socket_path.resolve())) if socket_path else "",
    )
    service.device_plane = device_plane
    service.keep_disk_loads_in_host = config.device.disk_loads_keep_host_copy
    service.on_bug = on_bug
    if device_plane is not None:
        device_plane.on_bug = on_bug
    return service


def serve_kvd(server: grpc.aio.Server, service: KvdService, rpc_metrics: RpcMetrics) -> None:
    """The kvd service on the server."""
    # Bytes that are not a valid request message get INVALID_ARGUMENT, not UNKNOWN.
    add_kvd_service(service, server, lambda method: rpc_metrics.total.labels(method, "INVALID_ARGUMENT").inc())


def add_health(server: grpc.aio.Server) -> HealthService:
    health = HealthService()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    return health


def new_cluster_node(config: Config, engine: Engine, arena: HostArena) -> ClusterNode | None:
    """With etcd endpoints configured: the cluster node (the etcd client is imported only then)."""
    if not config.cluster.etcd_endpoints:
        return None
    try:
        from kvd.cluster.node import ClusterNode
    except ImportError as error:
        raise ConfigError("cluster.etcd_endpoints",
                          f"the cluster needs the etcd client (pip install 'kvd[cluster]'): {error}") from None
    return ClusterNode(config, engine, arena)


def add_cluster(cluster: ClusterNode, server: grpc.aio.Server, service: KvdService, config: Config) -> ClusterFetch:
    """The peers' service on the server, its block calls served by the kvd service; and the fetch
    plane, which Gets use on a miss with cluster.fetch_on_get (built either way: its counters are
    exported)."""
    cluster.register(server)
    service.cluster = cluster
    cluster.servicer.holder = service
    fetch = ClusterFetch(service.engine, service.arena, service.clock.now_ms, PeerBlocks(cluster),
                         config.cluster.fetch_timeout_s)
    fetch.on_bug = service.on_bug
    if config.cluster.fetch_on_get:
        service.cluster_fetch = fetch
    return fetch


async def listen(server: grpc.aio.Server, config: Config, tls: grpc.ServerCredentials | None) -> int | None:
    """Bind the listeners (owner-only unix socket, TCP with TLS if set) and start serving; the TCP port bound."""
    socket_path = config.unix_socket_path
    if socket_path is not None:
        socket_path.parent.mkdir(parents=True, exist_ok=True)
        socket_path.unlink(missing_ok=True)
        # The socket inherits the umask: make it owner-only while it is created.
        previous_umask = os.umask(0o177)
        try:
            _add_port(lambda: server.add_insecure_port(f"unix:{socket_path.resolve()}"),
                      "server.unix_socket", str(socket_path))
        finally:
            os.umask(previous_umask)
    tcp_port = None
    if config.server.tcp_address:
        address = config.server.tcp_address
        tcp_port = _add_port(
            (lambda: server.add_secure_port(address, tls)) if tls is not None
            else (lambda: server.add_insecure_port(address)),
            "server.tcp_address", address)
    await server.start()
    return tcp_port


def _add_port(add_port, setting: str, address: str) -> int:
    """Add a gRPC listener; OSError naming the setting when it cannot be bound
    (grpc raises RuntimeError, or returns port 0)."""
    try:
        port = add_port()
    except RuntimeError:
        port = 0
    if port == 0:
        raise OSError(f"cannot listen on {address} ({setting}): the address is in use or not available")
    return port


def new_arena_socket(config: Config, arena: HostArena, tokens: TokenTable | None, rpc_metrics: RpcMetrics,
                     device_plane: DevicePlane | None) -> ArenaSocket | None:
    """The arena socket next to the unix socket, not yet started; none without a unix socket."""
    socket_path = config.unix_socket_path
    if socket_path is None:
        return None
    return ArenaSocket(
        arena_protocol.socket_path(socket_path.resolve()), arena, tokens,
        lambda reason: rpc_metrics.auth_failures.labels(reason).inc(),
        request_timeout_s=config.server.arena_request_timeout_s,
        on_deposit=device_plane.deposit if device_plane is not None else None,
        on_ring=device_plane.ring_fd if device_plane is not None else None,
    )


def restrict_sockets(server: ServerConfig, paths: list[Path]) -> None:
    """Owner-only sockets, or given to server.unix_socket_group (mode 0660)."""
    for path in paths:
        os.chmod(path, 0o600)
        if server.unix_socket_group:
            _give_socket_to_group(path, server.unix_socket_group)


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


def write_endpoints(state_dir: Path, config: Config, tcp_port: int | None, metrics_port: int,
                    arena_socket: ArenaSocket | None) -> None:
    """Record where this instance listens, for `kvd status` and tests."""
    endpoints = {
        "pid": os.getpid(),
        "unix_socket": str(config.unix_socket_path.resolve()) if config.unix_socket_path else "",
        "tcp_port": tcp_port or 0,
        "metrics_port": metrics_port,
        "arena_socket": str(arena_socket.path) if arena_socket else "",
    }
    temporary = state_dir / "endpoints.json.tmp"
    temporary.write_text(json.dumps(endpoints))
    temporary.replace(state_dir / "endpoints.json")


def log_exposure(config: Config, tenants: list[TenantSettings]) -> None:
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
