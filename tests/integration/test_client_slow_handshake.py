"""A daemon slow to answer a new connection's HTTP/2 handshake (busy for a moment, a TLS handshake
across nodes) is waited for, not failed: a client once gave up after 100 ms (gRPC's C core takes
its connect timeout from grpc.min_reconnect_backoff_ms) and its first call ended UNAVAILABLE,
"connection attempt timed out before receiving SETTINGS frame".

A unix-socket proxy in front of a real daemon holds each new connection HOLD_S before it relays
a byte either way."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path

from kvd.client import Client
from kvd.testing.daemon import run_daemon
from tests.integration.test_daemon_slot_classes import SMALL_SPEC

HOLD_S = 0.5


def relay(source: socket.socket, target: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(1 << 16):
            target.sendall(data)
    with contextlib.suppress(OSError):
        target.shutdown(socket.SHUT_WR)


def hold_then_relay(client: socket.socket, daemon_path: str, stop: threading.Event) -> None:
    if stop.wait(HOLD_S):
        return
    upstream = socket.socket(socket.AF_UNIX)
    upstream.connect(daemon_path)
    threads = [threading.Thread(target=relay, args=pair, daemon=True)
               for pair in ((client, upstream), (upstream, client))]
    for thread in threads:
        thread.start()


@contextlib.contextmanager
def slow_proxy(path: Path, daemon_path: str):
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen()
    stop = threading.Event()

    def accept() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                connection, _ = listener.accept()
                threading.Thread(target=hold_then_relay, args=(connection, daemon_path, stop), daemon=True).start()

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield f"unix://{path}"
    finally:
        stop.set()
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        acceptor.join(5)


def test_a_daemon_slow_to_answer_the_handshake_is_waited_for(tmp_path):
    with run_daemon(tmp_path / "kvd") as daemon, \
            slow_proxy(tmp_path / "slow.sock", daemon.unix_target.removeprefix("unix://")) as target, \
            Client(target, timeout_s=10) as client:
        namespace = client.register_namespace(SMALL_SPEC)  # the first call dials
        assert client.lookup(namespace, [bytes(32)]).matched == 0
