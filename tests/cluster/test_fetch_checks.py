"""The fetcher's checks (kvd.planes.cluster_fetch over kvd.cluster.peer_blocks), against a real engine
and a peer that lies, stalls or dies mid-stream."""

from __future__ import annotations

import asyncio
import ctypes
from types import SimpleNamespace

import crc32c
import grpc
import numpy as np
import pytest

from kvd.clock import ManualClock
from kvd.core.block import NO_SLOT
from kvd.core.engine import Engine, KeysRequest, ReserveStatus
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.cluster.peer_blocks import PeerBlocks
from kvd.planes import cluster_fetch
from kvd.planes.cluster_fetch import FETCH_CLIENT, ClusterFetch
from kvd.v1 import kvd_pb2

SPEC = NamespaceSpec(model_id="fetch-test", num_layers=2, num_kv_heads=1, head_dim=4, block_tokens=1)


class Arena:
    def __init__(self) -> None:
        self.writes: dict[int, bytes] = {}

    def write_at(self, offset: int, payload: bytes) -> None:
        self.writes[offset] = bytes(payload)


class Peer:
    """ReadBlocks as a script: a list of messages, then an ending (None, an error, or a stall)."""

    def __init__(self, messages, ending=None) -> None:
        self.messages, self.ending = messages, ending
        self.requests = []

    def ReadBlocks(self, request, timeout, metadata):
        self.requests.append(request)

        async def stream():
            for message in self.messages:
                yield message
            if self.ending == "stall":
                await asyncio.sleep(3600)
            elif self.ending is not None:
                raise self.ending
        return stream()


class Dead(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return "connection reset"


def setup(peer: Peer, timeout_s: float = 5.0):
    engine = Engine(host_slot_count=64, host_slot_bytes=64)
    namespace_id = engine.register_namespace(SPEC).namespace_id
    arena = Arena()
    node = SimpleNamespace(name="me", member=SimpleNamespace(incarnation=7),
                           peers=SimpleNamespace(stub=lambda name: peer, metadata=()))
    return ClusterFetch(engine, arena, ManualClock().now_ms, PeerBlocks(node), timeout_s), engine, namespace_id, arena


def payloads(n: int) -> list[bytes]:
    """Blocks whose two layers differ (a checksum of the whole block would not tell them apart)."""
    half = SPEC.layer_bytes
    return [bytes([i]) * half + bytes([100 + i]) * half for i in range(n)]


def layer_crcs(blocks: list[bytes]) -> list[int]:
    """CRC-32C of each layer of each block, block by block (what the holder sends)."""
    half = SPEC.layer_bytes
    return [crc32c.crc32c(block[j * half:(j + 1) * half]) for block in blocks for j in range(SPEC.num_layers)]


def message(first: int, blocks: list[bytes], crcs: list[int] | None = None) -> kvd_pb2.ReadBlocksResponse:
    return kvd_pb2.ReadBlocksResponse(first=first, blocks=blocks, crc32c=crcs if crcs is not None else layer_crcs(blocks))


def fetch(plane: ClusterFetch, namespace_id: bytes, keys, first: int = 0) -> int:
    return asyncio.run(plane._fetch("peer", namespace_id, keys, first, len(keys)))


def test_a_good_stream_is_sealed_with_the_bytes_sent():
    data = payloads(6)
    peer = Peer([message(0, data[:4]), message(4, data[4:])])
    plane, engine, namespace_id, arena = setup(peer)
    keys = chain_keys(SPEC, list(range(6)))
    assert fetch(plane, namespace_id, keys) == 6
    assert len(engine.lookup(namespace_id, keys)) == 6
    assert sorted(arena.writes.values()) == sorted(data)
    assert peer.requests[0].first == 0 and len(peer.requests[0].packed_keys) == 6 * 32


def test_a_wrong_checksum_ends_the_fetch_and_only_the_verified_prefix_is_kept():
    data = payloads(6)
    crcs = layer_crcs(data)
    crcs[3 * SPEC.num_layers + 1] ^= 1  # block 3's second layer
    plane, engine, namespace_id, arena = setup(Peer([message(0, data, crcs)]))
    keys = chain_keys(SPEC, list(range(6)))
    assert fetch(plane, namespace_id, keys) == 3
    assert len(engine.lookup(namespace_id, keys)) == 3 and plane.failed_fetches["peer"] == 1
    # The aborted reservations are gone: a later Put of the same keys gets slots again.
    engine.verify()


def test_short_or_misplaced_blocks_are_refused():
    data = payloads(4)
    plane, engine, namespace_id, _ = setup(Peer([message(0, [data[0], data[1][:-1]])]))
    keys = chain_keys(SPEC, list(range(4)))
    assert fetch(plane, namespace_id, keys) == 1
    plane, engine, namespace_id, _ = setup(Peer([message(1, data[:2])]))
    assert fetch(plane, namespace_id, keys) == 0
    assert len(engine.lookup(namespace_id, keys)) == 0


def test_a_peer_that_dies_or_stalls_leaves_misses_within_the_deadline():
    data = payloads(5)
    keys = chain_keys(SPEC, list(range(5)))
    plane, engine, namespace_id, _ = setup(Peer([message(0, data[:2])], ending=Dead()))
    assert fetch(plane, namespace_id, keys) == 2
    plane, engine, namespace_id, _ = setup(Peer([message(0, data[:1])], ending="stall"), timeout_s=0.2)
    assert fetch(plane, namespace_id, keys) == 1
    assert len(engine.lookup(namespace_id, keys)) == 1
    engine.verify()


def test_a_fetch_continues_a_local_prefix():
    data = payloads(6)
    peer = Peer([message(0, data[:2])])
    plane, engine, namespace_id, arena = setup(peer)
    keys = chain_keys(SPEC, list(range(6)))
    assert fetch(plane, namespace_id, keys[:2]) == 2
    peer.messages = [message(2, data[2:])]
    assert fetch(plane, namespace_id, keys, first=2) == 4
    assert peer.requests[-1].first == 2 and len(peer.requests[-1].packed_keys) == 6 * 32
    assert len(engine.lookup(namespace_id, keys)) == 6
    assert sorted(arena.writes.values()) == sorted(data)


class Paused(Peer):
    """ReadBlocks that stops after its first message until told to go on."""

    def __init__(self, messages) -> None:
        super().__init__(messages)
        self.paused, self.resume = asyncio.Event(), asyncio.Event()

    def ReadBlocks(self, request, timeout, metadata):
        self.requests.append(request)

        async def stream():
            first, *rest = self.messages
            yield first
            self.paused.set()
            await self.resume.wait()
            for later in rest:
                yield later
        return stream()


async def paused_stream_fetch(messages, keys):
    """A stream fetch of `keys` on a manual clock, stopped after its first message: (the peer, the
    plane, the engine, the namespace, the arena, the clock, the fetch's future, its lease)."""
    peer = Paused(messages)
    plane, engine, namespace_id, arena = setup(peer)
    clock = ManualClock()
    plane.now_ms = clock.now_ms
    fetching = asyncio.ensure_future(plane._fetch("peer", namespace_id, keys, 0, len(keys)))
    await peer.paused.wait()
    [lease] = list(engine.leases)
    return peer, plane, engine, namespace_id, arena, clock, fetching, lease


def test_a_stream_fetch_whose_lease_expires_mid_stream_writes_into_no_freed_slot_and_seals_nothing():
    """Before: the stream wrote into its reserved slots without holding their lease, so the sweeper
    could end it mid-stream and hand its slots to another block while the stream still wrote there
    (and the seal then failed on the ended lease). Now the fill holds the lease: the slots stay
    reserved until the stream is over, then nothing is sealed: misses, never another block's bytes."""
    data = payloads(4)
    keys = chain_keys(SPEC, list(range(4)))

    async def scenario():
        peer, plane, engine, namespace_id, arena, clock, fetching, lease = await paused_stream_fetch(
            [message(0, data[:2]), message(2, data[2:])], keys)
        fetch_slots = {engine.host_slot(handle.block) for handle in lease.handles}
        clock.advance(lease.deadline_ms + 1)
        assert engine.expire(clock.now_ms()) == 1  # the sweeper: ended for every client
        # Another writer now wants every free slot: it must not get those the stream writes into.
        others = chain_keys(SPEC, list(range(100, 164)))
        other = engine.reserve(KeysRequest(namespace_id, "other", others, 60_000, clock.now_ms()))
        taken = [slot for slot in other.slots if slot != NO_SLOT]
        assert not fetch_slots & set(taken)
        arena.writes.clear()
        peer.resume.set()
        assert await fetching == 0
        assert not set(arena.writes) & set(engine.host.pool.offsets_of(taken))
        assert lease.ended and engine.lookup(namespace_id, keys) == [] and plane.failed_fetches["peer"] == 1
        engine.release("other", [other.lease.lease_id])
        assert engine.host.pool.free_count == 64
        engine.verify()

    asyncio.run(scenario())


@pytest.mark.parametrize("ends", ["drain", "deadline with no sweep"])
def test_a_stream_fetch_whose_lease_ends_otherwise_mid_stream_seals_nothing_and_raises_nothing(ends):
    """The drain closes every lease; a deadline may also pass with no sweep before the seal. Either
    way the Get that fetched goes on with misses (before: NOT_FOUND for a lease it never named)."""
    data = payloads(3)
    keys = chain_keys(SPEC, list(range(3)))

    async def scenario():
        peer, plane, engine, namespace_id, _, clock, fetching, lease = await paused_stream_fetch(
            [message(0, data[:1]), message(1, data[1:])], keys)
        if ends == "drain":
            assert engine.close_all_leases() == 1
        else:
            clock.advance(lease.deadline_ms + 1)
        peer.resume.set()
        assert await fetching == 0
        assert lease.ended and engine.lookup(namespace_id, keys) == [] and not engine.leases
        assert engine.host.pool.free_count == 64
        engine.verify()

    asyncio.run(scenario())


# -- the NIXL path: offsets from PinBlocks, a one-sided READ, checksums from ReleasePins ------------

class MemoryArena:
    """A real buffer with addresses, as the daemon's arena has."""

    def __init__(self, size: int) -> None:
        self.buffer = np.zeros(size, dtype=np.uint8)

    def address_at(self, offset: int) -> int:
        return self.buffer.ctypes.data + offset


class Holder:
    """PinBlocks and ReleasePins of a holder whose blocks sit in its own buffer."""

    def __init__(self, data: list[bytes], release_crcs=None, release_error=None) -> None:
        self.memory = MemoryArena(len(data) * SPEC.block_bytes)
        for i, block in enumerate(data):
            self.memory.buffer[i * SPEC.block_bytes:(i + 1) * SPEC.block_bytes] = np.frombuffer(block, np.uint8)
        self.crcs = release_crcs if release_crcs is not None else layer_crcs(data)
        self.release_error = release_error
        self.released = []

    async def PinBlocks(self, request, timeout, metadata):
        count = len(request.packed_keys) // 32 - request.first
        return kvd_pb2.PinBlocksResponse(lease_id=9, offsets=[i * SPEC.block_bytes for i in range(count)],
                                         block_bytes=SPEC.block_bytes, arena_address=self.memory.address_at(0),
                                         grant=b"grant of the holder's view")

    async def ReleasePins(self, request, timeout, metadata):
        self.released.append(request.lease_id)
        if self.release_error is not None:
            raise self.release_error
        return kvd_pb2.ReleasePinsResponse(crc32c=self.crcs)


class Copying:
    """transport.read as a memmove (what a completed one-sided READ leaves behind)."""

    async def read(self, node, local, remote, length, timeout_s, grant):
        assert grant == b"grant of the holder's view"
        for target, source in zip(local, remote):
            ctypes.memmove(target, source, length)
        return True, None


class Gone(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.NOT_FOUND

    def details(self):
        return "no pins under lease 9"


def nixl_setup(holder: Holder):
    engine = Engine(host_slot_count=64, host_slot_bytes=SPEC.block_bytes)
    namespace_id = engine.register_namespace(SPEC).namespace_id
    arena = MemoryArena(64 * SPEC.block_bytes)
    node = SimpleNamespace(name="me", member=SimpleNamespace(incarnation=7), transport=Copying(),
                           peers=SimpleNamespace(stub=lambda name: holder, metadata=(), timeout_s=1.0))
    return ClusterFetch(engine, arena, ManualClock().now_ms, PeerBlocks(node), 5.0), engine, namespace_id, arena


def test_a_nixl_read_is_sealed_once_the_release_s_checksums_match():
    data = payloads(6)
    holder = Holder(data)
    plane, engine, namespace_id, arena = nixl_setup(holder)
    keys = chain_keys(SPEC, list(range(6)))
    assert asyncio.run(plane._fetch_nixl("peer", namespace_id, keys, 0, 6)) == 6
    assert holder.released == [9] and plane.fetched_blocks["peer", "nixl"] == 6
    matched = engine.lookup(namespace_id, keys)
    offsets = engine.host_offsets(matched)
    assert [arena.buffer[o:o + SPEC.block_bytes].tobytes() for o in offsets] == data


def test_a_nixl_read_keeps_only_the_prefix_its_checksums_vouch_for():
    data = payloads(6)
    crcs = layer_crcs(data)
    crcs[4 * SPEC.num_layers + 1] ^= 1  # block 4's second layer
    plane, engine, namespace_id, _ = nixl_setup(Holder(data, release_crcs=crcs))
    keys = chain_keys(SPEC, list(range(6)))
    assert asyncio.run(plane._fetch_nixl("peer", namespace_id, keys, 0, 6)) == 4
    assert len(engine.lookup(namespace_id, keys)) == 4
    engine.verify()


def test_a_nixl_fetch_cancelled_while_it_releases_the_pins_leaves_its_slots_to_their_deadline():
    """The READ is over but the fetch is cancelled during ReleasePins: its fill stops holding the
    lease (before: held for good, so the lease could never end and its slots stayed reserved)."""
    holder = Holder(payloads(3))
    plane, engine, namespace_id, _ = nixl_setup(holder)
    keys = chain_keys(SPEC, list(range(3)))
    answer = holder.ReleasePins

    async def scenario():
        releasing = asyncio.Event()

        async def first_release_stalls(request, timeout, metadata):
            if not releasing.is_set():
                releasing.set()
                await asyncio.Event().wait()
            return await answer(request, timeout, metadata)
        holder.ReleasePins = first_release_stalls
        fetching = asyncio.ensure_future(plane._fetch_nixl("peer", namespace_id, keys, 0, 3))
        await releasing.wait()
        [lease] = list(engine.leases)
        fetching.cancel()
        with pytest.raises(asyncio.CancelledError):
            await fetching
        assert holder.released == [9]  # the release on the way out, after the cancelled one
        assert lease.holds == 0 and engine.host.pool.free_count == 64 - 3
        assert engine.expire(lease.deadline_ms) == 1 and lease.ended
        assert engine.host.pool.free_count == 64
        engine.verify()

    asyncio.run(scenario())


class Pieces(Copying):
    """transport.read that notes how many blocks each READ moves."""

    def __init__(self) -> None:
        self.reads: list[int] = []

    async def read(self, node, local, remote, length, timeout_s, grant):
        self.reads.append(len(local))
        await asyncio.sleep(0)  # a READ takes a while: the previous piece's checksum thread starts
        return await super().read(node, local, remote, length, timeout_s, grant)


def test_a_nixl_fetch_reads_in_pieces_and_checks_each_while_the_next_lands(monkeypatch):
    monkeypatch.setattr(cluster_fetch, "READ_PIECE_BYTES", 2 * SPEC.block_bytes)
    data = payloads(5)
    crcs = layer_crcs(data)
    crcs[3 * SPEC.num_layers] ^= 1  # block 3, in the second piece
    holder = Holder(data, release_crcs=crcs)
    plane, engine, namespace_id, arena = nixl_setup(holder)
    plane.peers.node.transport = pieces = Pieces()
    keys = chain_keys(SPEC, list(range(5)))
    assert asyncio.run(plane._fetch_nixl("peer", namespace_id, keys, 0, 5)) == 3
    assert pieces.reads == [2, 2, 1]
    assert plane.moved_bytes["nixl"] == 5 * SPEC.block_bytes
    assert plane.stage_seconds.keys() >= {("nixl", "pin"), ("nixl", "read"), ("nixl", "verify")}
    assert len(engine.lookup(namespace_id, keys)) == 3
    engine.verify()


def test_a_nixl_read_whose_pins_were_gone_at_release_is_all_misses():
    """The holder's lease ran out before the release: the READ may have raced a reused slot."""
    data = payloads(5)
    holder = Holder(data, release_error=Gone())
    plane, engine, namespace_id, _ = nixl_setup(holder)
    keys = chain_keys(SPEC, list(range(5)))
    assert asyncio.run(plane._fetch_nixl("peer", namespace_id, keys, 0, 5)) == 0
    assert holder.released == [9] and len(engine.lookup(namespace_id, keys)) == 0
    engine.verify()


def test_a_message_with_a_checksum_per_block_instead_of_per_layer_is_refused():
    data = payloads(3)
    whole_block = [crc32c.crc32c(b) for b in data]
    plane, engine, namespace_id, _ = setup(Peer([message(0, data, whole_block)]))
    keys = chain_keys(SPEC, list(range(3)))
    assert fetch(plane, namespace_id, keys) == 0 and plane.failed_fetches["peer"] == 1
    assert len(engine.lookup(namespace_id, keys)) == 0


class Uncancelled:
    """transport.read of a READ that ran past its deadline and could not be cancelled."""

    def __init__(self) -> None:
        self.running: asyncio.Future | None = None

    async def read(self, node, local, remote, length, timeout_s, grant):
        self.running = asyncio.get_running_loop().create_future()
        return False, self.running


def test_slots_an_uncancelled_read_may_still_write_stay_reserved_until_it_ends():
    """Before: the reservation was aborted at once and its slots reused, so a late READ could
    overwrite another block's verified bytes (issue 37 item 2). Now its lease is held, past its
    expiry too, until the transport says the READ has ended; then its blocks are aborted."""
    data = payloads(4)
    holder = Holder(data)
    plane, engine, namespace_id, _ = nixl_setup(holder)
    transport = Uncancelled()
    plane.peers.node.transport = transport
    clock = ManualClock()
    plane.now_ms = clock.now_ms
    keys = chain_keys(SPEC, list(range(4)))

    async def scenario():
        assert await plane._fetch_nixl("peer", namespace_id, keys, 0, 4) is None  # then the gRPC stream
        lease = next(lease for lease in engine.leases if lease.client_id == FETCH_CLIENT)
        reserved = engine.reserve(KeysRequest(namespace_id, "other", keys, 60_000, clock.now_ms()))
        assert set(reserved.statuses) == {ReserveStatus.IN_FLIGHT}  # still the fetch's, WRITABLE
        clock.advance(10 * 60_000)
        engine.expire(clock.now_ms())  # past its deadline: held, so its slots stay
        assert not lease.ended and engine.host.pool.free_count == 64 - 4
        transport.running.set_result(None)
        await asyncio.sleep(0)
        assert lease.ended and engine.host.pool.free_count == 64
        again = engine.reserve(KeysRequest(namespace_id, "other", keys, 60_000, clock.now_ms()))
        assert set(again.statuses) == {ReserveStatus.RESERVED}
        engine.verify()

    asyncio.run(scenario())


def test_a_bug_giving_back_an_uncancelled_reads_slots_goes_to_the_supervisor(monkeypatch):
    """The slots go back in a callback no task awaits: a failure there must stop kvd loudly, not
    vanish into the event loop's log."""
    plane, engine, namespace_id, _ = nixl_setup(Holder(payloads(2)))
    plane.peers.node.transport = transport = Uncancelled()
    bugs = []
    plane.on_bug = lambda what, error: bugs.append((what, error))
    keys = chain_keys(SPEC, list(range(2)))

    async def scenario():
        assert await plane._fetch_nixl("peer", namespace_id, keys, 0, 2) is None
        monkeypatch.setattr(engine, "seal_prefix", lambda *args: (_ for _ in ()).throw(RuntimeError("a bug")))
        transport.running.set_result(None)
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert [(what, str(error)) for what, error in bugs] == [
        ("giving back the slots of a READ that could not be cancelled", "a bug")]
