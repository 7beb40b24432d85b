"""The drain's side of stopping the gRPC server (kvd.server.drain) and of the
service's waits (KvdService.start_draining), in process."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import grpc
import pytest

from kvd.errors import ResourceExhausted
from kvd.server import drain
from kvd.server.handlers import reads as reads_handlers
from kvd.server.drain import RpcTracker, stop_server
from kvd.server.service import KvdService


def drain_records(caplog, level: int) -> list[logging.LogRecord]:
    return [record for record in caplog.records if record.name == "kvd.server.drain" and record.levelno == level]


def test_the_grace_period_running_out_names_the_rpcs_still_running(caplog):
    """Calls a handler keeps past the grace period: one warning names their
    methods and counts, then they are cancelled."""
    caplog.set_level(logging.INFO, logger="kvd.server.drain")

    async def scenario():
        release = asyncio.Event()
        entered = []

        async def hold(request, context):
            entered.append(request)
            await release.wait()
            return request

        def identity(data):
            return data

        tracker = RpcTracker()
        server = grpc.aio.server(interceptors=[tracker])
        handlers = {name: grpc.unary_unary_rpc_method_handler(hold, identity, identity) for name in ("Slow", "Slower")}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.Held", handlers),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        recorded = RecordingServer(server)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            calls = [channel.unary_unary(f"/t.Held/{name}")(b"x", timeout=300) for name in ("Slow", "Slow", "Slower")]
            while len(entered) < 3:
                await asyncio.sleep(0)
            assert tracker.running() == {"t.Held/Slow": 2, "t.Held/Slower": 1}
            started = time.monotonic()
            await stop_server(recorded, 0.3, tracker)
            elapsed = time.monotonic() - started
            codes = []
            for call in calls:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await call
                codes.append(error.value.code())
        release.set()
        return elapsed, codes, tracker.running(), recorded.stops

    elapsed, codes, running_after, stops = asyncio.run(scenario())
    assert elapsed >= 0.3  # the grace period was given
    assert stops == [0.3 + drain.BACKSTOP_S, 0]  # and kvd cut it, not gRPC's backstop
    assert set(codes) <= {grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE}, codes
    assert running_after == {}
    [warning] = drain_records(caplog, logging.WARNING)
    assert warning.rpcs_running == 3
    assert warning.rpcs == "t.Held/Slow=2, t.Held/Slower=1"
    assert "t.Held/Slow=2, t.Held/Slower=1" in warning.getMessage()
    assert warning.grace_period_s == 0.3
    assert not drain_records(caplog, logging.INFO)


def test_a_drain_with_nothing_running_is_quiet_and_quick(caplog):
    caplog.set_level(logging.INFO, logger="kvd.server.drain")

    async def scenario():
        tracker = RpcTracker()
        server = grpc.aio.server(interceptors=[tracker])
        server.add_insecure_port("127.0.0.1:0")
        await server.start()
        recorded = RecordingServer(server)
        await stop_server(recorded, 300.0, tracker)
        return recorded.stops

    # gRPC stopped on its own: kvd never had to cancel anything.
    assert asyncio.run(scenario()) == [300.0 + drain.BACKSTOP_S]
    assert not [record for record in caplog.records if record.name == "kvd.server.drain"]


class StrandingServer:
    """A grpc.aio.Server whose stop(grace) waits for a call no handler ever
    saw, the way gRPC core strands one that arrives as it shuts down: only
    a stop(0) (cancel_all_calls) or the end of the grace period ends it."""

    def __init__(self) -> None:
        self.stops: list[float] = []
        self._cancelled = asyncio.Event()

    async def stop(self, grace: float | None) -> None:
        self.stops.append(grace)
        if not grace:
            self._cancelled.set()
            return
        try:
            await asyncio.wait_for(self._cancelled.wait(), grace)
        except TimeoutError:
            pass


class RecordingServer:
    """A real grpc.aio.Server, with the stop calls made on it recorded."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server
        self.stops: list[float | None] = []

    async def stop(self, grace: float | None) -> None:
        self.stops.append(grace)
        await self.server.stop(grace)


def test_calls_grpc_never_dispatched_are_cancelled_once_every_dispatched_one_has_ended(caplog):
    caplog.set_level(logging.INFO, logger="kvd.server.drain")

    async def scenario():
        tracker = RpcTracker()
        server = StrandingServer()
        started = time.monotonic()
        await stop_server(server, 300.0, tracker)
        return time.monotonic() - started, server.stops

    elapsed, stops = asyncio.run(scenario())
    assert elapsed >= drain.STRANDED_SETTLE_S
    assert stops == [300.0 + drain.BACKSTOP_S, 0]  # kvd cancelled them: the grace period did not run out
    [record] = drain_records(caplog, logging.INFO)
    assert "never dispatched" in record.getMessage()
    assert not drain_records(caplog, logging.WARNING)


def test_stranded_calls_wait_for_the_dispatched_calls_still_running(caplog):
    """A dispatched call still running is the drain's to wait for: nothing is
    cancelled until it ends and the settle time has passed."""
    caplog.set_level(logging.INFO, logger="kvd.server.drain")

    async def scenario():
        tracker = RpcTracker()
        release = asyncio.Event()

        async def call():
            async def continuation(details):
                return None

            await tracker.intercept_service(continuation, SimpleNamespace(method="/kvd.v1.Kvd/PutInline"))
            await release.wait()

        task = asyncio.create_task(call())
        await asyncio.sleep(0)
        assert tracker.running() == {"kvd.v1.Kvd/PutInline": 1}
        server = StrandingServer()
        started = time.monotonic()
        asyncio.get_running_loop().call_later(0.5, release.set)
        await stop_server(server, 300.0, tracker)
        await task
        return time.monotonic() - started, server.stops

    elapsed, stops = asyncio.run(scenario())
    assert elapsed >= 0.5 + drain.STRANDED_SETTLE_S  # it waited for the running call, then the settle time
    assert stops == [300.0 + drain.BACKSTOP_S, 0]  # and then kvd cancelled what gRPC stranded
    assert len(drain_records(caplog, logging.INFO)) == 1
    assert not drain_records(caplog, logging.WARNING)


def test_a_second_stop_ends_the_drain_at_once(caplog):
    caplog.set_level(logging.INFO, logger="kvd.server.drain")

    async def scenario():
        tracker = RpcTracker()
        tracker.last_change = float("inf")  # a call always just ended: never taken for stranded
        server = StrandingServer()
        asyncio.get_running_loop().call_later(0.1, lambda: asyncio.ensure_future(server.stop(0)))
        await stop_server(server, 300.0, tracker)
        return server.stops

    # The drain ended with the second stop, the only stop(0): the grace period never ran out.
    assert asyncio.run(scenario()) == [300.0 + drain.BACKSTOP_S, 0]
    assert not [record for record in caplog.records if record.name == "kvd.server.drain"]


# ----------------------------------------------------------------------
# KvdService.start_draining: the service's own waits end with the drain.


def service_with(engine, disk_plane) -> KvdService:
    clock = SimpleNamespace(now_ms=lambda: 0)
    return KvdService(engine, arena=None, clock=clock, metrics=None, max_message_bytes=1 << 20, disk_plane=disk_plane)


def test_a_starved_get_stops_waiting_for_write_back_when_the_drain_starts(monkeypatch):
    plans = []

    class Engine:
        def begin_get(self, *arguments):
            plan = SimpleNamespace(starved=not plans, number=len(plans), matched=[], loads=[], waits=[])
            plans.append(plan)
            return plan

        def abandon_get(self, plan):
            plan.abandoned = True

        # What GetLife takes from the engine once it has a plan (nothing found here).
        def tier_bytes(self, blocks):
            return b""

        def host_offsets(self, blocks):
            return []

        def load_offsets(self, loads):
            return []

        def namespace(self, namespace_id):
            return SimpleNamespace(spec=None)

    class DiskPlane:
        waits = 0
        # Write-back is pending, so a starved Get waits (kvd.core.get_life).
        mover = SimpleNamespace(starved_gets=0, starved_get_waits=lambda now, deadline: True,
                                after_round=lambda: None)

        async def wait_for_round(self, timeout_s):
            self.waits += 1
            self.waiting.set()
            await asyncio.Event().wait()  # a write round that never ends

    async def scenario():
        disk_plane = DiskPlane()
        disk_plane.waiting = asyncio.Event()
        service = service_with(Engine(), disk_plane)
        request = SimpleNamespace(namespace_id=b"n", keys=[b"k"], lease_ms=0, parent_key=b"")
        getting = asyncio.create_task(service._begin_get(request, "client"))
        await disk_plane.waiting.wait()
        assert not getting.done() and disk_plane.waits == 1 and disk_plane.mover.starved_gets == 1
        service.start_draining()
        # Only the drain can end the wait: the starved Get's own timeout is a day here.
        return await asyncio.wait_for(getting, 60), disk_plane.mover

    monkeypatch.setattr(reads_handlers, "STARVED_GET_WAIT_S", 86400.0)
    life, mover = asyncio.run(scenario())
    # The starved plan was given back, and the Get took what it could.
    assert plans[0].abandoned and life.plan is plans[1] and mover.starved_gets == 0


def test_a_reserve_waiting_for_a_write_batch_tries_again_when_the_drain_starts():
    attempts = []

    class Engine:
        def reserve(self, *arguments):
            attempts.append(arguments)
            raise ResourceExhausted("host tier full")

    async def scenario():
        disk_plane = SimpleNamespace(writes_idle=asyncio.Event())  # a write batch in flight, for good
        service = service_with(Engine(), disk_plane)
        request = SimpleNamespace(namespace_id=b"n", client_id="c", parent_key=b"", keys=[b"k"])
        reserving = asyncio.create_task(service._reserve(request, 0))
        while not attempts:
            await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not reserving.done() and len(attempts) == 1  # waiting for the write batch, which never ends
        service.start_draining()
        with pytest.raises(ResourceExhausted):
            await asyncio.wait_for(reserving, 60)  # only the drain ends that wait
        # Once draining, a full host tier is refused at once (no wait: writes_idle is never set).
        with pytest.raises(ResourceExhausted):
            await asyncio.wait_for(service._reserve(request, 0), 60)

    asyncio.run(scenario())
    assert len(attempts) == 3
