"""One real daemon for all the fuzz tests, with tenants, and the blocks they must not alter.

The daemon has auth.mode = "token" and three tenants:

    fuzz   the fuzzers' tenant (B): any model, host and disk quotas
    owner  tenant A: stores blocks before any fuzzed call and then only
           checks them; no fuzzed call carries its token
    ops    an admin with no model (Stats)

Every fuzzed call carries one of `CREDENTIALS`: mostly fuzz's token, some
calls ops's, the rest no token, an unknown one or a malformed
`authorization` entry (those must all end UNAUTHENTICATED). A small host
tier, a disk tier, a 4 MiB message limit and short leases let fuzzed calls
reach every limit: evictions, quotas, pin caps, oversized messages, lease
expiry.

Reference blocks, stored before any fuzzed call and checked after every
example (`FuzzTarget.check_reference`):

  * `pinned`: fuzz's durable 16-block chain in the reference namespace,
    pinned by a read lease of a client id no fuzzed call names. Its
    namespace id and keys are in the fuzzers' pools, so fuzzed Puts,
    Deletes, Commits and Releases aim at it; nothing may change, move out
    or unpin it.
  * `hidden`: fuzz's 16-block chain in a namespace the fuzzers never name,
    not pinned: host pressure may demote it to disk or even drop it (a
    legal loss), but whatever prefix is served must be bit-exact.
  * owner's (`Owner`, tenant A): a durable chain under the very
    namespace id and keys of fuzz's play chain (which the fuzzers put,
    delete and overwrite all the time), with other bytes; and a chain in a
    namespace only owner registered, pinned by a lease of owner's client
    "fuzz-a" (a client id the fuzzers use too). That namespace's id, the
    daemon's own id of both owner namespaces, that chain and that lease id
    are in the fuzzers' pools: every call of fuzz's naming them must be
    NOT_FOUND. Owner's blocks are durable and fuzz's disk quota leaves
    them room, so all of them stay, bit-exact (`Owner.check`); none of
    their bytes may ever reach fuzz, in an inline Get or in fuzz's mapping
    of the arena.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec
from kvd.testing.daemon import DaemonProcess, run_daemon
from kvd.testing.put_stream import blocks_for
from kvd.testing.tenants import ArenaView, TenantStub, bearer, by_prefix, tenant_blocks, write_tenants_file
from kvd.v1 import kvd_pb2, kvd_pb2_grpc
from tests.fuzz.strategies import Pools

EXAMPLES = int(os.environ.get("KVD_FUZZ_EXAMPLES", "0")) or None
MAX_MESSAGE_BYTES = 4 << 20
LEASE_MS_MAX = 60_000
CALL_TIMEOUT_S = 30.0
CHAIN_BLOCKS = 16
# The reference pins are renewed this often, for LEASE_MS_MAX each time.
RENEW_S = 5.0
FUZZ_CLIENTS = ["fuzz-a", "fuzz-b", "fuzz-c"]
HOST_BYTES = 16 << 20
DISK_BYTES = 64 << 20
SLOT_BYTES = 16 << 10

TOKENS = {"fuzz": "fuzz-tenant-token-4b1d9e", "owner": "owner-tenant-token-c07a21", "ops": "ops-admin-token-58e3f0"}
# Quotas of the fuzzers' tenant (fuzzed too): the disk quota leaves room for every block of owner's.
FUZZ_HOST_QUOTA = 12 << 20
FUZZ_DISK_QUOTA = 56 << 20


@dataclass(frozen=True)
class Credential:
    """What a fuzzed call presents: its metadata, and who the daemon must take it for."""

    name: str
    metadata: tuple[tuple[str, str], ...] | None
    # "fuzz" or "ops"; None: refused, for `reason` (a label of kvd_auth_failures_total).
    tenant: str | None
    reason: str | None = None
    weight: int = 1

    def __repr__(self) -> str:
        return f"<{self.name}>"  # Hypothesis prints it; never a token


# Weights add up to 100; the first is what Hypothesis shrinks towards.
CREDENTIALS = [
    Credential("fuzz", bearer(TOKENS["fuzz"]), "fuzz", weight=77),
    Credential("fuzz, lower-case scheme and spaces", (("authorization", f"bearer   {TOKENS['fuzz']}  "),), "fuzz",
               weight=3),
    Credential("ops", bearer(TOKENS["ops"]), "ops", weight=4),
    Credential("no token", None, None, "missing_token", weight=5),
    Credential("unknown token", bearer("not-a-token-kvd-knows-9f2c"), None, "unknown_token", weight=4),
    Credential("owner's token, one character off", bearer(TOKENS["owner"][:-1] + "x"), None, "unknown_token",
               weight=2),
    Credential("fuzz's token without a scheme", (("authorization", TOKENS["fuzz"]),), None, "missing_token", weight=2),
    Credential("Basic scheme", (("authorization", f"Basic {TOKENS['fuzz']}"),), None, "missing_token", weight=1),
    Credential("Bearer and nothing", (("authorization", "Bearer "),), None, "missing_token", weight=1),
    Credential("a token over 4 KiB", bearer("t" * 5000), None, "missing_token", weight=1),
]
assert sum(credential.weight for credential in CREDENTIALS) == 100


def pick_credential(number: int) -> Credential:
    """The credential of a draw in [0, 100), by weight."""
    for credential in CREDENTIALS:
        if number < credential.weight:
            return credential
        number -= credential.weight
    raise ValueError(number)


def spec(model_id: str, num_layers: int) -> NamespaceSpec:
    # Layers of 4 KiB (2 x 16 tokens x 32 x float32): admitted to the disk tier.
    return NamespaceSpec(model_id=model_id, num_layers=num_layers, num_kv_heads=1, head_dim=32, block_tokens=16,
                         kv_dtype=DType.FLOAT32)


PLAY_SPEC = spec("fuzz-play", 2)  # 8 KiB blocks
REFERENCE_SPEC = spec("fuzz-reference", 4)  # 16 KiB blocks
HIDDEN_SPEC = spec(f"fuzz-hidden-{uuid.uuid4().hex}", 4)
OWNER_SPEC = spec(f"fuzz-owner-only-{uuid.uuid4().hex}", 4)


def daemon_config(directory: Path) -> dict:
    return {
        "host": {"capacity_bytes": HOST_BYTES, "slot_bytes": SLOT_BYTES},
        "disk": {
            "directories": [str(directory / "nvme0")],
            "capacity_bytes": DISK_BYTES,
            "slot_bytes": SLOT_BYTES,
            "segment_bytes": 16 << 20,
            "fsync": "group",
        },
        "server": {"max_message_bytes": MAX_MESSAGE_BYTES},
        "leases": {"default_ms": 2000, "max_ms": LEASE_MS_MAX, "sweep_interval_ms": 100, "max_pins_per_client": 512},
        "events": {"max_subscribers": 4},
        # The device plane on, so RegisterPool, SaveLayers, LoadLayers and UnregisterPool see the junk too.
        "device": {"kind": "cpu", "flag_timeout_ms": 200},
        "auth": {"mode": "token", "tenants_file": str(write_tenants_file(directory / "tenants.toml", {
            "fuzz": {"token": TOKENS["fuzz"], "namespaces": ["*"], "host_bytes": FUZZ_HOST_QUOTA,
                     "disk_bytes": FUZZ_DISK_QUOTA},
            "owner": {"token": TOKENS["owner"], "namespaces": ["*"]},
            "ops": {"token": TOKENS["ops"], "namespaces": [], "admin": True},
        }))},
    }


@dataclass
class Reference:
    namespace_id: bytes
    keys: list[bytes]
    blocks: bytes

    def check(self, stub: TenantStub, whole: bool = True, lookup: bool = False) -> None:
        """Served bit-exact through `stub` (and found by a Lookup too): all of it, or
        (whole=False) whatever prefix is left."""
        if lookup:
            found = stub.Lookup(kvd_pb2.LookupRequest(namespace_id=self.namespace_id, keys=self.keys))
            assert found.matched == len(self.keys), f"a reference chain: {found.matched} of {len(self.keys)}"
        got = stub.Get(kvd_pb2.GetRequest(namespace_id=self.namespace_id, client_id="fuzz-checker",
                                          keys=self.keys, inline=True))
        served = b"".join(got.blocks)
        if whole:
            assert got.matched == len(self.keys), f"a reference chain: {got.matched} of {len(self.keys)} served"
        assert served == self.blocks[: len(served)], "a reference block changed"


@dataclass
class Owner:
    """Tenant owner's blocks, and the lease that pins its private chain."""

    stub: TenantStub
    aliased: Reference  # under fuzz's play namespace id and keys, other bytes
    private: Reference  # in a namespace only owner registered, pinned
    client_id: str
    lease_id: int
    # Owner's block bytes, keyed by their first 64 bytes (each block's differ).
    secrets: dict[bytes, bytes]

    def check(self, settled: bool = False) -> None:
        """Every block of owner's is there; the aliased chain, unpinned, served whole once the
        fuzzers are done (until then their pins may leave a Get no host slot to read it into)."""
        self.aliased.check(self.stub, whole=settled, lookup=True)
        self.private.check(self.stub)

    def revealed(self, blocks) -> bool:
        """Whether any of `blocks` (bytes) is one of owner's."""
        return any(self.secrets.get(block[:64]) == block for block in blocks)


@dataclass(repr=False)
class FuzzTarget:
    daemon: DaemonProcess
    channel: grpc.Channel
    # Fuzzed calls: raw, each with its credential's metadata.
    raw_stub: kvd_pb2_grpc.KvdStub
    # The fixture's own calls, as tenant fuzz.
    stub: TenantStub
    pools: Pools
    pinned: Reference
    hidden: Reference
    owner: Owner
    fuzz_arena: ArenaView
    holder: str
    holder_lease: int
    # (client_id, lease_id) of every lease a fuzzed call was given (all fuzz's).
    opened: set = field(default_factory=set)
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    seconds: collections.Counter = field(default_factory=collections.Counter)
    # Fuzzed calls the daemon must have refused, by reason (kvd_auth_failures_total).
    refused: collections.Counter = field(default_factory=collections.Counter)
    renew_error: str | None = None
    checks: int = 0

    def __repr__(self) -> str:
        # Hypothesis prints the test's arguments on failure: keep it short.
        return f"FuzzTarget(kvd pid {self.daemon.pid}, {sum(self.outcomes.values())} calls so far)"

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(repr(self))

    def check_reference(self) -> None:
        """The daemon is up, every reference block is served bit-exact, none of owner's reached fuzz."""
        assert self.daemon.alive(), f"kvd died:\n{self.daemon.log()[-4000:]}"
        self.pinned.check(self.stub, lookup=True)
        self.hidden.check(self.stub, whole=False)
        self.owner.check()
        leaked = self.fuzz_arena.rows_holding(self.owner.secrets)
        assert not leaked, f"fuzz's mapping of the arena shows owner's blocks in slots {leaked[:8]}"
        assert self.renew_error is None, f"a reference pin was lost: {self.renew_error}"
        self.checks += 1

    def keep_pinned(self, stop: threading.Event) -> None:
        """Renew the reference pins every RENEW_S, whatever the fuzzers are doing."""
        pins = ((self.stub, self.holder, self.holder_lease),
                (self.owner.stub, self.owner.client_id, self.owner.lease_id))
        while not stop.wait(RENEW_S):
            for stub, client_id, lease_id in pins:
                try:
                    stub.Renew(kvd_pb2.RenewRequest(client_id=client_id, lease_id=lease_id, lease_ms=LEASE_MS_MAX))
                except grpc.RpcError as error:
                    self.renew_error = f"Renew {client_id}: {error.code().name}: {error.details()}"
                    return


def _store(client: Client, spec_: NamespaceSpec, first_token: int,
           tenant: str = "fuzz") -> tuple[object, list[bytes], np.ndarray]:
    """A durable chain of CHAIN_BLOCKS; owner's bytes differ from fuzz's under the same keys."""
    namespace = client.register_namespace(spec_)
    keys = namespace.keys(np.arange(CHAIN_BLOCKS * spec_.block_tokens) + first_token)
    blocks = blocks_for(keys, spec_) if tenant == "fuzz" else tenant_blocks(tenant, keys, spec_)
    assert client.put(namespace, keys, blocks, durable=True) == len(keys)
    return namespace, keys, blocks


def stub_of(channel: grpc.Channel, tenant: str) -> TenantStub:
    return TenantStub(channel, TOKENS[tenant], CALL_TIMEOUT_S)


def _pin(stub: TenantStub, namespace_id: bytes, client_id: str, keys: list[bytes]) -> int:
    pin = stub.Get(kvd_pb2.GetRequest(namespace_id=namespace_id, client_id=client_id, keys=keys,
                                      lease_ms=LEASE_MS_MAX))
    assert pin.matched == len(keys) and pin.lease_id
    return pin.lease_id


def _owner(daemon: DaemonProcess, channel: grpc.Channel) -> tuple[Owner, list[bytes]]:
    """Owner's chains; and the daemon's own ids of owner's namespaces (an admin's Stats shows them)."""
    with Client(daemon.unix_target, token=TOKENS["owner"], use_shared_memory=True) as client:
        aliased, aliased_keys, aliased_blocks = _store(client, PLAY_SPEC, 0, "owner")
        private, private_keys, private_blocks = _store(client, OWNER_SPEC, 30_000, "owner")
    stub = stub_of(channel, "owner")
    client_id = FUZZ_CLIENTS[0]
    owner = Owner(
        stub,
        aliased=Reference(aliased.namespace_id, aliased_keys, aliased_blocks.tobytes()),
        private=Reference(private.namespace_id, private_keys, private_blocks.tobytes()),
        client_id=client_id,
        lease_id=_pin(stub, private.namespace_id, client_id, private_keys),
        secrets={**by_prefix(aliased_blocks), **by_prefix(private_blocks)},
    )
    assert len(owner.secrets) == 2 * CHAIN_BLOCKS
    stats = stub_of(channel, "ops").Stats(kvd_pb2.StatsRequest())
    engine_ids = [namespace.namespace_id for namespace in stats.namespaces if namespace.tenant == "owner"]
    assert len(engine_ids) == 2 and private.namespace_id not in engine_ids
    return owner, engine_ids


@pytest.fixture(scope="module")
def fuzz_target(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kvd-fuzz")
    options = [("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)]
    with run_daemon(directory, config=daemon_config(directory)) as daemon, \
            Client(daemon.unix_target, token=TOKENS["fuzz"]) as client, \
            grpc.insecure_channel(daemon.unix_target, options) as channel:
        play, play_keys, _ = _store(client, PLAY_SPEC, 0)
        reference, reference_keys, reference_blocks = _store(client, REFERENCE_SPEC, 10_000)
        hidden, hidden_keys, hidden_blocks = _store(client, HIDDEN_SPEC, 20_000)
        owner, owner_engine_ids = _owner(daemon, channel)
        # Same spec, same keys, two tenants: two namespaces that share nothing but the id.
        assert (owner.aliased.namespace_id, owner.aliased.keys) == (play.namespace_id, play_keys)
        stub = stub_of(channel, "fuzz")
        holder = f"reference-holder-{uuid.uuid4().hex}"
        holder_lease = _pin(stub, reference.namespace_id, holder, reference_keys)
        info = stub.ArenaInfo(kvd_pb2.ArenaInfoRequest())
        pools = Pools(
            namespace_ids=[play.namespace_id, reference.namespace_id],
            chains=[play_keys, play_keys[:4], reference_keys],
            block_bytes=play.block_bytes,
            client_ids=FUZZ_CLIENTS,
            instance_id=info.instance_id,
            max_lease_ms=LEASE_MS_MAX,
            lease_ids=[holder_lease],
            other_block_bytes=[reference.block_bytes],
            foreign_namespace_ids=[owner.private.namespace_id, *owner_engine_ids],
            foreign_chains=[owner.private.keys],
            foreign_lease_ids=[owner.lease_id],
            scoped_client_ids=True,
        )
        target = FuzzTarget(
            daemon, channel, kvd_pb2_grpc.KvdStub(channel), stub, pools,
            pinned=Reference(reference.namespace_id, reference_keys, reference_blocks.tobytes()),
            hidden=Reference(hidden.namespace_id, hidden_keys, hidden_blocks.tobytes()),
            owner=owner, fuzz_arena=ArenaView(daemon, TOKENS["fuzz"], info),
            holder=holder, holder_lease=holder_lease,
        )
        stop = threading.Event()
        renewer = threading.Thread(target=target.keep_pinned, args=(stop,), name="reference-pins", daemon=True)
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
        print(f"refused: {dict(target.refused)}")
