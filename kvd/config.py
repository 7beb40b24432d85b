"""Daemon configuration: embedded defaults < TOML file < environment < flags.

Every setting has a dotted name (`host.capacity_bytes`), a TOML location
(`[host] capacity_bytes = ...`), an environment variable
(`KVD_HOST_CAPACITY_BYTES`) and a flag (`--set host.capacity_bytes=...`).
Byte sizes accept integers or strings with a unit ("512MiB", "2GiB").
A bad value raises ConfigError naming the field; unknown fields are errors,
not silently ignored, so a typo never runs the daemon with a default.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, get_type_hints

from kvd.errors import ConfigError

# The member record's rule for node names (kvd.cluster.members checks the
# same pattern; this module imports nothing from the cluster package).
NODE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")

ENV_PREFIX = "KVD_"

# The registries of kvd.core.policy (this module imports nothing from the
# core; tests/unit/test_policies.py checks the two agree).
HOST_POLICIES = ("lru", "s3fifo")
DISK_POLICIES = ("clock",)
PROMOTION_POLICIES = ("always",)
# disk.write_mode; must match kvd.core.mover.WRITE_MODES.
WRITE_MODES = ("behind", "back", "through")
ADMISSION_MIN_HITS_MAX = 255

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1 << 40,
}


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
class HostConfig:
    capacity_bytes: int = 1 << 30
    slot_bytes: int = 2 << 20
    # Slot size classes: host memory is carved into pages of slot_bytes,
    # and each page into slots of one size, slot_bytes halved down to this
    # (a namespace takes the smallest that holds its blocks), so models of
    # different block sizes share memory. slot_bytes: one size only.
    min_slot_bytes: int = 64 << 10
    prefault: bool = True
    huge_pages: bool = True
    # Watermarks, as fractions of the host slots: from high_watermark
    # occupied on, dirty blocks are written back (write_mode = "back") and
    # durable ones demoted in the background until low_watermark, so Puts
    # find free slots instead of evicting.
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    # Eviction: "lru", or "s3fifo" (scan-resistant: blocks used once leave
    # before blocks used again). Must match HOST_POLICIES.
    policy: str = "lru"


@dataclass(slots=True)
class DiskSettings:
    # One directory per drive; empty: no disk tier.
    directories: list[str] = field(default_factory=list)
    capacity_bytes: int = 16 << 30  # per directory
    slot_bytes: int = 2 << 20
    # Slot size classes, as in host memory: disk pages of slot_bytes carved
    # into slots of slot_bytes halved down to this. Each slot of each class
    # costs 35-55 B of memory, so the disk's smallest slots are larger than host
    # memory's. slot_bytes: one size only.
    min_slot_bytes: int = 512 << 10
    segment_bytes: int = 1 << 30
    # "behind": queue every block the admission filter takes for the disk
    # and write it in the gaps between reads, at the lowest priority, so a
    # crash loses only the last moments (kvd_disk_oldest_unwritten_seconds);
    # "back": write only when the host tier runs short of free slots (or a
    # client asks for durability), so short-lived blocks never cost SSD
    # writes, and a crash loses whatever was never written; "through":
    # write every block at once, taking drive time from reads when behind.
    write_mode: str = "behind"
    # When written blocks are synced (data, then the records that point to
    # it): "strict" with every write batch; "group" by a commit every
    # group_commit_ms; "none" never on its own. Whatever the policy, an
    # ACK_DURABLE Put or MakeDurable returns only once its blocks are synced:
    # under group and none it starts a commit at once and waits for it.
    fsync: str = "strict"
    # fsync = "group": commit at least this often (also when nobody waits).
    group_commit_ms: int = 10
    write_batch_blocks: int = 64
    queue_depth: int = 128
    # Streamed restores (GetLayers, or reads with writes in their slack)
    # read each block in extents of whole layers of about this many bytes:
    # larger is nearer the drive's bandwidth, smaller delivers the first
    # layers sooner. A Get or Prefetch reads each block as one extent.
    read_extent_bytes: int = 512 << 10
    # Order of the disk's jobs: "slack" (restores, then prefetches, then
    # write-back in chunks of write_chunk_blocks between reads) or "fifo"
    # (arrival order, whole write batches; for comparison).
    io_schedule: str = "slack"
    write_chunk_blocks: int = 8
    # ... and of at most this many bytes (one block at least): a restore waits for one chunk, however
    # large the blocks (8 blocks of a 256-token Llama-8B block are 256 MiB).
    write_chunk_bytes: int = 16 << 20
    # While more than write_backlog_blocks wait for write-back under host
    # pressure, writes get one job in every write_share + 1 even if reads wait.
    write_backlog_blocks: int = 256
    write_share: int = 4
    # Under slack, a write that would start within this long after a read
    # ended waits that long for another read first (0: never waits).
    write_anticipation_ms: float = 2.0
    # A slack table (kvd.planner.slack, measured by `make slack-profile`): under slack,
    # write-back jobs are sized to the write budget its profile leaves in each layer of the
    # latest restore, with the drive's bandwidths as observed. "": write_chunk_blocks.
    slack_profile: str = ""
    # Prefetch: at most this many blocks read ahead of a Get in flight at a
    # time (a Prefetch beyond it is cut short, not refused), in jobs of at
    # most prefetch_chunk_blocks, so a restore waits for one job at most.
    prefetch_max_blocks: int = 256
    prefetch_chunk_blocks: int = 16
    # "auto" (io_uring when available), "uring" or "fallback".
    io_engine: str = "auto"
    # Write zeros over every segment file the daemon creates, before it serves. A file system
    # hands out preallocated space as unwritten extents, and the first write into each costs
    # its conversion (on ext4 up to a third of the store speed); zeroed, the first fill stores
    # as fast as a tier that ran a while. Costs one write of capacity_bytes per drive at the
    # start that creates the segments, never again.
    zero_segments: bool = False
    manifest_max_bytes: int = 64 << 20
    # Eviction of disk slots: "clock".
    policy: str = "clock"
    # Write a block to disk only once it has been seen (sealed, served by a
    # Get, or Put again) this many times; 1 writes every block. ACK_DURABLE
    # Puts are written regardless. Saves SSD writes on one-off blocks.
    admission_min_hits: int = 1
    # Whether a Get's disk hit is read into host memory: "always".
    promotion: str = "always"


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
class AuthConfig:
    # "none": every client may do everything (whoever can open the unix
    # socket or reach the TCP port); "token": every call carries a tenant's
    # bearer token, and tenants see only their own namespaces and blocks.
    mode: str = "none"
    # With mode = "token": the TOML or JSON (*.json) file that defines the
    # tenants: name, token_sha256 or token_env, namespaces, quotas, admin.
    tenants_file: str = ""


@dataclass(slots=True)
class ClusterConfig:
    # etcd endpoints, "host:port" each; empty: this daemon stands alone.
    etcd_endpoints: list[str] = field(default_factory=list)
    # This node's name in the cluster (its member key); "": the host name.
    node_name: str = ""
    # host:port other daemons reach this one at; "": server.tcp_address
    # (which must then not be loopback-only for a real cluster).
    advertise_address: str = ""
    # Every key kvd writes in etcd starts with this.
    key_prefix: str = "/kvd/"
    # The member key's lease: a node that dies leaves the cluster this long
    # after its last refresh (refreshed every third of it).
    lease_ttl_s: int = 5
    # Deadline of every etcd call.
    etcd_timeout_s: float = 2.0
    # TLS to etcd: the CA bundle that etcd's certificate must chain to, and
    # this daemon's client certificate and key (both or neither).
    etcd_ca_file: str = ""
    etcd_cert_file: str = ""
    etcd_key_file: str = ""
    # Directory: a chain is cut into segments of about this many blocks, each
    # owned by one node (kvd.cluster.placement).
    segment_blocks: int = 64
    # The cluster credential: a file holding one secret (16+ printable ASCII
    # characters), the same on every node; node-to-node calls carry it.
    secret_file: str = ""
    # Deadline of every node-to-node call (directory updates and queries).
    rpc_timeout_s: float = 1.0
    # How often this node sends its stored and removed blocks to the directory.
    publish_interval_ms: int = 50
    # A Get of a chain that misses here fetches the missing blocks from the
    # node holding most of them (one directory lookup first), within
    # fetch_timeout_s; what does not arrive verified by then is a miss.
    fetch_on_get: bool = True
    fetch_timeout_s: float = 5.0
    # Entries this node's directory shard keeps at most (100-130 B each; the
    # oldest go first past it: the directory is a hint, and fetches verify).
    directory_max_entries: int = 1 << 20
    # Nodes each directory segment's entries live on (kvd.cluster.placement):
    # a lookup asks one of them, so a popular prefix's lookups spread over
    # them, and a segment stays answerable while one of them is down. Costs
    # this many times the directory memory and update messages.
    directory_replicas: int = 2
    # How blocks move between nodes: "auto" (NIXL one-sided READs where the
    # nixl package is installed and the peer has an agent, else gRPC
    # streams), "nixl" (required: start fails without it) or "grpc". Where
    # the listener uses TLS, "auto" means gRPC: NIXL's bytes are not encrypted.
    transport: str = "auto"
    # TLS between nodes: on when this node's TCP listener uses TLS
    # (server.tls_cert_file). Calls to peers then check that a peer's
    # certificate chains to peer_ca_file (default server.tls_client_ca_file)
    # and carries peer_server_name ("" = the host of its address), and present
    # peer_cert_file and peer_key_file (default the listener's own pair, which
    # then needs extendedKeyUsage serverAuth and clientAuth when peers require
    # client certificates).
    peer_ca_file: str = ""
    peer_cert_file: str = ""
    peer_key_file: str = ""
    peer_server_name: str = ""


@dataclass(slots=True)
class DeviceConfig:
    # The device plane (docs/GPU.md): "off", "cpu" (the CPU device: memfd
    # memory and threads, for tests and CPU-only engines) or "cuda".
    kind: str = "off"
    index: int = 0
    # Devices served, from `index` on: one device plane each, and a pool goes to the one its memory
    # is on (TP > 1 engines register one pool per GPU). 0: every GPU the CUDA driver shows.
    count: int = 1
    # Engines' pools registered at once, and how long one lives without use.
    max_pools: int = 64
    pool_lease_ms: int = 300_000
    # How long a SaveLayers waits for the engine's flag of a layer.
    flag_timeout_ms: int = 10_000
    # The device tier: device memory kvd owns above host memory, holding copies of saved blocks
    # for other engines' loads (0: none), in slots of tier_slot_bytes (0: host.slot_bytes).
    tier_bytes: int = 0
    tier_slot_bytes: int = 0


@dataclass(slots=True)
class LogConfig:
    level: str = "info"
    # "json" (one object per line) or "text".
    format: str = "json"


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
        self._validate_server()
        self._validate_host()
        self._validate_disk()
        self._validate_cluster()
        self._validate_device()
        self._validate_rest()

    def _validate_server(self) -> None:
        _positive("server.max_message_bytes", self.server.max_message_bytes)
        _positive("server.max_concurrent_rpcs", self.server.max_concurrent_rpcs)
        if self.server.grace_period_s < 0:
            raise ConfigError("server.grace_period_s", "must not be negative")
        if not self.server.arena_request_timeout_s > 0:
            raise ConfigError("server.arena_request_timeout_s", "must be positive")
        for name, address in (("server.tcp_address", self.server.tcp_address), ("metrics.address", self.metrics.address)):
            if address:
                parse_address(name, address)
        if not self.server.unix_socket and not self.server.tcp_address:
            raise ConfigError("server.unix_socket", "both listeners are disabled; enable at least one")
        if bool(self.server.tls_cert_file) != bool(self.server.tls_key_file):
            missing = "server.tls_key_file" if self.server.tls_cert_file else "server.tls_cert_file"
            raise ConfigError(missing, "TLS needs both server.tls_cert_file and server.tls_key_file")
        if self.server.tls_cert_file and not self.server.tcp_address:
            raise ConfigError("server.tls_cert_file", "TLS is for the TCP listener, and server.tcp_address is \"\"")
        if self.server.tls_client_ca_file and not self.server.tls_cert_file:
            raise ConfigError("server.tls_client_ca_file", "mutual TLS needs server.tls_cert_file and tls_key_file")
        if self.auth.mode not in ("none", "token"):
            raise ConfigError("auth.mode", f"must be none or token, got {self.auth.mode!r}")
        if self.auth.mode == "token" and not self.auth.tenants_file:
            raise ConfigError("auth.tenants_file", "auth.mode = \"token\" needs a tenants file")

    def _validate_host(self) -> None:
        _positive("host.slot_bytes", self.host.slot_bytes)
        if self.host.slot_bytes % 4096:
            raise ConfigError("host.slot_bytes", f"must be a multiple of 4096, got {self.host.slot_bytes}")
        if self.host.capacity_bytes < self.host.slot_bytes:
            raise ConfigError(
                "host.capacity_bytes",
                f"{self.host.capacity_bytes} is smaller than one slot ({self.host.slot_bytes} bytes)",
            )
        _positive("host.min_slot_bytes", self.host.min_slot_bytes)
        if self.host.min_slot_bytes % 4096:
            raise ConfigError("host.min_slot_bytes", f"must be a multiple of 4096, got {self.host.min_slot_bytes}")
        _one_of("host.policy", self.host.policy, HOST_POLICIES)
        if not 0.0 < self.host.low_watermark < self.host.high_watermark <= 1.0:
            raise ConfigError(
                "host.low_watermark",
                f"need 0 < low_watermark ({self.host.low_watermark}) < high_watermark "
                f"({self.host.high_watermark}) <= 1",
            )

    def _validate_disk(self) -> None:
        _one_of("disk.policy", self.disk.policy, DISK_POLICIES)
        _one_of("disk.promotion", self.disk.promotion, PROMOTION_POLICIES)
        if not 1 <= self.disk.admission_min_hits <= ADMISSION_MIN_HITS_MAX:
            raise ConfigError(
                "disk.admission_min_hits",
                f"must be 1..{ADMISSION_MIN_HITS_MAX} (1 writes every block), got {self.disk.admission_min_hits}",
            )
        if self.disk.directories:
            if self.disk.fsync not in ("strict", "group", "none"):
                raise ConfigError("disk.fsync", f"must be strict, group or none, got {self.disk.fsync!r}")
            _one_of("disk.write_mode", self.disk.write_mode, WRITE_MODES)
            if not 0.0 <= self.disk.write_anticipation_ms <= 1000.0:
                raise ConfigError("disk.write_anticipation_ms", f"must be in [0, 1000], got {self.disk.write_anticipation_ms}")
            if self.disk.io_schedule not in ("slack", "fifo"):
                raise ConfigError("disk.io_schedule", f"must be slack or fifo, got {self.disk.io_schedule!r}")
            if self.disk.io_engine not in ("auto", "uring", "fallback"):
                raise ConfigError("disk.io_engine", f"must be auto, uring or fallback, got {self.disk.io_engine!r}")
            for name in ("group_commit_ms", "write_batch_blocks", "queue_depth", "manifest_max_bytes",
                         "read_extent_bytes", "write_chunk_blocks", "write_chunk_bytes", "write_backlog_blocks",
                         "write_share",
                         "prefetch_max_blocks", "prefetch_chunk_blocks"):
                _positive(f"disk.{name}", getattr(self.disk, name))

    def _validate_cluster(self) -> None:
        cluster = self.cluster
        for i, endpoint in enumerate(cluster.etcd_endpoints):
            parse_address(f"cluster.etcd_endpoints[{i}]", endpoint)
        if not cluster.etcd_endpoints:
            return
        if cluster.node_name and not NODE_NAME_RE.match(cluster.node_name):
            raise ConfigError("cluster.node_name", f"{cluster.node_name!r} is not 1-63 letters, digits, '.', '_' or '-'")
        if cluster.advertise_address:
            parse_address("cluster.advertise_address", cluster.advertise_address)
        elif not self.server.tcp_address:
            raise ConfigError("cluster.advertise_address", "a cluster node needs a TCP address other nodes can reach")
        if not cluster.key_prefix.startswith("/") or not cluster.key_prefix.endswith("/"):
            raise ConfigError("cluster.key_prefix", f"must start and end with '/', got {cluster.key_prefix!r}")
        if not cluster.secret_file:
            raise ConfigError("cluster.secret_file", "node-to-node calls are authenticated: set the cluster secret file")
        self._validate_peer_tls()
        if bool(cluster.etcd_cert_file) != bool(cluster.etcd_key_file):
            raise ConfigError("cluster.etcd_cert_file", "an etcd client certificate needs both cert and key files")
        if cluster.etcd_cert_file and not cluster.etcd_ca_file:
            raise ConfigError("cluster.etcd_ca_file", "TLS to etcd needs the CA bundle (cluster.etcd_ca_file)")
        if cluster.transport not in ("auto", "nixl", "grpc"):
            raise ConfigError("cluster.transport", f"must be auto, nixl or grpc, got {cluster.transport!r}")
        self._validate_cluster_numbers()

    def _validate_peer_tls(self) -> None:
        cluster, server = self.cluster, self.server
        if bool(cluster.peer_cert_file) != bool(cluster.peer_key_file):
            raise ConfigError("cluster.peer_cert_file", "a peer client certificate needs both cert and key files")
        if not server.tls_cert_file:
            for name in ("peer_ca_file", "peer_cert_file", "peer_server_name"):
                if getattr(cluster, name):
                    raise ConfigError(f"cluster.{name}", "nodes use TLS between them only when their listener "
                                                         "does: set server.tls_cert_file too")
        elif not (cluster.peer_ca_file or server.tls_client_ca_file):
            raise ConfigError("cluster.peer_ca_file", "TLS between nodes needs the CA bundle that peers' "
                                                      "certificates chain to (or server.tls_client_ca_file)")

    def _validate_cluster_numbers(self) -> None:
        cluster = self.cluster
        if not 1 <= cluster.lease_ttl_s <= 3600:
            raise ConfigError("cluster.lease_ttl_s", f"must be 1..3600 seconds, got {cluster.lease_ttl_s}")
        if not 0 < cluster.etcd_timeout_s <= 60:
            raise ConfigError("cluster.etcd_timeout_s", f"must be in (0, 60], got {cluster.etcd_timeout_s}")
        for name in ("rpc_timeout_s", "fetch_timeout_s"):
            if not 0 < getattr(cluster, name) <= 60:
                raise ConfigError(f"cluster.{name}", f"must be in (0, 60], got {getattr(cluster, name)}")
        if not 1 <= cluster.segment_blocks <= 1 << 20:
            raise ConfigError("cluster.segment_blocks", f"must be 1..{1 << 20}, got {cluster.segment_blocks}")
        if not 1 <= cluster.directory_max_entries <= 1 << 30:
            raise ConfigError("cluster.directory_max_entries", f"must be 1..{1 << 30}, got {cluster.directory_max_entries}")
        if not 1 <= cluster.directory_replicas <= 8:
            raise ConfigError("cluster.directory_replicas", f"must be 1..8, got {cluster.directory_replicas}")
        if not 1 <= cluster.publish_interval_ms <= 60_000:
            raise ConfigError("cluster.publish_interval_ms", f"must be 1..60000, got {cluster.publish_interval_ms}")

    def _validate_device(self) -> None:
        device = self.device
        if device.kind not in ("off", "cpu", "cuda"):
            raise ConfigError("device.kind", f"must be off, cpu or cuda, got {device.kind!r}")
        if not 0 <= device.index < 1024:
            raise ConfigError("device.index", f"must be 0..1023, got {device.index}")
        if not 0 <= device.count <= 64 or (device.count == 0 and device.kind != "cuda"):
            raise ConfigError("device.count", f"must be 1..64 (0: every GPU, kind cuda only), got {device.count}")
        if not 1 <= device.max_pools <= 4096:
            raise ConfigError("device.max_pools", f"must be 1..4096, got {device.max_pools}")
        if not 1_000 <= device.pool_lease_ms <= 86_400_000:
            raise ConfigError("device.pool_lease_ms", f"must be 1000..86400000, got {device.pool_lease_ms}")
        if not 1 <= device.flag_timeout_ms <= 600_000:
            raise ConfigError("device.flag_timeout_ms", f"must be 1..600000, got {device.flag_timeout_ms}")
        if device.kind != "off" and device.flag_timeout_ms >= self.leases.default_ms:
            # A SaveLayers may wait this long for a layer under a lease of leases.default_ms.
            raise ConfigError("device.flag_timeout_ms", f"{device.flag_timeout_ms} must be below leases.default_ms "
                              f"({self.leases.default_ms}): a save waiting for the engine's flag would outlive "
                              "its lease")
        if device.tier_bytes < 0 or device.tier_slot_bytes < 0 or device.tier_slot_bytes % 4096:
            raise ConfigError("device.tier_slot_bytes" if device.tier_bytes >= 0 else "device.tier_bytes",
                              "must not be negative, and slots a multiple of 4096 bytes")
        if device.tier_bytes and device.kind == "off":
            raise ConfigError("device.tier_bytes", "a device tier needs the device plane: set device.kind")
        if device.tier_bytes and device.tier_bytes < (device.tier_slot_bytes or self.host.slot_bytes):
            raise ConfigError("device.tier_bytes", f"{device.tier_bytes} is smaller than one slot")

    def _validate_rest(self) -> None:
        """Leases, events and logging."""
        _positive("leases.default_ms", self.leases.default_ms)
        _positive("leases.max_ms", self.leases.max_ms)
        _positive("leases.max_leases", self.leases.max_leases)
        _positive("leases.max_pins_per_client", self.leases.max_pins_per_client)
        _positive("leases.sweep_interval_ms", self.leases.sweep_interval_ms)
        if self.leases.default_ms > self.leases.max_ms:
            raise ConfigError("leases.default_ms", f"exceeds leases.max_ms ({self.leases.max_ms})")
        for name in ("ring_events", "ring_keys", "max_subscribers"):
            _positive(f"events.{name}", getattr(self.events, name))
        if self.events.max_subscribers >= self.server.max_concurrent_rpcs:
            raise ConfigError(
                "events.max_subscribers",
                f"must be below server.max_concurrent_rpcs ({self.server.max_concurrent_rpcs}): "
                "every subscriber holds an RPC open",
            )
        if self.log.level.lower() not in ("debug", "info", "warning", "error"):
            raise ConfigError("log.level", f"must be debug, info, warning or error, got {self.log.level!r}")
        if self.log.format not in ("json", "text"):
            raise ConfigError("log.format", f"must be json or text, got {self.log.format!r}")


def _one_of(name: str, value: str, known: tuple[str, ...]) -> None:
    if value not in known:
        raise ConfigError(name, f"unknown policy {value!r} (known: {', '.join(known)})")


def _positive(name: str, value: int | float) -> None:
    if value <= 0:
        raise ConfigError(name, f"must be positive, got {value}")


def parse_address(name: str, address: str) -> tuple[str, int]:
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ConfigError(name, f"must be host:port, got {address!r}")
    return host.strip("[]"), int(port_text)


def parse_size(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(name, "must be a byte size, got a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    raise ConfigError(name, f"must be a byte size like 1073741824 or '1GiB', got {value!r}")


def _coerce(name: str, kind: type, value: Any) -> Any:
    """Convert a TOML/env/flag value to the field's type, or name the field."""
    if name.endswith("_bytes"):
        return parse_size(name, value)
    if getattr(kind, "__origin__", None) is list:
        return _coerce_list(name, value)
    converter = _COERCERS.get(kind)
    if converter is None:
        raise ConfigError(name, f"unsupported type {kind!r}")
    return converter(name, value)


def _coerce_list(name: str, value: Any) -> list[str]:
    # TOML gives a list; env and flags give "a,b" or a TOML array '["a", "b"]'.
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = tomllib.loads(f"value = {value}")["value"]
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(name, f"{value!r} is not a TOML array of strings ({error}); "
                              'write ["/a", "/b"] or /a,/b') from None
    elif isinstance(value, str):
        value = [item.strip() for item in value.split(",") if item.strip()]
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ConfigError(name, f"must be a list of strings, got {value!r}")
    return list(value)


def _coerce_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise ConfigError(name, f"must be true or false, got {value!r}")


def _coerce_int(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?\d+", value.strip()):
        return int(value)
    raise ConfigError(name, f"must be an integer, got {value!r}")


def _coerce_float(name: str, value: Any) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            pass
    raise ConfigError(name, f"must be a number, got {value!r}")


def _coerce_str(name: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    raise ConfigError(name, f"must be a string, got {value!r}")


_COERCERS = {bool: _coerce_bool, int: _coerce_int, float: _coerce_float, str: _coerce_str}

def _apply(target: Any, values: dict[str, Any], prefix: str = "") -> None:
    hints = get_type_hints(type(target))
    known = {f.name for f in dataclasses.fields(target)}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if key not in known:
            raise ConfigError(name, f"unknown setting (known here: {', '.join(sorted(known))})")
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            if not isinstance(value, dict):
                raise ConfigError(name, "must be a table")
            _apply(getattr(target, key), value, f"{name}.")
        else:
            setattr(target, key, _coerce(name, kind, value))


def setting_names(config: Config | None = None) -> list[str]:
    """Every dotted setting name, e.g. ['host.capacity_bytes', ...]."""
    config = config or Config()
    names = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            names.extend(f"{f.name}.{inner.name}" for inner in dataclasses.fields(value))
        else:
            names.append(f.name)
    return names


def _dotted_to_nested(name: str, value: Any) -> dict[str, Any]:
    parts = name.split(".")
    nested: dict[str, Any] = {parts[-1]: value}
    for part in reversed(parts[:-1]):
        nested = {part: nested}
    return nested


def default_toml() -> str:
    return resources.files("kvd").joinpath("default.toml").read_text()


def load(
    path: str | Path | None = None,
    *,
    env: dict[str, str] | None = None,
    overrides: dict[str, Any] | None = None,
) -> Config:
    """Build the configuration: defaults, then file, then env, then flags."""
    config = Config()
    _apply(config, tomllib.loads(default_toml()))
    if path is not None:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ConfigError("--config", f"cannot read {path}: {error.strerror}") from None
        try:
            _apply(config, tomllib.loads(text))
        except tomllib.TOMLDecodeError as error:
            raise ConfigError("--config", f"{path} is not valid TOML: {error}") from None
    env = os.environ if env is None else env
    names = setting_names(config)
    for name in names:
        variable = ENV_PREFIX + name.replace(".", "_").upper()
        if variable in env:
            _apply(config, _dotted_to_nested(name, env[variable]))
    for name, value in (overrides or {}).items():
        if name not in names:
            raise ConfigError(name, "unknown setting")
        _apply(config, _dotted_to_nested(name, value))
    config.validate()
    return config


def to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


# ----------------------------------------------------------------------
# Tenants (auth.mode = "token")
#
# The tenants file, TOML, or JSON when its name ends in .json:
#
#     [[tenants]]
#     name = "team-a"                      # [A-Za-z0-9][A-Za-z0-9_.-]{0,63}
#     token_sha256 = "9f86d08..."          # SHA-256 of the token, hex; a list while rotating
#     token_env = "KVD_TOKEN_TEAM_A"       # and/or: an environment variable holding the token
#     namespaces = ["meta-llama/*"]        # model ids it may register (glob patterns; "*": any)
#     host_bytes = "8GiB"                  # host memory quota (0 or absent: none)
#     disk_bytes = "200GiB"                # disk quota (0 or absent: none)
#     admin = false                        # may call administrative RPCs (Stats)
#
# Tokens themselves are never stored in the file and never printed: errors
# name the tenant and the key, never a value.

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# A token from the environment must be at least this long (`kvd token` makes
# 43 characters: 32 random bytes).
MIN_TOKEN_CHARS = 16
_TENANT_KEYS = ("name", "token_sha256", "token_env", "namespaces", "host_bytes", "disk_bytes", "admin")


@dataclass(frozen=True, slots=True)
class TenantSettings:
    name: str
    # SHA-256 digests of the tenant's tokens (more than one while rotating).
    token_digests: tuple[bytes, ...] = field(repr=False)
    # Glob patterns over model ids (fnmatch, case-sensitive); "*" is any.
    namespaces: tuple[str, ...] = ()
    host_bytes: int = 0
    disk_bytes: int = 0
    admin: bool = False


def load_tenants(path: str | Path, env: dict[str, str] | None = None) -> list[TenantSettings]:
    """The tenants of the tenants file; ConfigError naming the tenant and key of any mistake."""
    import json

    env = os.environ if env is None else env
    field_name = "auth.tenants_file"
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(field_name, f"cannot read {path}: {error.strerror}") from None
    try:
        document = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
        kind = "JSON" if str(path).endswith(".json") else "TOML"
        raise ConfigError(field_name, f"{path} is not valid {kind}: {error}") from None
    if not isinstance(document, dict) or set(document) != {"tenants"} or not isinstance(document["tenants"], list):
        raise ConfigError(field_name, f"{path} must hold exactly one list, `tenants` ([[tenants]] tables in TOML)")
    tenants: list[TenantSettings] = []
    owner_of_digest: dict[bytes, str] = {}
    for position, entry in enumerate(document["tenants"]):
        tenant = _tenant(f"{path}: tenants[{position}]", entry, env)
        if any(other.name == tenant.name for other in tenants):
            raise ConfigError(field_name, f"{path}: tenant {tenant.name!r} is defined twice")
        for digest in tenant.token_digests:
            if digest in owner_of_digest:
                raise ConfigError(
                    field_name, f"{path}: tenants {owner_of_digest[digest]!r} and {tenant.name!r} share a token"
                )
            owner_of_digest[digest] = tenant.name
        tenants.append(tenant)
    if not tenants:
        raise ConfigError(field_name, f"{path} defines no tenant: with auth.mode = \"token\" nobody could connect")
    return tenants


def _token_digests(entry: dict, env: dict[str, str], fail) -> list[bytes]:
    """The SHA-256 digests of a tenant's tokens: listed (token_sha256) or read from the environment (token_env)."""
    import hashlib

    hashes = entry.get("token_sha256", [])
    if isinstance(hashes, str):
        hashes = [hashes]
    if not isinstance(hashes, list):
        raise fail("token_sha256 must be a hex string or a list of them")
    digests = []
    for value in hashes:
        if not isinstance(value, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", value):
            raise fail("token_sha256 must be 64 hex digits (the SHA-256 of the token)")
        digests.append(bytes.fromhex(value))
    variable = entry.get("token_env")
    if variable is not None:
        if not isinstance(variable, str) or not variable:
            raise fail("token_env must name an environment variable")
        token = env.get(variable, "")
        if len(token) < MIN_TOKEN_CHARS:
            state = "is not set" if not token else f"holds fewer than {MIN_TOKEN_CHARS} characters"
            raise fail(f"token_env: the environment variable {variable} {state}")
        digests.append(hashlib.sha256(token.encode()).digest())
    if not digests:
        raise fail("has no token: set token_sha256 or token_env")
    if len(set(digests)) != len(digests):
        raise fail("lists the same token twice")
    return digests


def _tenant(where: str, entry: Any, env: dict[str, str]) -> TenantSettings:
    def fail(message: str) -> ConfigError:
        return ConfigError("auth.tenants_file", f"{where}: {message}")

    if not isinstance(entry, dict):
        raise fail("must be a table")
    name = entry.get("name")
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise fail(f"name must match {TENANT_NAME.pattern}, got {name!r}")
    where = f"{where} ({name})"
    if "token" in entry:
        raise fail("has a plain `token`: store its SHA-256 as token_sha256 (`kvd token` prints both), "
                   "or name an environment variable that holds it with token_env")
    unknown = sorted(set(entry) - set(_TENANT_KEYS))
    if unknown:
        raise fail(f"unknown key {unknown[0]!r} (known: {', '.join(_TENANT_KEYS)})")
    digests = _token_digests(entry, env, fail)
    namespaces = entry.get("namespaces")
    if not isinstance(namespaces, list) or not all(isinstance(item, str) and item for item in namespaces):
        raise fail('namespaces must be a list of model ids or glob patterns (["*"] for any; [] for none)')
    quotas = {}
    for key in ("host_bytes", "disk_bytes"):
        value = parse_size(f"{where}: {key}", entry.get(key, 0))
        if value < 0:
            raise fail(f"{key} must not be negative")
        quotas[key] = value
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise fail("admin must be true or false")
    return TenantSettings(name, tuple(digests), tuple(namespaces), quotas["host_bytes"], quotas["disk_bytes"], admin)
