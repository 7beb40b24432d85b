"""The whole configuration, Config: one section per TOML table, and validate(), which
runs each section's checks (they live beside the section's fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvd.config.cluster import ClusterConfig, validate_cluster
from kvd.config.device import DeviceConfig, validate_device
from kvd.config.server import (AuthConfig, EventsConfig, LeaseConfig, LogConfig, MetricsConfig, ServerConfig,
                               validate_leases_events_log, validate_server)
from kvd.config.storage import DiskSettings, HostConfig, validate_disk, validate_host


@dataclass(slots=True)
class Config:
    state_dir: str = "state"
    server: ServerConfig = field(default_factory=ServerConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    host: HostConfig = field(default_factory=HostConfig)
    disk: DiskSettings = field(default_factory=DiskSettings)
    leases: LeaseConfig = field(default_factory=LeaseConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    log: LogConfig = field(default_factory=LogConfig)

    @property
    def unix_socket_path(self) -> Path | None:
        if not self.server.unix_socket:
            return None
        path = Path(self.server.unix_socket)
        return path if path.is_absolute() else Path(self.state_dir) / path

    def validate(self) -> None:
        """Check every setting; the first wrong one raises ConfigError naming it."""
        validate_server(self.server, self.metrics, self.auth)
        validate_host(self.host)
        validate_disk(self.disk)
        validate_cluster(self.cluster, self.server)
        validate_device(self.device, self.leases, self.host)
        validate_leases_events_log(self.leases, self.events, self.log, self.server)
