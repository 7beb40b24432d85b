"""Membership against a real etcd: join, leave, crash, partition, restart, name clashes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

import aetcd

from kvd.cluster.members import Member, MemberView
from kvd.cluster.membership import EtcdSettings, Membership
from kvd.testing.certs import make_certificates
from kvd.testing.etcd import EtcdServer

TTL_S = 2
_prefixes = itertools.count()


class Node:
    """One member plus an event its view sets on every change."""

    def __init__(self, settings: EtcdSettings, name: str, port: int, incarnation: int = 1) -> None:
        # An Event, not a Condition: a Condition.wait cancelled by wait_for must take its
        # lock back before the timeout can be raised, and on CPython 3.11 one CI run hung
        # there for the whole test timeout instead of failing after the bound.
        self.changed = asyncio.Event()
        self.changes: list[tuple[str, str, int]] = []
        self.view = MemberView(name, on_join=lambda m: self._note("join", m),
                               on_leave=lambda m: self._note("leave", m))
        member = Member(name, f"127.0.0.1:{port}", incarnation, host_capacity_bytes=1 << 30)
        self.membership = Membership(settings, member, self.view)
        self.task: asyncio.Task | None = None

    def _note(self, what: str, member: Member) -> None:
        self.changes.append((what, member.name, member.incarnation))
        self.changed.set()

    def start(self) -> Node:
        self.task = asyncio.create_task(self.membership.run())
        return self

    async def until(self, predicate, timeout_s: float = 10.0) -> float:
        """Wait for the view to satisfy predicate; returns the seconds it took.

        Fails after timeout_s with what the view holds, so a hang reads as a finding."""
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            self.changed.clear()
            if predicate(self.view):
                return time.monotonic() - started
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"{self.view.self_name}'s view was {sorted(self.names())} after {timeout_s} s; "
                    f"changes {self.changes}; sessions {self.membership.sessions}, "
                    f"failed {self.membership.failed_sessions}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), remaining)

    def names(self) -> set[str]:
        return {member.name for member in self.view.members()}

    async def crash(self) -> None:
        """Stop without revoking the lease, as SIGKILL would."""
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def close(self) -> None:
        await self.membership.close()
        await self.crash()


def settings_for(*servers: EtcdServer, ttl_s: int = TTL_S) -> EtcdSettings:
    return EtcdSettings(endpoints=[(s.host, s.client_port) for s in servers],
                        key_prefix=f"/kvd-test-{next(_prefixes)}/", lease_ttl_s=ttl_s, timeout_s=1.0)


async def stored_member(server: EtcdServer, settings: EtcdSettings, name: str) -> bytes | None:
    """The member key as etcd holds it now (None: gone)."""
    async with aetcd.Client(server.host, server.client_port) as client:
        found = await client.get(settings.member_key(name))
    return None if found is None else found.value


def names_are(*names: str):
    return lambda view: {member.name for member in view.members()} == set(names)


def test_members_see_each_other_and_a_clean_leave(etcd):
    async def scenario():
        settings = settings_for(etcd)
        a, b, c = (Node(settings, name, port).start() for name, port in (("a", 7001), ("b", 7002), ("c", 7003)))
        for node in (a, b, c):
            await node.until(names_are("a", "b", "c"))
            await asyncio.wait_for(node.membership.joined.wait(), 5)
        assert [m.name for m in a.view.peers()] == ["b", "c"]
        assert b.view.get("a").address == "127.0.0.1:7001" and b.view.get("a").host_capacity_bytes == 1 << 30
        # A clean close revokes the lease: c's key is gone when close returns (not at the
        # TTL), and the others follow etcd's delete.
        await c.close()
        assert await stored_member(etcd, settings, "c") is None
        await a.until(names_are("a", "b"))
        await b.until(names_are("a", "b"))
        assert ("leave", "c", 1) in a.changes
        for node in (a, b):
            await node.close()
    asyncio.run(scenario())


def test_a_crashed_member_leaves_within_the_lease_ttl(etcd):
    async def scenario():
        settings = settings_for(etcd)
        a, b = Node(settings, "a", 7001).start(), Node(settings, "b", 7002).start()
        await a.until(names_are("a", "b"))
        await b.until(names_are("a", "b"))
        await b.crash()
        try:
            # Nothing refreshes b's lease any more: etcd drops its key once the TTL has run
            # since the last refresh (at most TTL/3 before the crash), never sooner, and a
            # follows etcd's delete. (Waits on the events; the bound only catches a hang.)
            took = await a.until(names_are("a"), timeout_s=TTL_S + 30)
            assert took >= TTL_S * 2 / 3 - 0.1, (took, a.changes)
            assert await stored_member(etcd, settings, "b") is None
            assert a.changes[-1] == ("leave", "b", 1), (a.changes, a.membership.failed_sessions)
        finally:
            # Closed on failure too: a member left running held asyncio.run's shutdown for the
            # whole test timeout (600 s) in one fresh-clone run.
            await asyncio.wait_for(a.close(), 10)
    asyncio.run(scenario())


def test_members_ride_out_an_etcd_restart(tmp_path):
    async def scenario(server: EtcdServer):
        settings = settings_for(server)
        a, b = Node(settings, "a", 7001).start(), Node(settings, "b", 7002).start()
        await a.until(names_are("a", "b"))
        await b.until(names_are("a", "b"))
        await asyncio.wait_for(a.membership.joined.wait(), 5)
        sessions = a.membership.sessions
        server.stop()
        # The sessions end; the views stay as last seen (local tiers keep serving).
        while a.membership.joined.is_set() or b.membership.joined.is_set():
            await asyncio.sleep(0.05)
        assert a.names() == {"a", "b"}
        server.start()
        for node in (a, b):
            await asyncio.wait_for(node.membership.joined.wait(), TTL_S + 5)
            await node.until(names_are("a", "b"))
        assert a.membership.sessions == sessions + 1
        # The rejoined keys are alive under the new leases: a crash is still seen.
        await b.crash()
        await a.until(names_are("a"), timeout_s=TTL_S + 5)
        await a.close()
    server = EtcdServer().start()
    try:
        asyncio.run(scenario(server))
    finally:
        server.close()


def test_a_restarted_node_takes_its_key_over_with_a_new_incarnation(etcd):
    # A longer lease than the other tests': the takeover must come before the old lease runs
    # out, and a loaded machine (make test runs two groups at once) may take seconds to start b2.
    ttl_s = 3 * TTL_S

    async def scenario():
        settings = settings_for(etcd, ttl_s=ttl_s)
        a, b = Node(settings, "a", 7001).start(), Node(settings, "b", 7002, incarnation=1).start()
        await a.until(names_are("a", "b"))
        await b.crash()
        # Same name and address, restarted before the old lease ran out.
        b2 = Node(settings, "b", 7002, incarnation=2).start()
        await a.until(lambda view: view.get("b") is not None and view.get("b").incarnation == 2,
                      timeout_s=ttl_s - 1)
        assert a.changes[-2:] == [("leave", "b", 1), ("join", "b", 2)]
        # The old lease expiring later must not delete the new process's key.
        await asyncio.sleep(ttl_s + 0.5)
        assert a.view.get("b").incarnation == 2
        await b2.close()
        await a.close()
    asyncio.run(scenario())


def test_a_name_held_by_another_address_waits(etcd):
    async def scenario():
        settings = settings_for(etcd)
        first = Node(settings, "x", 7001).start()
        await asyncio.wait_for(first.membership.joined.wait(), 5)
        second = Node(settings, "x", 7999, incarnation=5).start()
        observer = Node(settings, "o", 7003).start()
        await observer.until(names_are("o", "x"))
        await asyncio.sleep(TTL_S / 2)
        assert not second.membership.joined.is_set()
        assert observer.view.get("x").address == "127.0.0.1:7001"
        await first.close()
        await asyncio.wait_for(second.membership.joined.wait(), TTL_S + 3)
        await observer.until(lambda view: view.get("x") is not None and view.get("x").address == "127.0.0.1:7999")
        for node in (second, observer):
            await node.close()
    asyncio.run(scenario())


def test_garbage_under_the_prefix_is_ignored(etcd):
    async def scenario():
        settings = settings_for(etcd)
        client = aetcd.Client(etcd.host, etcd.client_port)
        await client.connect()
        prefix = settings.members_prefix
        await client.put(prefix + b"junk", b"\xff not json")
        await client.put(prefix + b"liar", Member("someone-else", "127.0.0.1:1", 1).encode())
        await client.put(prefix + b"neg", b'{"version":1,"name":"neg","address":"h:1","incarnation":-1,'
                                           b'"host_capacity_bytes":0,"disk_capacity_bytes":0,"nixl_metadata":""}')
        a = Node(settings, "a", 7001).start()
        await a.until(names_are("a"))
        await client.put(prefix + b"junk2", b"[]")
        b = Node(settings, "b", 7002).start()
        await a.until(names_are("a", "b"))
        assert a.names() == {"a", "b"}
        await client.close()
        for node in (a, b):
            await node.close()
    asyncio.run(scenario())


def test_membership_over_mutual_tls(tmp_path):
    certs = make_certificates(tmp_path / "certs")

    async def scenario(server: EtcdServer):
        settings = settings_for(server)
        settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file = (
            str(certs.ca), str(certs.client_cert), str(certs.client_key))
        a, b = Node(settings, "a", 7001).start(), Node(settings, "b", 7002).start()
        await a.until(names_are("a", "b"))
        await asyncio.wait_for(b.membership.joined.wait(), 5)
        # A member without a client certificate never joins (etcd refuses it).
        plain = settings_for(server)
        plain.key_prefix = settings.key_prefix
        outsider = Node(plain, "outsider", 7003).start()
        async def refused_twice():
            while outsider.membership.failed_sessions < 2:
                await asyncio.sleep(0.05)
        await asyncio.wait_for(refused_twice(), 15)
        assert outsider.membership.sessions == 0 and "outsider" not in a.view
        await outsider.crash()
        for node in (a, b):
            await node.close()

    server = EtcdServer(host="127.0.0.1", tls=certs).start()
    try:
        asyncio.run(scenario(server))
    finally:
        server.close()
