"""A real etcd server for tests: a plain process on free loopback ports.

Debian's etcd-server (make installs it) runs as an ordinary process with a
temporary data directory; it is healthy in about a second. `stop()` and
`start()` keep the data directory and the ports, so a restart looks to the
daemons like the same cluster coming back.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from kvd.testing.certs import Certificates


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class EtcdServer:
    def __init__(self, data_dir: Path | None = None, host: str = "127.0.0.1",
                 tls: Certificates | None = None) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed (apt-get install etcd-server; make test installs it)")
        self.binary = binary
        self._owned_dir = data_dir is None
        # Default: on tmpfs where there is one. etcd fsyncs its WAL for every
        # lease grant, refresh and revoke, and on this shared, noisy disk one
        # fsync can stall for seconds, which delays a lease's expiry past any
        # bound a test can state (a crashed member was once not gone in 7 s).
        shm = "/dev/shm" if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK) else None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="etcd-test-", dir=shm))
        self.host = host
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        self.process: subprocess.Popen | None = None
        # With certificates: clients must connect over TLS with a client
        # certificate signed by tls.ca (etcd's --client-cert-auth).
        self.tls = tls

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    def start(self, timeout_s: float = 20.0) -> EtcdServer:
        scheme = "https" if self.tls else "http"
        client_url = f"{scheme}://{self.host}:{self.client_port}"
        peer_url = f"http://{self.host}:{self.peer_port}"
        tls_flags = [] if self.tls is None else [
            "--cert-file", str(self.tls.server_cert), "--key-file", str(self.tls.server_key),
            "--client-cert-auth", "--trusted-ca-file", str(self.tls.ca)]
        log = open(self.data_dir.parent / f"{self.data_dir.name}.log", "ab")
        self.process = subprocess.Popen(
            [self.binary, "--name", "kvd-test", "--data-dir", str(self.data_dir / "data"),
             "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"kvd-test={peer_url}", *tls_flags],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self._wait_healthy(client_url, timeout_s)
        return self

    def _wait_healthy(self, client_url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=str(self.tls.ca))
            context.load_cert_chain(str(self.tls.client_cert), str(self.tls.client_key))
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.process.returncode}; see {self.data_dir}.log")
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=1, context=context) as reply:
                    if b'"health":"true"' in reply.read():
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd not healthy within {timeout_s} s; see {self.data_dir}.log")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def close(self) -> None:
        self.stop(signal.SIGKILL)
        if self._owned_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            Path(f"{self.data_dir}.log").unlink(missing_ok=True)

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
