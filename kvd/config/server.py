"""The serving side's settings: [server] (listeners, TLS, limits), [metrics], [auth],
[leases], [events] and [log], with their checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.config.values import parse_address, positive
from kvd.errors import ConfigError


@dataclass(slots=True)
class ServerConfig:
    # Unix socket path; relative paths are under state_dir. "" disables it.
    unix_socket: str = "kvd.sock"
    # host:port for TCP; loopback by default. "" disables TCP.
    tcp_address: str = "127.0.0.1:50051"
    max_message_bytes: int = 64 << 20
    max_concurrent_rpcs: int = 256
    grace_period_s: float = 10.0
    # How long the arena socket waits for a connected client's request
    # before it drops the connection (a stalled client holds nobody up).
    arena_request_timeout_s: float = 2.0
    # Group (a name or a number) allowed to use the unix socket: it is then
    # mode 0660 and owned by that group. "": mode 0600, its owner only.
    unix_socket_group: str = ""
    # TLS on the TCP listener: PEM certificate chain and private key files,
    # both or neither. The unix socket never uses TLS.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    # With TLS: a PEM bundle of the CAs that client certificates must chain
    # to. Set, TLS is mutual: a client without a valid certificate is refused.
    tls_client_ca_file: str = ""


@dataclass(slots=True)
class MetricsConfig:
    # host:port of the Prometheus endpoint; "" disables it.
    address: str = "127.0.0.1:9464"


@dataclass(slots=True)
class AuthConfig:
    # "none": every client may do everything (whoever can open the unix
    # socket or reach the TCP port); "token": every call carries a tenant's
    # bearer token, and tenants see only their own namespaces and blocks.
    mode: str = "none"
    # With mode = "token": the TOML or JSON (*.json) file that defines the
    # tenants: name, token_sha256 or token_env, namespaces, quotas, admin.
    tenants_file: str = ""


@dataclass(slots=True)
class LeaseConfig:
    default_ms: int = 30_000
    max_ms: int = 600_000
    max_leases: int = 65_536
    # Blocks one client (one client_id) may pin through its open leases at
    # once: Gets and Reserves past it get RESOURCE_EXHAUSTED. The default
    # is above most arenas' slot counts, so it binds only where set: set it
    # to a share of the host slots to keep one client from pinning them all.
    max_pins_per_client: int = 65_536
    sweep_interval_ms: int = 500


@dataclass(slots=True)
class EventsConfig:
    # The ring of recent KV events kept for WatchEvents resumes, shared by
    # every namespace: at most this many events and this many keys in all.
    ring_events: int = 65_536
    ring_keys: int = 262_144
    # Concurrent WatchEvents streams (each also holds one gRPC stream).
    max_subscribers: int = 32


@dataclass(slots=True)
class LogConfig:
    level: str = "info"
    # "json" (one object per line) or "text".
    format: str = "json"


def validate_server(server: ServerConfig, metrics: MetricsConfig, auth: AuthConfig) -> None:
    """The listeners, their TLS and authentication."""
    positive("server.max_message_bytes", server.max_message_bytes)
    positive("server.max_concurrent_rpcs", server.max_concurrent_rpcs)
    if server.grace_period_s < 0:
        raise ConfigError("server.grace_period_s", "must not be negative")
    if not server.arena_request_timeout_s > 0:
        raise ConfigError("server.arena_request_timeout_s", "must be positive")
    for name, address in (("server.tcp_address", server.tcp_address), ("metrics.address", metrics.address)):
        if address:
            parse_address(name, address)
    if not server.unix_socket and not server.tcp_address:
        raise ConfigError("server.unix_socket", "both listeners are disabled; enable at least one")
    if bool(server.tls_cert_file) != bool(server.tls_key_file):
        missing = "server.tls_key_file" if server.tls_cert_file else "server.tls_cert_file"
        raise ConfigError(missing, "TLS needs both server.tls_cert_file and server.tls_key_file")
    if server.tls_cert_file and not server.tcp_address:
        raise ConfigError("server.tls_cert_file", "TLS is for the TCP listener, and server.tcp_address is \"\"")
    if server.tls_client_ca_file and not server.tls_cert_file:
        raise ConfigError("server.tls_client_ca_file", "mutual TLS needs server.tls_cert_file and tls_key_file")
    if auth.mode not in ("none", "token"):
        raise ConfigError("auth.mode", f"must be none or token, got {auth.mode!r}")
    if auth.mode == "token" and not auth.tenants_file:
        raise ConfigError("auth.tenants_file", "auth.mode = \"token\" needs a tenants file")


def validate_leases_events_log(leases: LeaseConfig, events: EventsConfig, log: LogConfig,
                               server: ServerConfig) -> None:
    positive("leases.default_ms", leases.default_ms)
    positive("leases.max_ms", leases.max_ms)
    positive("leases.max_leases", leases.max_leases)
    positive("leases.max_pins_per_client", leases.max_pins_per_client)
    positive("leases.sweep_interval_ms", leases.sweep_interval_ms)
    if leases.default_ms > leases.max_ms:
        raise ConfigError("leases.default_ms", f"exceeds leases.max_ms ({leases.max_ms})")
    for name in ("ring_events", "ring_keys", "max_subscribers"):
        positive(f"events.{name}", getattr(events, name))
    if events.max_subscribers >= server.max_concurrent_rpcs:
        raise ConfigError(
            "events.max_subscribers",
            f"must be below server.max_concurrent_rpcs ({server.max_concurrent_rpcs}): "
            "every subscriber holds an RPC open",
        )
    if log.level.lower() not in ("debug", "info", "warning", "error"):
        raise ConfigError("log.level", f"must be debug, info, warning or error, got {log.level!r}")
    if log.format not in ("json", "text"):
        raise ConfigError("log.format", f"must be json or text, got {log.format!r}")
