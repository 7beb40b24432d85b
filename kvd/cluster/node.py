"""This daemon's place in the cluster: membership, its directory shard, publishing, lookups.

Built by the daemon when `[cluster] etcd_endpoints` is set, in two steps:
`ClusterNode(config, engine)` before the gRPC server is built (its Cluster
service is registered there), `start(bound_tcp_port)` once the listeners
are bound (the member record carries the bound port). Nothing here ever
stops the daemon: with etcd or a peer out of reach the local tiers keep
serving, lookups report what they could learn, and publishing catches up.

Membership changes are applied on the publishing loop's next turn, once
however many members the view's snapshot changed: the publisher re-queues
the keys whose owner moved (or whose owner came back empty), the router
and peers follow, and a leaver's entries leave this node's shard at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
import contextlib
import logging
import socket
import time
from pathlib import Path

import grpc

from kvd.cluster import wire
from kvd.cluster.directory import DirectoryShard
from kvd.cluster.members import Member, MemberView
from kvd.cluster.membership import EtcdSettings, Membership
from kvd.cluster.publisher import Publisher
from kvd.cluster.router import ClusterRouter, LookupAnswer, NodeMatch
from kvd.cluster.rpc import DirectoryServicer, Peers
from kvd.config import Config, parse_address
from kvd.errors import ConfigError

log = logging.getLogger("kvd.cluster")


def node_name(config: Config) -> str:
    return config.cluster.node_name or socket.gethostname().split(".")[0]


def advertised_address(config: Config, bound_tcp_port: int | None) -> str:
    if config.cluster.advertise_address:
        return config.cluster.advertise_address
    host, port = parse_address("server.tcp_address", config.server.tcp_address)
    return f"{host}:{bound_tcp_port or port}"


def etcd_settings(config: Config) -> EtcdSettings:
    cluster = config.cluster
    return EtcdSettings(
        endpoints=[parse_address(f"cluster.etcd_endpoints[{i}]", e) for i, e in enumerate(cluster.etcd_endpoints)],
        key_prefix=cluster.key_prefix, lease_ttl_s=cluster.lease_ttl_s, timeout_s=cluster.etcd_timeout_s,
        tls_ca_file=cluster.etcd_ca_file, tls_cert_file=cluster.etcd_cert_file, tls_key_file=cluster.etcd_key_file)


def _read_pem(field: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ConfigError(field, f"cannot read {path}: {error.strerror or error}") from None


def peer_credentials(config: Config) -> grpc.ChannelCredentials | None:
    """TLS for calls to peers where this node's listener uses TLS, else None (plaintext)."""
    cluster, server = config.cluster, config.server
    if not server.tls_cert_file:
        return None
    ca_field = "cluster.peer_ca_file" if cluster.peer_ca_file else "server.tls_client_ca_file"
    own = bool(cluster.peer_cert_file)
    return grpc.ssl_channel_credentials(
        root_certificates=_read_pem(ca_field, cluster.peer_ca_file or server.tls_client_ca_file),
        private_key=_read_pem("cluster.peer_key_file" if own else "server.tls_key_file",
                              cluster.peer_key_file or server.tls_key_file),
        certificate_chain=_read_pem("cluster.peer_cert_file" if own else "server.tls_cert_file",
                                    cluster.peer_cert_file or server.tls_cert_file))


def read_secret(path: str) -> bytes:
    try:
        with open(path, "rb") as file:
            secret = file.read().strip()
    except OSError as error:
        raise ConfigError("cluster.secret_file", f"cannot read {path}: {error.strerror or error}") from None
    if len(secret) < 16 or not secret.isascii() or any(c < 0x21 for c in secret):
        raise ConfigError("cluster.secret_file", f"{path} must hold one printable ASCII secret of 16 characters or more")
    return secret


class ClusterNode:
    def __init__(self, config: Config, engine, arena=None) -> None:
        cluster = config.cluster
        self.config = config
        self.engine = engine
        self.name = node_name(config)
        self.secret = read_secret(cluster.secret_file)
        self.shard = DirectoryShard(max_entries=cluster.directory_max_entries)
        self.peers = Peers(self.name, self.secret, cluster.rpc_timeout_s, config.server.max_message_bytes,
                           credentials=peer_credentials(config), server_name=cluster.peer_server_name)
        self._fresh: set[str] = set()
        self._members_changed = True
        self.view = MemberView(self.name, on_join=self._joined, on_leave=self._left)
        self.publisher = Publisher(engine, cluster.segment_blocks, cluster.directory_replicas)
        self.router = ClusterRouter(self.name, self.view, self.shard, self.peers, cluster.segment_blocks,
                                    cluster.rpc_timeout_s, cluster.directory_replicas)
        self.servicer = DirectoryServicer(self.shard, self.view, self.secret,
                                          serves_nixl=lambda: self.transport is not None)
        self.arena = arena
        # kvd.cluster.nixl_transport.NixlTransport once started, where NIXL is used.
        self.transport = None
        self.member: Member | None = None
        self.membership: Membership | None = None
        self.joined = asyncio.Event()
        self.updates_sent = 0
        self.updates_failed = 0
        self._tasks: list[asyncio.Task] = []

    def register(self, server: grpc.aio.Server) -> None:
        wire.add_cluster_service(self.servicer, server)

    def start(self, bound_tcp_port: int | None, disk_capacity_bytes: int,
              spawn: Callable[..., asyncio.Task] = asyncio.create_task) -> None:
        """Join: the membership and publisher tasks run under `spawn` (the daemon's supervisor)."""
        incarnation = time.time_ns()  # new on every start: peers tell this process from an earlier one
        self.transport = self._open_transport(incarnation, spawn)
        self.member = Member(
            name=self.name,
            address=advertised_address(self.config, bound_tcp_port),
            incarnation=incarnation,
            host_capacity_bytes=self.config.host.capacity_bytes,
            disk_capacity_bytes=disk_capacity_bytes,
            nixl_metadata=self.transport.metadata if self.transport is not None else b"",
        )
        self.membership = Membership(etcd_settings(self.config), self.member, self.view)
        self.membership.on_rejoined_as_new = self._rejoined_as_new
        self.joined = self.membership.joined
        self._tasks = [spawn(self.membership.run(), name="cluster-membership"),
                       spawn(self._publish_loop(), name="cluster-publisher")]

    def _open_transport(self, incarnation: int, spawn: Callable[..., asyncio.Task]):
        """The NIXL agent, with the arena registered (cluster.transport auto or nixl)."""
        mode = self.config.cluster.transport
        if mode == "grpc" or self.arena is None:
            return None
        if self.config.server.tls_cert_file:
            if mode == "auto":
                log.info("TLS between nodes: blocks move over gRPC streams (NIXL would not encrypt them)")
                return None
            log.warning("cluster.transport is nixl: blocks cross the network unencrypted although the listener "
                        "uses TLS")
        from kvd.cluster.nixl_transport import NixlTransport, nixl_available

        if not nixl_available():
            if mode == "nixl":
                raise ConfigError("cluster.transport", "nixl, but the nixl package is not installed")
            log.info("NIXL not installed: blocks move between nodes over gRPC streams")
            return None
        transport = NixlTransport(self.name, incarnation, self.arena.address_at(0), self.arena.layout.arena_bytes,
                                  spawn=spawn)
        log.info("blocks move between nodes over NIXL", extra={"fabric": transport.fabric})
        return transport

    def peer_transports(self) -> dict[str, str]:
        """Each peer in the view, and how blocks from it move: over NIXL (on this host's fabric) when
        its agent was added, else over the gRPC stream."""
        transport = self.transport
        return {member.name: f"nixl-{transport.fabric}" if transport is not None and transport.has_peer(member.name)
                else "grpc" for member in self.view.peers()}

    def _joined(self, member: Member) -> None:
        if self.transport is not None and member.name != self.name:
            asyncio.get_running_loop().create_task(self.transport.add_peer(member.name, member.nixl_metadata))
        self.peers.join(member)
        self._fresh.add(member.name)
        self._members_changed = True

    def _left(self, member: Member) -> None:
        if self.transport is not None:
            asyncio.get_running_loop().create_task(self.transport.remove_peer(member.name))
        self.peers.leave(member)
        self.shard.drop_node(member.name)
        self._fresh.discard(member.name)
        self._members_changed = True

    def _rejoined_as_new(self) -> None:
        """Peers saw this node leave: they dropped its entries and it missed their removals.
        Start its shard over, and send every held key to its owner again."""
        self.shard.clear()
        self._fresh.update(member.name for member in self.view.members())
        self._fresh.add(self.name)
        self._members_changed = True
        log.info("rejoined after the member key expired: directory shard cleared, blocks re-published")

    async def lookup(self, namespace_id: bytes, packed: bytes, local_matched: int) -> LookupAnswer:
        return await self.router.lookup(namespace_id, packed, local_matched)

    async def price(self, namespace_id: bytes, packed: bytes, nodes: list[NodeMatch]) -> list[NodeMatch]:
        return await self.router.price(namespace_id, packed, nodes)

    async def _publish_loop(self) -> None:
        interval = self.config.cluster.publish_interval_ms / 1000
        while True:
            await asyncio.sleep(interval)
            try:
                await self.publish_once()
            except Exception:  # a bug here must not end publishing for the daemon's life
                log.exception("directory publishing failed; retrying")

    async def publish_once(self) -> None:
        if self._members_changed and self.name in self.view:
            names = [member.name for member in self.view.members()]
            fresh, self._fresh, self._members_changed = self._fresh, set(), False
            self.publisher.set_members(names, fresh)
            self.router.set_members(names)
        self.publisher.poll()
        batches = self.publisher.take()
        await asyncio.gather(*(self._send(owner, stored, removed) for owner, (stored, removed) in batches.items()))

    async def _send(self, owner: str, stored: list[bytes], removed: list[bytes]) -> None:
        if owner == self.name:
            self.shard.remove(self.name, removed)
            self.shard.add(self.name, stored)
            return
        stub = self.peers.stub(owner)
        if stub is None:
            return  # the owner left: set_members re-queues its keys for the new owner
        request = wire.directory_update_request(self.name, self.member.incarnation, stored, removed)
        try:
            await stub.DirectoryUpdate(request, timeout=self.config.cluster.rpc_timeout_s, metadata=self.peers.metadata)
            self.updates_sent += 1
        except grpc.RpcError as error:
            self.updates_failed += 1
            # FAILED_PRECONDITION: the owner has not seen this node join yet; it will.
            level = logging.DEBUG if error.code() == grpc.StatusCode.FAILED_PRECONDITION else logging.WARNING
            log.log(level, "directory update not delivered", extra={"owner": owner, "code": str(error.code()),
                                                                 "keys": len(stored) + len(removed)})
            if owner in self.view:
                self.publisher.requeue(owner, stored, removed)

    async def close(self) -> None:
        if self.membership is not None:
            await self.membership.close()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.peers.close()
        if self.transport is not None:
            await self.transport.close()
