"""Cluster membership through etcd: a leased member key, kept alive and watched.

One `Membership` per daemon runs `run()` as a task for the daemon's life.
Each pass of its loop is a *session*:

1. connect to the next etcd endpoint (round robin over the configured ones);
2. grant a lease of `lease_ttl_s`, and create this node's member key under
   it (a transaction: the key must not exist, or must belong to an earlier
   process of this node at the same address, whose lease is then left to
   expire on its own);
3. read every member key (one range read) into the view, then watch the
   prefix from the revision after that read, so no change falls between;
4. refresh the lease every `lease_ttl_s / 3` until a refresh, the watch or
   the connection fails, or the lease is found expired.

Any failure ends the session: the view is kept as last seen (a daemon keeps
serving its own tiers whatever etcd does) and `joined` drops, so callers
can tell the view may be stale; after a back-off the next session rejoins
and its snapshot corrects the view. On `close()` the lease is revoked, so
peers see this node leave at once rather than after the TTL.

NIXL's own etcd metadata exchange is not used: its keys carry no lease, so
a dead agent's metadata would stay forever (FIELD-NOTES). The member record
carries the NIXL metadata instead, and lives and dies with the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aetcd
import aetcd.exceptions
import grpc

from kvd.clock import Clock, MonotonicClock
from kvd.cluster.members import Member, MemberView, RecordError

log = logging.getLogger("kvd.cluster")

# Reconnects after a partition take the gRPC default back-off (up to 120 s)
# unless lowered (FIELD-NOTES).
_CHANNEL_OPTIONS = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
}
_ETCD_ERRORS = (aetcd.exceptions.ClientError, grpc.RpcError, asyncio.TimeoutError, OSError)


@dataclass(slots=True)
class EtcdSettings:
    endpoints: Sequence[tuple[str, int]]
    key_prefix: str = "/kvd/"
    lease_ttl_s: int = 5
    # Every etcd call's deadline.
    timeout_s: float = 2.0
    # Back-off between sessions: doubles from min to max.
    retry_min_s: float = 0.2
    retry_max_s: float = 2.0
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""

    def member_key(self, name: str) -> bytes:
        return f"{self.key_prefix}members/{name}".encode()

    @property
    def members_prefix(self) -> bytes:
        return f"{self.key_prefix}members/".encode()


class _Client(aetcd.Client):
    """aetcd's client, on a TLS channel when certificates are configured."""

    def __init__(self, host: str, port: int, settings: EtcdSettings) -> None:
        super().__init__(host, port, timeout=settings.timeout_s, options=dict(_CHANNEL_OPTIONS))
        self._settings = settings

    async def connect(self) -> None:
        await super().connect()
        if not self._settings.tls_ca_file:
            return
        # Swap the insecure channel aetcd opened for a TLS one before any call.
        await self.channel.close()
        credentials = grpc.ssl_channel_credentials(*_read_pem(self._settings))
        self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}", credentials,
                                               options=list(_CHANNEL_OPTIONS.items()))
        self.kvstub = aetcd.rpc.KVStub(self.channel)
        self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
        self.leasestub = aetcd.rpc.LeaseStub(self.channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
        self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel), timeout=self._timeout)


def _read_pem(settings: EtcdSettings) -> tuple[bytes, bytes | None, bytes | None]:
    def read(path: str) -> bytes | None:
        if not path:
            return None
        with open(path, "rb") as file:
            return file.read()
    return read(settings.tls_ca_file), read(settings.tls_key_file), read(settings.tls_cert_file)


class Membership:
    def __init__(self, settings: EtcdSettings, member: Member, view: MemberView,
                 clock: Clock | None = None) -> None:
        member.validate()
        self.settings = settings
        self.member = member
        self.view = view
        self.clock = clock or MonotonicClock()
        # Set while a session holds a live lease and a watch; waiters use it.
        self.joined = asyncio.Event()
        self.sessions = 0
        # Sessions that ended in an etcd error (connect, lease, key, watch or refresh).
        self.failed_sessions = 0
        # Called when a session had to create the member key anew after an
        # earlier session: the key had expired, so every peer saw this node leave.
        self.on_rejoined_as_new: Callable[[], None] | None = None
        self._closing = False
        self._client: _Client | None = None
        self._lease_id: int | None = None
        self._endpoint = 0

    async def run(self) -> None:
        """Hold membership until cancelled or closed; never raises an etcd error."""
        delay = self.settings.retry_min_s
        while not self._closing:
            try:
                await self._session()
                delay = self.settings.retry_min_s
            except _ETCD_ERRORS as error:
                self.failed_sessions += 1
                log.warning("etcd session ended", extra={"node": self.member.name, "reason": _describe(error)})
            finally:
                self.joined.clear()
                await self._disconnect()
            if not self._closing:
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.retry_max_s)

    async def close(self) -> None:
        """Leave: revoke the lease (best effort) so peers see the leave now."""
        self._closing = True
        client, lease_id = self._client, self._lease_id
        if client is not None and lease_id is not None:
            with contextlib.suppress(*_ETCD_ERRORS):
                await asyncio.wait_for(client.revoke_lease(lease_id), self.settings.timeout_s)
        await self._disconnect()

    async def _session(self) -> None:
        settings = self.settings
        host, port = settings.endpoints[self._endpoint % len(settings.endpoints)]
        self._endpoint += 1
        self._client = client = _Client(host, port, settings)
        await asyncio.wait_for(client.connect(), settings.timeout_s)
        lease = await client.lease(settings.lease_ttl_s)
        self._lease_id = lease.id
        await self._claim_key(client, lease.id)
        revision = await self._load_view(client)
        watch = await client.watch_prefix(settings.members_prefix, start_revision=revision + 1)
        self.sessions += 1
        self.joined.set()
        log.info("joined the cluster", extra={"node": self.member.name, "etcd": f"{host}:{port}",
                                              "members": len(self.view), "lease_ttl_s": settings.lease_ttl_s})
        watching = asyncio.ensure_future(self._follow(watch))
        try:
            await self._keep_alive(client, lease.id, watching)
        finally:
            watching.cancel()
            with contextlib.suppress(asyncio.CancelledError, *_ETCD_ERRORS):
                await watching

    async def _claim_key(self, client: _Client, lease_id: int) -> None:
        """Create the member key under the lease, waiting out a stale one of another process."""
        key, value = self.settings.member_key(self.member.name), self.member.encode()
        tx = client.transactions
        while True:
            created, responses = await client.transaction(
                compare=[tx.create(key) == 0],
                success=[tx.put(key, value, lease_id)],
                failure=[tx.get(key)])
            if created:
                if self.sessions and self.on_rejoined_as_new is not None:
                    self.on_rejoined_as_new()
                return
            held = _decode_held(responses)
            if held is not None and held[0].address == self.member.address:
                # An earlier process of this node (a restart): its lease dies
                # with it, but may not have expired yet. Take the key over.
                await client.put(key, value, lease=lease_id)
                return
            holder = held[0].address if held is not None else "?"
            log.warning("node name held by another member; waiting for its lease",
                        extra={"node": self.member.name, "holder_address": holder})
            await asyncio.sleep(self.settings.lease_ttl_s / 3)

    async def _load_view(self, client: _Client) -> int:
        prefix = self.settings.members_prefix
        snapshot = await client.get_prefix(prefix)
        members = []
        for kv in snapshot:
            member = _parse(kv.key, kv.value, prefix)
            if member is not None:
                members.append(member)
        self.view.replace(members)
        return snapshot.header.revision

    async def _follow(self, watch) -> None:
        prefix = self.settings.members_prefix
        async for event in watch:
            name = event.kv.key[len(prefix):].decode(errors="replace")
            if event.kind == "DELETE":
                self.view.delete(name)
                continue
            member = _parse(event.kv.key, event.kv.value, prefix)
            if member is not None:
                self.view.put(member)
        raise ConnectionError("the member watch ended")

    async def _keep_alive(self, client: _Client, lease_id: int, watching: asyncio.Future) -> None:
        interval = self.settings.lease_ttl_s / 3
        while True:
            done, _ = await asyncio.wait([watching], timeout=interval)
            if done:
                watching.result()  # raises what ended the watch
                raise ConnectionError("the member watch ended")
            reply = await asyncio.wait_for(client.refresh_lease(lease_id), self.settings.timeout_s)
            if reply is None or reply.TTL <= 0:
                raise ConnectionError("the member lease expired")

    async def _disconnect(self) -> None:
        client, self._client, self._lease_id = self._client, None, None
        if client is not None:
            with contextlib.suppress(*_ETCD_ERRORS):
                await asyncio.wait_for(client.close(), self.settings.timeout_s)


def _parse(key: bytes, value: bytes, prefix: bytes) -> Member | None:
    try:
        member = Member.decode(value)
    except RecordError as error:
        log.warning("member record ignored", extra={"key": key.decode(errors="replace"), "reason": str(error)})
        return None
    if key != prefix + member.name.encode():
        log.warning("member record ignored", extra={"key": key.decode(errors="replace"),
                                                    "reason": f"names node {member.name!r}"})
        return None
    return member


def _decode_held(responses) -> tuple[Member, int] | None:
    for kvs in responses:
        for value, meta in kvs:
            try:
                return Member.decode(value), meta.mod_revision
            except RecordError:
                return None
    return None


def _describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
