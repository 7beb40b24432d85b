"""The sd_notify protocol as systemd's Type=notify and WatchdogSec= see it.

The test plays systemd: it binds the unix datagram socket that NOTIFY_SOCKET
names, starts the real daemon with a disk tier that holds durable blocks
from an earlier run, and reads what arrives, with the sender's credentials
(systemd's NotifyAccess=main drops messages from any other process).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec
from kvd.daemon.systemd import watchdog_interval_s
from kvd.testing.daemon import run_daemon, start_daemon
from kvd.v1 import kvd_pb2

SPEC = NamespaceSpec(model_id="notify-model", num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16,
                     kv_dtype=DType.FLOAT32)
DURABLE_BLOCKS = 8
# Keep-alives every 1 s, and systemd would call a gap of 2 s a hang: a
# second of slack for a busy machine's scheduling.
WATCHDOG_USEC = 2_000_000
KEEP_ALIVES = 3
# Not exported by Python's socket module; 29 in <asm-generic/socket.h> (x86-64, arm64).
SO_TIMESTAMP = getattr(socket, "SO_TIMESTAMP", 29)


def disk_config(directory: Path) -> dict:
    return {
        "host": {"capacity_bytes": 16 * (64 << 10), "slot_bytes": 64 << 10},
        "disk": {"directories": [str(directory / "nvme0"), str(directory / "nvme1")], "capacity_bytes": 8 << 20,
                 "slot_bytes": 64 << 10, "segment_bytes": 4 << 20},
    }


@dataclass
class Message:
    text: str
    pid: int
    at: float  # arrival, kernel time (CLOCK_REALTIME)
    # For READY=1: what the daemon answered at the moment it arrived.
    answered: dict = field(default_factory=dict)


class FakeSystemd:
    """A NOTIFY_SOCKET receiver. On READY=1 it checks at once, before the
    daemon can make progress that a test polling later would credit, that
    the daemon serves and has recovered the disk tier."""

    def __init__(self, keys: list[bytes]) -> None:
        self._directory = tempfile.mkdtemp(prefix="kvd-notify-")  # short: sun_path has 108 bytes
        self.path = os.path.join(self._directory, "notify")
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(self.path)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        # Arrival times stamped by the kernel as each datagram is queued, so a
        # busy test process cannot make the daemon's keep-alives look bunched.
        self._socket.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMP, 1)
        self._socket.settimeout(0.1)
        self._keys = keys
        self.unix_socket: str | None = None
        self.messages: list[Message] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._done.is_set():
            try:
                data, ancillary, _flags, _address = self._socket.recvmsg(
                    4096, socket.CMSG_SPACE(12) + socket.CMSG_SPACE(16))
            except TimeoutError:
                continue
            pid, at = -1, float("nan")
            for level, kind, payload in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid, _uid, _gid = struct.unpack("3i", payload[:12])
                elif level == socket.SOL_SOCKET and kind == SO_TIMESTAMP:
                    seconds, microseconds = struct.unpack("qq", payload[:16])
                    at = seconds + microseconds / 1e6
            message = Message(data.decode(), pid, at)
            if "READY=1" in message.text.split("\n"):
                message.answered = self._probe()
            self.messages.append(message)

    def _probe(self) -> dict:
        answered = {"socket": os.path.exists(self.unix_socket)}
        if not answered["socket"]:
            return answered
        target = f"unix://{self.unix_socket}"
        with grpc.insecure_channel(target) as channel:
            try:
                response = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                answered["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            except grpc.RpcError as error:
                answered["health"] = error.code().name
                return answered
        with Client(target) as client:
            lookup = client.lookup(client.register_namespace(SPEC), self._keys)
            answered["matched"] = lookup.matched
            answered["on_disk"] = sum(tier == kvd_pb2.TIER_DISK for tier in lookup.tiers)
        return answered

    def texts(self) -> list[str]:
        return [message.text for message in self.messages]

    def wait_for(self, text: str, timeout_s: float = 30.0, count: int = 1) -> Message:
        """The `count`th message holding `text` (the timeout only turns a hang into a failure)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [message for message in list(self.messages) if text in message.text.split("\n")]
            if len(found) >= count:
                return found[count - 1]
            time.sleep(0.01)
        raise AssertionError(f"no {count} x {text!r} within {timeout_s}s; got {self.texts()}")

    def close(self) -> None:
        self._done.set()
        self._thread.join()
        self._socket.close()
        shutil.rmtree(self._directory, ignore_errors=True)


def test_ready_after_recovery_watchdog_keep_alives_and_stopping(tmp_path):
    directory = tmp_path / "d"
    config = disk_config(tmp_path)
    keys: list[bytes]
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(DURABLE_BLOCKS * 16))
        blocks = np.random.default_rng(5).standard_normal((DURABLE_BLOCKS, *SPEC.block_shape), dtype=np.float32)
        assert client.put(namespace, keys, blocks, durable=True) == DURABLE_BLOCKS

    systemd = FakeSystemd(keys)
    systemd.unix_socket = str((directory / "state" / "kvd.sock").resolve())
    try:
        daemon = start_daemon(directory, config=config,
                              env={"NOTIFY_SOCKET": systemd.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)})
        try:
            ready = systemd.wait_for("READY=1")
            # READY only once the daemon answers and the disk tier is recovered.
            assert ready.answered == {"socket": True, "health": "SERVING", "matched": DURABLE_BLOCKS,
                                      "on_disk": DURABLE_BLOCKS}
            systemd.wait_for("WATCHDOG=1", count=KEEP_ALIVES)
            watchdog = [message for message in systemd.messages if message.text == "WATCHDOG=1"]
            assert all(message.at >= ready.at for message in watchdog)
            # A keep-alive at least every WATCHDOG_USEC (at half of it, give or take scheduling).
            # The first right after READY=1, then one at every half of WATCHDOG_USEC
            # (give or take scheduling): never a gap systemd would call a hang,
            # nor a busy loop.
            gaps = np.diff([ready.at] + [message.at for message in watchdog])
            assert gaps.max() < WATCHDOG_USEC / 1e6, gaps
            assert (gaps[1:] > WATCHDOG_USEC / 1e6 / 4).all(), gaps
            assert daemon.stop(signal.SIGTERM) == 0
        finally:
            if daemon.alive():
                daemon.stop(signal.SIGKILL)
        stopping = systemd.wait_for("STOPPING=1", timeout_s=5)
    finally:
        systemd.close()
    texts = systemd.texts()
    # Every message came from the main process (NotifyAccess=main).
    assert {message.pid for message in systemd.messages} == {daemon.pid}
    assert texts[0] == "STATUS=recovering the disk tier"
    assert texts[1] == "READY=1\nSTATUS=serving"
    assert texts.count("READY=1\nSTATUS=serving") == 1 and texts.count("STOPPING=1") == 1
    assert set(texts[2:]) <= {"WATCHDOG=1", "STOPPING=1"}
    assert stopping.at > watchdog[-1].at


def test_without_notify_socket_nothing_is_sent_and_watchdog_needs_our_pid():
    assert watchdog_interval_s({}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15.0
    # systemd names the process to watch: a child that inherited the variables stays silent.
    assert watchdog_interval_s({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}) is None
    assert watchdog_interval_s({"WATCHDOG_USEC": "soon"}) is None


def test_sd_notify_abstract_socket(monkeypatch):
    """systemd may name an abstract socket ("@..."), as it does in containers."""
    from kvd.daemon.systemd import sd_notify

    name = f"kvd-notify-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as receiver:
        receiver.bind("\0" + name)
        receiver.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sd_notify("READY=1")
        assert receiver.recv(64) == b"READY=1"
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert not sd_notify("READY=1")
