"""The cluster's settings, [cluster]: etcd membership, this node's name and address,
the directory, node-to-node calls and their TLS, with their checks (docs/CLUSTER.md).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from kvd.config.server import ServerConfig
from kvd.config.values import parse_address
from kvd.errors import ConfigError

# The member record's rule for node names (kvd.cluster.members checks the
# same pattern; the config imports nothing from the cluster package).
NODE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


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


def validate_cluster(cluster: ClusterConfig, server: ServerConfig) -> None:
    for i, endpoint in enumerate(cluster.etcd_endpoints):
        parse_address(f"cluster.etcd_endpoints[{i}]", endpoint)
    if not cluster.etcd_endpoints:
        return
    if cluster.node_name and not NODE_NAME_RE.match(cluster.node_name):
        raise ConfigError("cluster.node_name", f"{cluster.node_name!r} is not 1-63 letters, digits, '.', '_' or '-'")
    if cluster.advertise_address:
        parse_address("cluster.advertise_address", cluster.advertise_address)
    elif not server.tcp_address:
        raise ConfigError("cluster.advertise_address", "a cluster node needs a TCP address other nodes can reach")
    if not cluster.key_prefix.startswith("/") or not cluster.key_prefix.endswith("/"):
        raise ConfigError("cluster.key_prefix", f"must start and end with '/', got {cluster.key_prefix!r}")
    if not cluster.secret_file:
        raise ConfigError("cluster.secret_file", "node-to-node calls are authenticated: set the cluster secret file")
    _validate_peer_tls(cluster, server)
    if bool(cluster.etcd_cert_file) != bool(cluster.etcd_key_file):
        raise ConfigError("cluster.etcd_cert_file", "an etcd client certificate needs both cert and key files")
    if cluster.etcd_cert_file and not cluster.etcd_ca_file:
        raise ConfigError("cluster.etcd_ca_file", "TLS to etcd needs the CA bundle (cluster.etcd_ca_file)")
    if cluster.transport not in ("auto", "nixl", "grpc"):
        raise ConfigError("cluster.transport", f"must be auto, nixl or grpc, got {cluster.transport!r}")
    _validate_cluster_numbers(cluster)


def _validate_peer_tls(cluster: ClusterConfig, server: ServerConfig) -> None:
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


def _validate_cluster_numbers(cluster: ClusterConfig) -> None:
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
