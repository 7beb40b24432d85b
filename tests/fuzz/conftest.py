"""One real daemon for all the fuzz tests, and the blocks they must not alter.

The daemon has a small host tier, a disk tier, a 4 MiB message limit and
short leases, so fuzzed calls reach every limit: evictions, pin caps,
oversized messages, lease expiry.

Reference blocks, stored before any fuzzed call and checked after every
example (`FuzzTarget.check_reference`):

  * `pinned`: a durable 16-block chain in the reference namespace, pinned
    by a read lease of a client id no fuzzed call names. Its namespace id
    and keys are in the fuzzers' pools, so fuzzed Puts, Deletes, Commits
    and Releases aim at it; nothing may change, move out or unpin it.
  * `hidden`: a 16-block chain in a namespace the fuzzers never name, not
    pinned: host pressure may demote it to disk or even drop it (a legal
    loss), but whatever prefix is served must be bit-exact.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec
from kvd.testing.daemon import DaemonProcess, run_daemon
from kvd.testing.put_stream import blocks_for
from kvd.v1 import kvd_pb2, kvd_pb2_grpc
from tests.fuzz.strategies import Pools

EXAMPLES = int(os.environ.get("KVD_FUZZ_EXAMPLES", "0")) or None
MAX_MESSAGE_BYTES = 4 << 20
LEASE_MS_MAX = 60_000
CALL_TIMEOUT_S = 30.0
CHAIN_BLOCKS = 16
# The reference pin is renewed this often, for LEASE_MS_MAX each time.
RENEW_S = 5.0
FUZZ_CLIENTS = ["fuzz-a", "fuzz-b", "fuzz-c"]


def spec(model_id: str, num_layers: int) -> NamespaceSpec:
    # Layers of 4 KiB (2 x 16 tokens x 32 x float32): admitted to the disk tier.
    return NamespaceSpec(model_id=model_id, num_layers=num_layers, num_kv_heads=1, head_dim=32, block_tokens=16,
                         kv_dtype=DType.FLOAT32)


PLAY_SPEC = spec("fuzz-play", 2)  # 8 KiB blocks
REFERENCE_SPEC = spec("fuzz-reference", 4)  # 16 KiB blocks
HIDDEN_SPEC = spec(f"fuzz-hidden-{uuid.uuid4().hex}", 4)


def daemon_config(directory) -> dict:
    return {
        "host": {"capacity_bytes": 16 << 20, "slot_bytes": 16 << 10},
        "disk": {
            "directories": [str(directory / "nvme0")],
            "capacity_bytes": 64 << 20,
            "slot_bytes": 16 << 10,
            "segment_bytes": 16 << 20,
            "fsync": "group",
        },
        "server": {"max_message_bytes": MAX_MESSAGE_BYTES},
        "leases": {"default_ms": 2000, "max_ms": LEASE_MS_MAX, "sweep_interval_ms": 100, "max_pins_per_client": 512},
        "events": {"max_subscribers": 4},
    }


@dataclass
class Reference:
    namespace_id: bytes
    keys: list[bytes]
    blocks: bytes


@dataclass(repr=False)
class FuzzTarget:
    daemon: DaemonProcess
    channel: grpc.Channel
    stub: kvd_pb2_grpc.KvdStub
    pools: Pools
    pinned: Reference
    hidden: Reference
    holder: str
    holder_lease: int
    # (client_id, lease_id) of every lease a fuzzed call was given.
    opened: set = field(default_factory=set)
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    seconds: collections.Counter = field(default_factory=collections.Counter)
    renew_error: str | None = None
    checks: int = 0

    def __repr__(self) -> str:
        # Hypothesis prints the test's arguments on failure: keep it short.
        return f"FuzzTarget(kvd pid {self.daemon.pid}, {sum(self.outcomes.values())} calls so far)"

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))

    def check_reference(self) -> None:
        """The daemon is up and every reference block is served bit-exact."""
        assert self.daemon.alive(), f"kvd died:\n{self.daemon.log()[-4000:]}"
        stub, pinned, hidden = self.stub, self.pinned, self.hidden
        found = stub.Lookup(kvd_pb2.LookupRequest(namespace_id=pinned.namespace_id, keys=pinned.keys),
                            timeout=CALL_TIMEOUT_S)
        assert found.matched == len(pinned.keys), f"pinned reference chain: {found.matched} of {len(pinned.keys)}"
        got = stub.Get(kvd_pb2.GetRequest(namespace_id=pinned.namespace_id, client_id="fuzz-checker",
                                          keys=pinned.keys, inline=True), timeout=CALL_TIMEOUT_S)
        assert got.matched == len(pinned.keys)
        assert b"".join(got.blocks) == pinned.blocks, "a pinned reference block changed"
        got = stub.Get(kvd_pb2.GetRequest(namespace_id=hidden.namespace_id, client_id="fuzz-checker",
                                          keys=hidden.keys, inline=True), timeout=CALL_TIMEOUT_S)
        served = b"".join(got.blocks)
        assert served == hidden.blocks[: len(served)], "a hidden reference block changed"
        assert self.renew_error is None, f"the reference pin was lost: {self.renew_error}"
        self.checks += 1

    def keep_pinned(self, stop: threading.Event) -> None:
        """Renew the reference pin every RENEW_S, whatever the fuzzers are doing."""
        while not stop.wait(RENEW_S):
            try:
                self.stub.Renew(kvd_pb2.RenewRequest(client_id=self.holder, lease_id=self.holder_lease,
                                                     lease_ms=LEASE_MS_MAX), timeout=CALL_TIMEOUT_S)
            except grpc.RpcError as error:
                self.renew_error = f"Renew: {error.code().name}: {error.details()}"
                return


def _store(client: Client, spec_: NamespaceSpec, first_token: int) -> tuple[object, list[bytes], np.ndarray]:
    namespace = client.register_namespace(spec_)
    keys = namespace.keys(np.arange(CHAIN_BLOCKS * spec_.block_tokens) + first_token)
    blocks = blocks_for(keys, spec_)
    assert client.put(namespace, keys, blocks, durable=True) == len(keys)
    return namespace, keys, blocks


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kvd-fuzz")
    options = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
    with run_daemon(directory, config=daemon_config(directory)) as daemon, \
            Client(daemon.unix_target) as client, grpc.insecure_channel(daemon.unix_target, options) as channel:
        play, play_keys, _ = _store(client, PLAY_SPEC, 0)
        reference, reference_keys, reference_blocks = _store(client, REFERENCE_SPEC, 10_000)
        hidden, hidden_keys, hidden_blocks = _store(client, HIDDEN_SPEC, 20_000)
        stub = kvd_pb2_grpc.KvdStub(channel)
        holder = f"reference-holder-{uuid.uuid4().hex}"
        pin = stub.Get(kvd_pb2.GetRequest(namespace_id=reference.namespace_id, client_id=holder, keys=reference_keys,
                                          lease_ms=LEASE_MS_MAX))
        assert pin.matched == CHAIN_BLOCKS and pin.lease_id
        info = stub.ArenaInfo(kvd_pb2.ArenaInfoRequest())
        pools = Pools(
            namespace_ids=[play.namespace_id, reference.namespace_id],
            chains=[play_keys, play_keys[:4], reference_keys],
            block_bytes=play.block_bytes,
            client_ids=FUZZ_CLIENTS,
            instance_id=info.instance_id,
            max_lease_ms=LEASE_MS_MAX,
            lease_ids=[pin.lease_id],
            other_block_bytes=[reference.block_bytes],
        )
        target = FuzzTarget(
            daemon, channel, stub, pools,
            pinned=Reference(reference.namespace_id, reference_keys, reference_blocks.tobytes()),
            hidden=Reference(hidden.namespace_id, hidden_keys, hidden_blocks.tobytes()),
            holder=holder, holder_lease=pin.lease_id,
        )
        stop = threading.Event()
        renewer = threading.Thread(target=target.keep_pinned, args=(stop,), name="reference-pin", daemon=True)
        renewer.start()
        target.check_reference()
        started = time.monotonic()
        try:
            yield target
        finally:
            stop.set()
            renewer.join()
        print(f"\nfuzz: {sum(target.outcomes.values())} calls in {time.monotonic() - started:.1f}s, "
              f"{target.checks} reference checks; by method and status:")
        for (method, code), count in sorted(target.outcomes.items()):
            print(f"  {method:18} {code:20} {count:6}")
        print("seconds by method: " + ", ".join(f"{method} {seconds:.1f}" for method, seconds in
                                                target.seconds.most_common()))
