#!/usr/bin/env python3
"""Mooncake's distributed KV store as a contender of bench_peers.py.

    .venv-mooncake/bin/python bench/peers/mooncake_store.py '<Workload JSON>' [--mode shm|tcp|embedded]

The driver starts what the store needs on loopback, on free ports, and stops
it when it quits: the master service (the wheel's `mooncake_master` binary,
RPC and metrics bound to 127.0.0.1) and, in the shm and tcp modes, a
resource-owning "real client" (the wheel's `mooncake_client` binary) that
holds the store's memory (its global segment) as a per-node daemon would.
Transfer Engine metadata goes through P2P handshake (`P2PHANDSHAKE`), so no
metadata server runs. The global segment is sized to the workload plus a
margin that keeps it below the master's eviction watermark.

Modes (how the bytes move between the store's memory and the caller's buffer):

  shm       (default) the driver is a "dummy client" (`setup_dummy`): the
            caller's buffer is a memfd shared-memory region allocated by the
            dummy (`alloc_from_mem_pool`) and handed, as a file descriptor over
            the real client's Unix socket, to the real client, which maps it
            (`register_buffer`). Each batch call is one RPC to the real client
            (loopback TCP, coro_rpc), which asks the master where the objects
            are and copies them between its segment and the shared region with
            memcpy (Mooncake's local-memcpy path, on by default when the only
            transport is TCP).
  tcp       the driver is an ordinary ("embedded") store client that owns no
            segment (global_segment_size 0) and registers the caller's buffer
            with its Transfer Engine; the real client's segment is the only
            one, so every byte crosses the Transfer Engine's TCP transport over
            loopback between the two processes (MC_STORE_MEMCPY=0 as well).
  embedded  no real client: the driver's own client owns the segment, in its
            own address space (vLLM's default MooncakeStoreConnector mode);
            copies are in-process memcpy.

Every op uses the batched zero-copy calls: `batch_put_from`, `batch_get_into`
(one call for every block) and `batch_is_exist`. Mooncake has no disk tier
here (store/restore/cold answer unsupported).
"""

from __future__ import annotations

import atexit
import ctypes
import math
import os
import signal
import socket
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The protocol owns the real stdout; Mooncake's native code may write to fd 1,
# so fd 1 is pointed at stderr before the library is loaded.
_PROTOCOL_OUT = os.fdopen(os.dup(1), "w", buffering=1)
os.dup2(2, 1)
sys.stdout = _PROTOCOL_OUT

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # the store client logs warnings and errors only

import numpy as np
import protocol

MODES = ("shm", "tcp", "embedded")
HOST = "127.0.0.1"
EVICTION_HEADROOM = 0.8  # used / segment, below the master's 0.9 eviction watermark
SEGMENT_MARGIN = 64 << 20  # room for the lookup's tiny keys and the allocator's rounding
SEGMENT_ALIGN = 16 << 20
TINY_BYTES = 64  # the value of each extra lookup key
TINY_BATCH = 512  # tiny keys per put: the TCP transport queues at most 1024 transfers per peer
START_TIMEOUT_S = 60.0
_PR_SET_PDEATHSIG = 1


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: get SIGKILL when the driver dies, however it dies."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _wait_listening(port: int, process: subprocess.Popen, name: str, log: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{_tail(log)}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} did not listen on {HOST}:{port} within {START_TIMEOUT_S:.0f}s:\n{_tail(log)}")


def _tail(path: str, size: int = 3000) -> str:
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - size))
            return file.read().decode(errors="replace")
    except OSError:
        return ""


def _check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} failed with {code}")


class MooncakeContender:
    def __init__(self, workload: protocol.Workload, mode: str) -> None:
        import mooncake

        self.workload = workload
        self.mode = mode
        self.package_dir = os.path.dirname(os.path.abspath(mooncake.__file__))
        self.root = workload.dir
        os.makedirs(self.root, exist_ok=True)
        self.children: list[tuple[str, subprocess.Popen]] = []
        self.store = None
        self.buffer: np.ndarray | None = None
        self.registered = False
        self.block_keys = [f"kvd-bench/block/{i:08d}" for i in range(workload.blocks)]
        self.tiny_keys: list[str] = []
        used = workload.total_bytes + SEGMENT_MARGIN
        self.segment_bytes = math.ceil(used / EVICTION_HEADROOM / SEGMENT_ALIGN) * SEGMENT_ALIGN

    # -- the services

    def _spawn(self, name: str, argv: list[str]) -> subprocess.Popen:
        log = os.path.join(self.root, f"{name}.log")
        with open(log, "ab") as out:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       preexec_fn=_die_with_parent,  # noqa: PLW1509 (spawned before the store's threads)
                                       close_fds=True)
        self.children.append((name, process))
        return process

    def _start_master(self) -> None:
        self.master_port = _free_port()
        argv = [os.path.join(self.package_dir, "mooncake_master"),
                f"--rpc_address={HOST}", f"--rpc_port={self.master_port}",
                f"--metrics_host={HOST}", f"--metrics_port={_free_port()}",
                f"--rpc_thread_num={max(2, self.workload.threads)}",
                "--enable_metric_reporting=false", "--logtostderr"]
        master = self._spawn("mooncake_master", argv)
        _wait_listening(self.master_port, master, "mooncake_master", os.path.join(self.root, "mooncake_master.log"))

    def _start_real_client(self) -> None:
        """The resource-owning client holding the global segment (mooncake_client)."""
        self.client_port = _free_port()
        argv = [os.path.join(self.package_dir, "mooncake_client"),
                f"--host={HOST}", f"--port={self.client_port}",
                f"--master_server_address={HOST}:{self.master_port}", "--metadata_server=P2PHANDSHAKE",
                "--protocol=tcp", f"--global_segment_size={self.segment_bytes}", "--local_buffer_size=0",
                f"--threads={max(1, self.workload.threads)}", "--logtostderr"]
        client = self._spawn("mooncake_client", argv)
        _wait_listening(self.client_port, client, "mooncake_client", os.path.join(self.root, "mooncake_client.log"))

    def start(self) -> None:
        self._start_master()
        if self.mode != "embedded":
            self._start_real_client()
        if self.mode == "tcp":
            os.environ["MC_STORE_MEMCPY"] = "0"  # read when the client is set up

        from mooncake.store import MooncakeDistributedStore

        self.store = MooncakeDistributedStore()
        total = self.workload.total_bytes
        if self.mode == "shm":
            _check(self.store.setup_dummy(0, 0, f"{HOST}:{self.client_port}"), "setup_dummy")
            address = self.store.alloc_from_mem_pool(total)
            if not address:
                raise RuntimeError(f"alloc_from_mem_pool({total}) failed")
            self.buffer = np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(address))
        else:
            segment = 0 if self.mode == "tcp" else self.segment_bytes
            _check(self.store.setup(HOST, "P2PHANDSHAKE", segment, 0, "tcp", "", f"{HOST}:{self.master_port}"),
                   "setup")
            self.buffer = np.empty(total, dtype=np.uint8)
        protocol.fill(self.buffer, self.workload.seed)
        _check(self.store.register_buffer(self.buffer.ctypes.data, total), "register_buffer")
        self.registered = True
        base, size = self.buffer.ctypes.data, self.workload.block_bytes
        self.block_ptrs = [base + i * size for i in range(self.workload.blocks)]
        self.block_sizes = [size] * self.workload.blocks

    def stop(self) -> None:
        if self.store is not None:
            store, self.store = self.store, None
            try:
                if self.registered and self.buffer is not None:
                    store.unregister_buffer(self.buffer.ctypes.data)
                store.close()
            except Exception as error:  # noqa: BLE001 (the services are stopped below anyway)
                print(f"mooncake close: {error}", file=sys.stderr)
        for name, process in reversed(self.children):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.children.clear()

    # -- the ops

    def _put(self, keys: list[str], ptrs: list[int], sizes: list[int]) -> bool:
        results = self.store.batch_put_from(keys, ptrs, sizes)
        return len(results) == len(keys) and all(code == 0 for code in results)

    def put_memory(self, command: dict) -> dict:
        ok = self._put(self.block_keys, self.block_ptrs, self.block_sizes)
        return {"ok": ok}

    def get_memory(self, command: dict) -> dict:
        protocol.scramble(self.buffer)
        seconds, results = protocol.timed(
            lambda: self.store.batch_get_into(self.block_keys, self.block_ptrs, self.block_sizes))
        size = self.workload.block_bytes
        ok = len(results) == len(self.block_keys) and all(count == size for count in results)
        ok = ok and protocol.check(self.buffer, self.workload.seed)
        protocol.fill(self.buffer, self.workload.seed)
        return {"seconds": seconds, "ok": bool(ok), "mode": self.mode}

    def lookup(self, command: dict) -> dict:
        count, repeats = int(command["keys"]), int(command.get("repeats", 20))
        keys = self.block_keys[:count]
        missing = count - len(keys)
        if missing > len(self.tiny_keys):  # tiny keys fill up to `count` (untimed)
            extra = [f"kvd-bench/tiny/{i:08d}" for i in range(len(self.tiny_keys), missing)]
            for start in range(0, len(extra), TINY_BATCH):
                batch = extra[start:start + TINY_BATCH]
                if not self._put(batch, [self.buffer.ctypes.data] * len(batch), [TINY_BYTES] * len(batch)):
                    raise RuntimeError(f"putting {len(batch)} tiny lookup keys failed")
                self.tiny_keys += batch
        keys = keys + self.tiny_keys[:max(0, missing)]
        latencies, present = [], True
        for _ in range(repeats):
            seconds, results = protocol.timed(lambda: self.store.batch_is_exist(keys))
            latencies.append(seconds)
            present = present and len(results) == count and all(flag == 1 for flag in results)
        return {"latencies_s": latencies, "ok": bool(present), "mode": self.mode}

    def handlers(self) -> dict:
        return {"put_memory": self.put_memory, "get_memory": self.get_memory, "lookup": self.lookup}


def main() -> None:
    from importlib.metadata import version

    workload = protocol.Workload.from_json(sys.argv[1])
    mode = "shm"
    if len(sys.argv) > 2:
        args = sys.argv[2:]
        mode = args[1] if args[0] == "--mode" and len(args) > 1 else args[0].removeprefix("--mode=")
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}")
    contender = MooncakeContender(workload, mode)
    atexit.register(contender.stop)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    contender.start()
    try:
        protocol.serve("mooncake", f"mooncake-transfer-engine-non-cuda {version('mooncake-transfer-engine-non-cuda')} "
                       f"({mode})", contender.handlers())
    finally:
        contender.stop()


if __name__ == "__main__":
    main()
