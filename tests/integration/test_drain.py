"""The drain on SIGTERM, through a real daemon: what may hold it, and what it says.

See kvd.server.drain and Daemon.shutdown. The drain ends every stream that
would otherwise never end (event streams, health watches) and stops
starved Gets waiting; what still runs when the grace period is over is
named in one warning, then cancelled.
"""

from __future__ import annotations

import json
import signal
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.client import Client
from kvd.testing.daemon import log_problems, start_daemon
from kvd.v1 import kvd_pb2, kvd_pb2_grpc
from tests.integration.test_events import TINY_SPEC

# The client does not let its flow-control window grow (BDP probing off):
# a few events it does not read fill it.
NO_WINDOW_GROWTH = [("grpc.http2.bdp_probe", 0)]


def records(log: str, message_part: str) -> list[dict]:
    found = []
    for line in log.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if message_part in record.get("msg", ""):
            found.append(record)
    return found


def block_a_subscriber(client: Client, channel: grpc.Channel):
    """A WatchEvents stream left blocked in gRPC flow control, sending an
    event its subscriber does not read: the drain cannot end it. Keep the
    stream returned: dropped, its call would be cancelled."""
    namespace = client.register_namespace(TINY_SPEC)
    stream = kvd_pb2_grpc.KvdStub(channel).WatchEvents(kvd_pb2.WatchEventsRequest(namespace_id=namespace.namespace_id))
    assert next(stream).kind == kvd_pb2.KV_EVENT_KIND_WATCHING
    # Each Put evicts the other round: events of 4,096 keys (~140 KB) each,
    # far more than the window; the subscriber reads none.
    blocks = np.zeros((4096, *TINY_SPEC.block_shape), dtype=np.float32)
    rounds = [namespace.keys(np.arange(4096 * 16) + 10**7 * n) for n in range(2)]
    for number in range(10):
        client.put(namespace, rounds[number % 2], blocks)
    return stream


TINY_HOST = {"capacity_bytes": 16 << 20, "slot_bytes": 4096}
CUT_SHORT = (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)


def end_of(stream) -> grpc.StatusCode:
    """How a stream ends, once what it buffered has been read."""
    try:
        for _ in stream:
            pass
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_the_rpcs_still_running_when_the_grace_period_ends_are_named(tmp_path):
    """A subscriber that stopped reading holds its stream past the grace
    period; one warning then says what was still running."""
    grace_s = 1.0
    daemon = start_daemon(tmp_path, config={"host": TINY_HOST, "server": {"grace_period_s": grace_s}})
    try:
        with Client(daemon.unix_target) as client, \
                grpc.insecure_channel(daemon.unix_target, options=NO_WINDOW_GROWTH) as channel:
            stream = block_a_subscriber(client, channel)
            started = time.monotonic()
            assert daemon.stop(signal.SIGTERM) == 0
            elapsed = time.monotonic() - started
            assert end_of(stream) in CUT_SHORT
        log = daemon.log()
        assert grace_s <= elapsed < grace_s + 10
        [warning] = records(log, "grace period of")
        assert warning["level"] == "warning"
        assert warning["rpcs_running"] == 1
        assert warning["rpcs"] == "kvd.v1.Kvd/WatchEvents=1"
        assert "kvd.v1.Kvd/WatchEvents=1" in warning["msg"]
        assert warning["grace_period_s"] == grace_s
        assert not log_problems(log), log_problems(log)
    finally:
        daemon.stop(signal.SIGKILL)


def test_a_second_signal_cuts_the_grace_period_short_and_names_what_it_cancels(tmp_path):
    daemon = start_daemon(tmp_path, config={"host": TINY_HOST, "server": {"grace_period_s": 30.0}})
    try:
        with Client(daemon.unix_target) as client, \
                grpc.insecure_channel(daemon.unix_target, options=NO_WINDOW_GROWTH) as channel:
            stream = block_a_subscriber(client, channel)
            started = time.monotonic()
            daemon.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            # The second signal once the drain waits for the stream (what the daemon logs there), not
            # after a fixed pause that a loaded machine can outlast.
            while not records(daemon.log(), "waiting for in-flight RPCs") and time.monotonic() < deadline:
                time.sleep(0.05)
            assert daemon.stop(signal.SIGTERM) == 0
            assert time.monotonic() - started < 10  # not the 30 s grace period
            assert end_of(stream) in CUT_SHORT
        log = daemon.log()
        [warning] = records(log, "second stop signal")
        assert warning["rpcs"] == "kvd.v1.Kvd/WatchEvents=1" and warning["rpcs_running"] == 1
        assert not records(log, "grace period of")
        assert not log_problems(log), log_problems(log)
    finally:
        daemon.stop(signal.SIGKILL)


def test_health_watches_end_when_the_daemon_drains(tmp_path):
    """grpc_health's own Watch streams never end and would each hold the
    drain for the whole grace period: here a watcher is told NOT_SERVING and
    its stream ends (OK), and nothing is left for the grace period to cut."""
    daemon = start_daemon(tmp_path, config={"server": {"grace_period_s": 30.0}})
    try:
        with grpc.insecure_channel(daemon.unix_target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watches = [stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=60)
                       for service in ("", "kvd.v1.Kvd", "not.a.Service")]
            firsts = [next(watch).status for watch in watches]
            assert firsts == [health_pb2.HealthCheckResponse.SERVING] * 2 + [
                health_pb2.HealthCheckResponse.SERVICE_UNKNOWN]
            started = time.monotonic()
            assert daemon.stop(signal.SIGTERM) == 0
            assert time.monotonic() - started < 10  # not the 30 s grace period
            rests = [[message.status for message in watch] for watch in watches]  # each ends with OK
        assert rests == [[health_pb2.HealthCheckResponse.NOT_SERVING]] * 2 + [[]]
        log = daemon.log()
        assert not records(log, "grace period of")
        assert not log_problems(log), log_problems(log)
    finally:
        daemon.stop(signal.SIGKILL)
