"""Bad input gets a precise status and never changes stored data."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from kvd.client import Client
from kvd.client._wire import spec_message
from kvd.testing.daemon import run_daemon
from kvd.v1 import kvd_pb2, kvd_pb2_grpc
from tests.integration.conftest import SMALL_SPEC, random_blocks


@pytest.fixture
def stub(daemon):
    with grpc.insecure_channel(daemon.unix_target) as channel:
        yield kvd_pb2_grpc.KvdStub(channel)


@pytest.fixture
def stored(client):
    """A namespace with a stored 12-block chain, and the bytes that were put."""
    namespace = client.register_namespace(SMALL_SPEC)
    keys = namespace.keys(np.arange(12 * 16) + 100_000)
    blocks = random_blocks(SMALL_SPEC, len(keys), seed=7)
    client.put(namespace, keys, blocks)
    return namespace, keys, blocks


def assert_status(call, code: grpc.StatusCode, fragment: str) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    assert raised.value.code() == code, raised.value.details()
    assert fragment in raised.value.details(), raised.value.details()


def assert_unchanged(client: Client, stored) -> None:
    namespace, keys, blocks = stored
    got = client.get_numpy(namespace, keys)
    assert got.shape[0] == len(keys)
    assert np.array_equal(got, blocks)


def test_register_namespace_validation(stub):
    bad = spec_message(SMALL_SPEC)
    bad.num_layers = 0
    assert_status(lambda: stub.RegisterNamespace(kvd_pb2.RegisterNamespaceRequest(spec=bad)),
                  grpc.StatusCode.INVALID_ARGUMENT, "num_layers")
    bad = spec_message(SMALL_SPEC)
    bad.kv_dtype = 0
    assert_status(lambda: stub.RegisterNamespace(kvd_pb2.RegisterNamespaceRequest(spec=bad)),
                  grpc.StatusCode.INVALID_ARGUMENT, "kv_dtype must be set")
    bad = spec_message(SMALL_SPEC)
    bad.kv_dtype = 99
    assert_status(lambda: stub.RegisterNamespace(kvd_pb2.RegisterNamespaceRequest(spec=bad)),
                  grpc.StatusCode.INVALID_ARGUMENT, "kv_dtype has unknown value 99")
    bad = spec_message(SMALL_SPEC)
    bad.kv_order, bad.num_kv_heads = kvd_pb2.KV_ORDER_LATENT, 2
    assert_status(lambda: stub.RegisterNamespace(kvd_pb2.RegisterNamespaceRequest(spec=bad)),
                  grpc.StatusCode.INVALID_ARGUMENT, "num_kv_heads must be 1 with kv_order LATENT")
    bad = spec_message(SMALL_SPEC)
    bad.hash_scheme = "md5"
    assert_status(lambda: stub.RegisterNamespace(kvd_pb2.RegisterNamespaceRequest(spec=bad)),
                  grpc.StatusCode.INVALID_ARGUMENT, "hash_scheme")
    assert_status(lambda: stub.RegisterNamespace(kvd_pb2.RegisterNamespaceRequest()),
                  grpc.StatusCode.INVALID_ARGUMENT, "spec must be set")
    # A block larger than a host slot (64 KiB here) is refused up front.
    big = spec_message(SMALL_SPEC)
    big.block_tokens = 1024
    assert_status(lambda: stub.RegisterNamespace(kvd_pb2.RegisterNamespaceRequest(spec=big)),
                  grpc.StatusCode.INVALID_ARGUMENT, "larger than the host slot")


def test_unknown_namespace_and_malformed_keys(stub, client, stored):
    namespace, keys, _ = stored
    assert_status(lambda: stub.Lookup(kvd_pb2.LookupRequest(namespace_id=b"\x01" * 32, keys=keys)),
                  grpc.StatusCode.NOT_FOUND, "not registered")
    assert_status(lambda: stub.Lookup(kvd_pb2.LookupRequest(namespace_id=b"short", keys=keys)),
                  grpc.StatusCode.INVALID_ARGUMENT, "namespace_id must be 32 bytes")
    assert_status(lambda: stub.Lookup(kvd_pb2.LookupRequest(namespace_id=namespace.namespace_id, keys=[keys[0], b"x" * 31])),
                  grpc.StatusCode.INVALID_ARGUMENT, "keys[1] is 31 bytes")
    assert_status(lambda: stub.Reserve(kvd_pb2.ReserveRequest(namespace_id=namespace.namespace_id, client_id="c",
                                                              keys=[keys[0], keys[0]])),
                  grpc.StatusCode.INVALID_ARGUMENT, "duplicates")
    assert_status(lambda: stub.Reserve(kvd_pb2.ReserveRequest(namespace_id=namespace.namespace_id, client_id="",
                                                              keys=keys[:1])),
                  grpc.StatusCode.INVALID_ARGUMENT, "client_id")
    assert_unchanged(client, stored)


def test_packed_lookup_keys(stub, client, stored):
    namespace, keys, _ = stored
    ns = namespace.namespace_id

    def lookup(**fields):
        return stub.Lookup(kvd_pb2.LookupRequest(namespace_id=ns, **fields))

    # Packed and listed keys give the same answer, from any parent; tiers per block.
    for prefix, parent in ((keys, b""), (keys[:5] + [b"\x09" * 32] + keys[6:], b""), (keys[3:], keys[2])):
        listed = lookup(keys=prefix, parent_key=parent)
        packed = lookup(packed_keys=b"".join(prefix), parent_key=parent)
        assert (packed.matched, packed.tiers) == (listed.matched, listed.tiers)
        assert len(packed.tiers) == packed.matched
    assert lookup(packed_keys=b"".join(keys)).matched == len(keys)
    assert lookup(packed_keys=b"".join(keys[3:]), parent_key=keys[2]).matched == len(keys) - 3
    assert lookup(packed_keys=b"".join(keys[3:])).matched == 0  # keys[3] is not a root block
    assert_status(lambda: lookup(packed_keys=b"".join(keys) + b"x"),
                  grpc.StatusCode.INVALID_ARGUMENT, f"packed_keys is {32 * len(keys) + 1} bytes, not a whole number")
    assert_status(lambda: lookup(packed_keys=b"".join(keys), keys=keys[:1]),
                  grpc.StatusCode.INVALID_ARGUMENT, "set keys or packed_keys, not both")
    assert_status(lambda: lookup(packed_keys=bytes(32 * 100_000)),
                  grpc.StatusCode.INVALID_ARGUMENT, "packed_keys has 100000 keys; at most")
    # The client packs whole keys and sends a bad one as listed keys, so the daemon can name it.
    assert client.lookup(namespace, keys).matched == len(keys)
    with pytest.raises(grpc.RpcError, match=r"keys\[2\] is 31 bytes"):
        client.lookup(namespace, [keys[0], keys[1], b"x" * 31])
    assert_unchanged(client, stored)


def test_wrong_payload_sizes(stub, client, stored):
    namespace, keys, _ = stored
    fresh = namespace.keys(np.arange(3 * 16) + 900_000)
    block = b"\0" * namespace.block_bytes
    assert_status(lambda: stub.PutInline(kvd_pb2.PutInlineRequest(
        namespace_id=namespace.namespace_id, client_id="c", keys=fresh, blocks=[block, block, block[:-1]])),
        grpc.StatusCode.INVALID_ARGUMENT, f"blocks[2] is {namespace.block_bytes - 1} bytes")
    assert_status(lambda: stub.PutInline(kvd_pb2.PutInlineRequest(
        namespace_id=namespace.namespace_id, client_id="c", keys=fresh, blocks=[block])),
        grpc.StatusCode.INVALID_ARGUMENT, "3 keys but 1 blocks")
    assert client.lookup(namespace, fresh).matched == 0
    assert_unchanged(client, stored)


def test_keys_that_are_not_a_chain(stub, client, stored):
    namespace, keys, _ = stored
    # keys[5] is stored under keys[4]; claiming it continues keys[2] is a lie.
    assert_status(lambda: stub.Reserve(kvd_pb2.ReserveRequest(
        namespace_id=namespace.namespace_id, client_id="c", parent_key=keys[2], keys=[keys[5]])),
        grpc.StatusCode.INVALID_ARGUMENT, "different parent")
    # A parent that is not stored cannot be extended.
    assert_status(lambda: stub.Reserve(kvd_pb2.ReserveRequest(
        namespace_id=namespace.namespace_id, client_id="c", parent_key=b"\x07" * 32, keys=[b"\x08" * 32])),
        grpc.StatusCode.FAILED_PRECONDITION, "parent_key is not a stored block")
    # Lookup of keys out of order matches nothing past the break.
    assert client.lookup(namespace, [keys[0], keys[2]]).matched == 1
    assert_unchanged(client, stored)


def test_commit_errors(stub, client, stored):
    namespace, keys, _ = stored
    fresh = namespace.keys(np.arange(2 * 16) + 700_000)
    reserved = stub.Reserve(kvd_pb2.ReserveRequest(namespace_id=namespace.namespace_id, client_id="writer", keys=fresh))
    assert list(reserved.statuses) == [kvd_pb2.RESERVE_STATUS_RESERVED] * 2
    lease_id = reserved.lease_id
    assert_status(lambda: stub.Commit(kvd_pb2.CommitRequest(namespace_id=namespace.namespace_id, client_id="thief",
                                                            lease_id=lease_id)),
                  grpc.StatusCode.PERMISSION_DENIED, "belongs to another client")
    assert_status(lambda: stub.Commit(kvd_pb2.CommitRequest(namespace_id=namespace.namespace_id, client_id="writer",
                                                            lease_id=lease_id + 1000)),
                  grpc.StatusCode.NOT_FOUND, "does not exist")
    assert_status(lambda: stub.Commit(kvd_pb2.CommitRequest(namespace_id=namespace.namespace_id, client_id="writer",
                                                            lease_id=lease_id, keys=[keys[0]])),
                  grpc.StatusCode.INVALID_ARGUMENT, "not part of lease")
    assert_status(lambda: stub.Commit(kvd_pb2.CommitRequest(namespace_id=namespace.namespace_id, client_id="writer",
                                                            lease_id=lease_id, keys=[fresh[1]])),
                  grpc.StatusCode.FAILED_PRECONDITION, "before its parent")
    assert_status(lambda: stub.Commit(kvd_pb2.CommitRequest(namespace_id=namespace.namespace_id, client_id="writer",
                                                            lease_id=lease_id, ack=kvd_pb2.ACK_DURABLE)),
                  grpc.StatusCode.INVALID_ARGUMENT, "needs a disk tier")
    # Another writer of the same chain is told the block is in flight.
    other = stub.Reserve(kvd_pb2.ReserveRequest(namespace_id=namespace.namespace_id, client_id="other", keys=fresh))
    assert list(other.statuses) == [kvd_pb2.RESERVE_STATUS_IN_FLIGHT] * 2 and other.lease_id == 0
    done = stub.Commit(kvd_pb2.CommitRequest(namespace_id=namespace.namespace_id, client_id="writer", lease_id=lease_id,
                                             keys=[fresh[0]]))
    assert done.sealed == 1
    assert_status(lambda: stub.Commit(kvd_pb2.CommitRequest(namespace_id=namespace.namespace_id, client_id="writer",
                                                            lease_id=lease_id, keys=[fresh[0]])),
                  grpc.StatusCode.FAILED_PRECONDITION, "already committed")
    done = stub.Commit(kvd_pb2.CommitRequest(namespace_id=namespace.namespace_id, client_id="writer", lease_id=lease_id))
    assert done.sealed == 1
    # The lease ended with the last commit: committing again is NOT_FOUND.
    assert_status(lambda: stub.Commit(kvd_pb2.CommitRequest(namespace_id=namespace.namespace_id, client_id="writer",
                                                            lease_id=lease_id)),
                  grpc.StatusCode.NOT_FOUND, "does not exist")
    assert client.lookup(namespace, fresh).matched == 2
    assert_unchanged(client, stored)


def test_foreign_and_stale_leases(stub, client, stored):
    namespace, keys, _ = stored
    got = stub.Get(kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, client_id="reader", keys=keys[:3]))
    assert got.matched == 3 and got.lease_id
    assert_status(lambda: stub.Release(kvd_pb2.ReleaseRequest(client_id="intruder", lease_ids=[got.lease_id])),
                  grpc.StatusCode.PERMISSION_DENIED, "belongs to another client")
    assert_status(lambda: stub.Renew(kvd_pb2.RenewRequest(client_id="reader", lease_id=got.lease_id, lease_ms=10**9)),
                  grpc.StatusCode.INVALID_ARGUMENT, "lease_ms")
    assert_status(lambda: stub.Commit(kvd_pb2.CommitRequest(namespace_id=namespace.namespace_id, client_id="reader",
                                                            lease_id=got.lease_id)),
                  grpc.StatusCode.FAILED_PRECONDITION, "read lease")
    # Pinned blocks cannot be deleted.
    deleted = stub.Delete(kvd_pb2.DeleteRequest(namespace_id=namespace.namespace_id, keys=[keys[0]]))
    assert (deleted.deleted, deleted.pinned) == (0, 1)
    assert stub.Release(kvd_pb2.ReleaseRequest(client_id="reader", lease_ids=[got.lease_id])).released == 1
    assert_status(lambda: stub.Release(kvd_pb2.ReleaseRequest(client_id="reader", lease_ids=[got.lease_id])),
                  grpc.StatusCode.NOT_FOUND, "released or expired")
    assert_unchanged(client, stored)


def test_over_capacity_is_resource_exhausted(daemon, stub, client):
    """Pin every slot with read leases; a Put then gets RESOURCE_EXHAUSTED."""
    namespace = client.register_namespace(SMALL_SPEC)
    info = stub.ArenaInfo(kvd_pb2.ArenaInfoRequest())
    keys = namespace.keys(np.arange(int(info.slot_count) * 16) + 5_000_000)
    blocks = random_blocks(SMALL_SPEC, len(keys), seed=3)
    assert client.put(namespace, keys, blocks) == len(keys)
    pinned = stub.Get(kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, client_id="pinner", keys=keys))
    assert pinned.matched == len(keys)
    try:
        extra = namespace.keys(np.arange(16) + 9_000_000)
        assert_status(lambda: stub.Reserve(kvd_pb2.ReserveRequest(namespace_id=namespace.namespace_id,
                                                                  client_id="c", keys=extra)),
                      grpc.StatusCode.RESOURCE_EXHAUSTED, "host tier is full")
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)
    finally:
        stub.Release(kvd_pb2.ReleaseRequest(client_id="pinner", lease_ids=[pinned.lease_id]))
    client.delete(namespace, keys[:1])


def test_message_size_limits(tmp_path):
    """Requests and replies over the configured limit get RESOURCE_EXHAUSTED,
    and the client batches inline transfers below the limit."""
    limit = 1 << 20
    config = {"host": {"capacity_bytes": 8 << 20, "slot_bytes": 64 << 10}, "server": {"max_message_bytes": limit}}
    with run_daemon(tmp_path, config=config) as daemon, Client(daemon.unix_target, use_shared_memory=False) as client:
        namespace = client.register_namespace(SMALL_SPEC)
        count = 2 * limit // namespace.block_bytes
        keys = namespace.keys(np.arange(count * 16))
        blocks = random_blocks(SMALL_SPEC, count, seed=11)
        assert client.put(namespace, keys, blocks) == count
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)
        with grpc.insecure_channel(daemon.unix_target, options=[("grpc.max_send_message_length", 1 << 30)]) as channel:
            stub = kvd_pb2_grpc.KvdStub(channel)
            assert_status(lambda: stub.Get(kvd_pb2.GetRequest(namespace_id=namespace.namespace_id, client_id="c",
                                                              keys=keys, inline=True)),
                          grpc.StatusCode.RESOURCE_EXHAUSTED, "ask for at most")
            fresh = namespace.keys(np.arange(count * 16) + 10**6)
            with pytest.raises(grpc.RpcError) as raised:
                stub.PutInline(kvd_pb2.PutInlineRequest(namespace_id=namespace.namespace_id, client_id="c", keys=fresh,
                                                        blocks=[row.tobytes() for row in blocks.reshape(count, -1)]))
            assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.lookup(namespace, fresh).matched == 0
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)
