"""A soak-test client: Lookup, Put, Get (unary or GetBlocks), GetLayers and Prefetch in a loop, checking every byte.

Run as a process (`KVD_TOKEN=... python -m kvd.testing.soak_worker
CONTROL_DIR NAME SEED --tenant TENANT [--inline]`), it works on the daemon
whose target is in CONTROL_DIR/target until CONTROL_DIR/stop exists (or it
is killed), as tenant TENANT with the token in $KVD_TOKEN, and reconnects
whenever the daemon goes away (drain, restart). Every block's bytes derive
from its tenant and its key (kvd.testing.tenants.tenant_blocks), so any
block that comes back is checked without keeping a copy, and one of
another tenant's (`TENANTS`: the same spec, the same shared prompts, so
the same namespace id and keys) shows as such.

What it works on:
  * shared prompts: FAMILIES chains of up to CHAIN_BLOCKS blocks, the same
    in every worker, put and read in prefixes of random length: workers
    race on the same keys (EXISTS, IN_FLIGHT) within a tenant, and the
    tenants under the very same keys; together they hold more blocks than
    the test's host tier, so blocks are evicted, demoted to disk and read
    back all the time;
  * durable chains: fresh keys of this worker's own, put with
    durable=True; each acknowledged one is logged, and the test checks
    them after the daemon has been stopped and started again;
  * holds: a Get (read lease) or a Reserve (write lease) held for HOLD_S
    before it is released, so a kill often lands while the worker pins
    blocks; the lease is logged first, and the test checks that the
    daemon ended it. The client API has no call that reserves without
    committing or pins past the call, so these three go through a stub of
    the generated code (`Holder`), with the token, as the client's id.

Everything else goes through the public client API (kvd.client.Client).

It logs to CONTROL_DIR/NAME.jsonl, one JSON object per line, flushed at once
(a torn last line is dropped by put_stream.read_log):

  {"e": "start", "client": id, "tenant": name}
  {"e": "hold", "kind": "read"|"write", "client": id, "tenant": name, "lease": n, "t": time}
  {"e": "durable", "tenant": name, "keys": [hex...], "t": time}   acknowledged durable
  {"e": "bad", "op": ..., "detail": ...}            wrong bytes: a bug
  {"e": "foreign", "op": ..., "tenant": other, ...} another tenant's bytes: a bug
  {"e": "err", "op": ..., "code": "UNAVAILABLE", "detail": ..., "t": time}
  {"e": "stats", "ops": {op: count}, "blocks_checked": n, "t": time}
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import grpc
import numpy as np

from kvd.client import Client
from kvd.client._ops import STREAMED_GET_MIN_BYTES
from kvd.core.keys import chain_keys
from kvd.testing.put_stream import SPEC
from kvd.testing.tenants import TenantStub, tenant_blocks
from kvd.v1 import kvd_pb2

FAMILIES = 64
CHAIN_BLOCKS = 16
DURABLE_CHAIN_BLOCKS = 4
LEASE_MS = 4000
HOLD_S = 1.5
RPC_TIMEOUT_S = 20.0
RECONNECT_S = 0.2
STATS_EVERY_S = 1.0
# Operation mix: name -> weight.
OPERATIONS = {"lookup": 20, "put": 25, "put_durable": 6, "get": 25, "get_layers": 8, "prefetch": 12,
              "hold_read": 1, "hold_write": 1}
# The soak test's tenants: a worker works as one of them.
TENANTS = ("t0", "t1")


def family_keys() -> list[list[bytes]]:
    """The shared prompts' keys: the same in every worker, of every tenant."""
    return [chain_keys(SPEC, np.random.default_rng(family).integers(0, 1 << 31, CHAIN_BLOCKS * SPEC.block_tokens))
            for family in range(FAMILIES)]


class Log:
    def __init__(self, path: Path) -> None:
        self._file = open(path, "a")

    def write(self, **record) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()


class Holder:
    """Leases held past a call (which the client API never leaves open), for the client `client_id`.

    A stub of the generated code on a channel of its own, every call with the token."""

    def __init__(self, target: str, token: str | None, client_id: str) -> None:
        self._channel = grpc.insecure_channel(target)
        self._stub = TenantStub(self._channel, token, RPC_TIMEOUT_S)
        self.client_id = client_id

    def read(self, namespace, keys: list[bytes]) -> int:
        return self._stub.Get(kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, client_id=self.client_id,
                                                 keys=keys, lease_ms=LEASE_MS)).lease_id

    def write(self, namespace, keys: list[bytes]) -> int:
        return self._stub.Reserve(kvd_pb2.ReserveRequest(namespace_id=namespace.namespace_id,
                                                         client_id=self.client_id, keys=keys,
                                                         lease_ms=LEASE_MS)).lease_id

    def release(self, lease_id: int) -> None:
        self._stub.Release(kvd_pb2.ReleaseRequest(client_id=self.client_id, lease_ids=[lease_id]))

    def close(self) -> None:
        self._channel.close()


class Worker:
    def __init__(self, control: Path, name: str, seed: int, tenant: str, inline: bool) -> None:
        self.control = control
        self.rng = random.Random(seed)
        self.tenant = tenant
        self.others = [other for other in TENANTS if other != tenant]
        self.token = os.environ.get("KVD_TOKEN") or None
        self.inline = inline
        # Every other worker streams each of its Gets (GetBlocks); the rest make them unary.
        self.streamed_get_min_bytes = 0 if seed % 2 else STREAMED_GET_MIN_BYTES
        self.log = Log(control / f"{name}.jsonl")
        self.ops: dict[str, int] = {}
        self.blocks_checked = 0
        self.families = family_keys()
        self.stats_at = time.monotonic()

    def run(self) -> int:
        while not (self.control / "stop").exists():
            target = (self.control / "target").read_text().strip()
            try:
                with Client(target, timeout_s=RPC_TIMEOUT_S, lease_ms=LEASE_MS, token=self.token,
                            use_shared_memory=False if self.inline else None,
                            streamed_get_min_bytes=self.streamed_get_min_bytes) as client:
                    holder = Holder(target, self.token, client.client_id)
                    try:
                        namespace = client.register_namespace(SPEC)
                        self.log.write(e="start", client=client.client_id, tenant=self.tenant, inline=self.inline)
                        self._loop(client, holder, namespace)
                    finally:
                        holder.close()
            except grpc.RpcError as error:
                self._error("connect", error)
            time.sleep(RECONNECT_S)
        self._stats(force=True)
        return 0

    def _loop(self, client: Client, holder: Holder, namespace) -> None:
        names, weights = list(OPERATIONS), list(OPERATIONS.values())
        while not (self.control / "stop").exists():
            operation = self.rng.choices(names, weights)[0]
            if self.inline and operation == "get_layers":
                operation = "get"  # needs the arena
            try:
                if operation.startswith("hold_"):
                    getattr(self, operation)(holder, namespace)
                else:
                    getattr(self, operation)(client, namespace)
            except grpc.RpcError as error:
                self._error(operation, error)
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    return  # the daemon is going away: reconnect
            self.ops[operation] = self.ops.get(operation, 0) + 1
            self._stats()

    def _shared_keys(self) -> list[bytes]:
        chain = self.rng.choice(self.families)
        return chain[: self.rng.randint(1, CHAIN_BLOCKS)]

    def _blocks(self, keys: list[bytes]) -> np.ndarray:
        return tenant_blocks(self.tenant, keys)

    def _check(self, operation: str, keys: list[bytes], got: np.ndarray) -> None:
        matched = got.shape[0]
        if got.tobytes() != self._blocks(keys[:matched]).tobytes():
            self.log.write(e="bad", op=operation, detail=f"{matched} blocks of {len(keys)} came back wrong",
                           t=time.time())
            for other in self.others:
                theirs = tenant_blocks(other, keys[:matched])
                # Bytes, not floats: random bytes hold NaNs.
                rows = [row for row in range(matched) if got[row].tobytes() == theirs[row].tobytes()]
                if rows:
                    self.log.write(e="foreign", op=operation, tenant=other, rows=rows, t=time.time())
        self.blocks_checked += matched

    # -- operations ---------------------------------------------------

    def lookup(self, client: Client, namespace) -> None:
        client.lookup(namespace, self._shared_keys())

    def put(self, client: Client, namespace) -> None:
        keys = self._shared_keys()
        client.put(namespace, keys, self._blocks(keys))

    def put_durable(self, client: Client, namespace) -> None:
        count = self.rng.randint(1, DURABLE_CHAIN_BLOCKS)
        tokens = [self.rng.randrange(1 << 31) for _ in range(count * SPEC.block_tokens)]
        keys = namespace.keys(tokens)
        # It returns once every key is durable (len(keys)), or raises.
        durable = client.put(namespace, keys, self._blocks(keys), durable=True)
        self.log.write(e="durable", tenant=self.tenant, keys=[key.hex() for key in keys[:durable]], t=time.time())

    def get(self, client: Client, namespace) -> None:
        keys = self._shared_keys()
        self._check("get", keys, client.get_numpy(namespace, keys))

    def get_layers(self, client: Client, namespace) -> None:
        keys = self._shared_keys()
        last = None
        for _layers, blocks in client.get_layers(namespace, keys):
            last = blocks
        if last is not None:
            self._check("get_layers", keys, last)

    def prefetch(self, client: Client, namespace) -> None:
        client.prefetch(namespace, self._shared_keys(), wait=self.rng.random() < 0.3)

    def hold_read(self, holder: Holder, namespace) -> None:
        self._hold(holder, "read", holder.read(namespace, self._shared_keys()))

    def hold_write(self, holder: Holder, namespace) -> None:
        tokens = [self.rng.randrange(1 << 31) for _ in range(2 * SPEC.block_tokens)]
        self._hold(holder, "write", holder.write(namespace, namespace.keys(tokens)))

    def _hold(self, holder: Holder, kind: str, lease_id: int) -> None:
        if not lease_id:
            return
        self.log.write(e="hold", kind=kind, client=holder.client_id, tenant=self.tenant, lease=lease_id,
                       t=time.time())
        time.sleep(HOLD_S)
        try:
            holder.release(lease_id)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:  # expired while held: fine
                raise

    # -- records ------------------------------------------------------

    def _error(self, operation: str, error: grpc.RpcError) -> None:
        self.log.write(e="err", op=operation, code=error.code().name, detail=str(error.details())[:300],
                       t=time.time())

    def _stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.stats_at >= STATS_EVERY_S:
            self.stats_at = now
            self.log.write(e="stats", ops=self.ops, blocks_checked=self.blocks_checked, t=time.time())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("control", type=Path)
    parser.add_argument("name")
    parser.add_argument("seed", type=int)
    parser.add_argument("--tenant", default=TENANTS[0], help="the tenant whose token is in $KVD_TOKEN")
    parser.add_argument("--inline", action="store_true", help="never map the arena: inline bytes over gRPC")
    args = parser.parse_args(argv)
    # SIGUSR1 prints every thread's stack: how a test shows where a worker hangs.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    return Worker(args.control, args.name, args.seed, args.tenant, args.inline).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
