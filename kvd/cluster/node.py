"""This daemon's place in the cluster: its member record and the membership task.

Built by the daemon when `[cluster] etcd_endpoints` is set, after the
listeners are bound (the record carries the bound TCP port). Membership
runs as a task for the daemon's life and never stops the daemon: with etcd
out of reach the local tiers keep serving and the view stays as last seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

from kvd.cluster.members import Member, MemberView
from kvd.cluster.membership import EtcdSettings, Membership
from kvd.config import Config, parse_address


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


class ClusterNode:
    def __init__(self, config: Config, bound_tcp_port: int | None, disk_capacity_bytes: int) -> None:
        name = node_name(config)
        self.member = Member(
            name=name,
            address=advertised_address(config, bound_tcp_port),
            # New on every start: peers tell this process from an earlier one.
            incarnation=time.time_ns(),
            host_capacity_bytes=config.host.capacity_bytes,
            disk_capacity_bytes=disk_capacity_bytes,
        )
        self.view = MemberView(name)
        self.membership = Membership(etcd_settings(config), self.member, self.view)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.membership.run(), name="cluster-membership")

    async def close(self) -> None:
        await self.membership.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
