"""Fetch on Get: the part of a chain a peer holds and this node lacks, brought into host memory.

A Get of a chain from its root that misses locally asks the directory which
node holds more of it, reserves host slots for the missing blocks under a
fetch lease, and brings them from the longest holder under
`cluster.fetch_timeout_s`:

- over NIXL where both nodes have an agent: the holder pins the blocks and
  answers their offsets, the blocks are READ into the reserved slots, and
  the release of the pins hands over the holder's per-layer CRC-32Cs
  (pins still held at the release were held for the whole READ; pins gone
  by then vouch for nothing, and the blocks are misses). A READ that
  fails is tried again over the stream;
- over the holder's ReadBlocks stream otherwise: each message's blocks
  are checked (position, size and every layer's CRC-32C, one native call
  per message) before they are written to their slots.

While bytes may land in the reserved slots, their lease is held
(kvd.core.lease_use.Fill): it cannot end, nor its slots be freed and given
to another block, under them. Then the verified prefix is sealed (these
are ordinary local blocks from then on, published to the directory like
any other) and the rest of the reservation is aborted; a lease that ended
meanwhile (its deadline, the drain) keeps nothing. A peer that dies, is
cut off or sends a wrong byte turns the rest of the fetch into misses,
never into wrong data. The Get then goes on as usual.

The plane works with plain values: the calls to peers are
kvd.cluster.peer_blocks's, and `Peers` below says what it asks of them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

import numpy as np

from kvd.core.engine import Engine, KeysRequest, ReserveResult, ReserveStatus
from kvd.core.keys import NamespaceSpec
from kvd.core.lease_use import Fill, FillPhase
from kvd.errors import KvdError, PeerCallFailed
from kvd.io.checksum import crc32c_chunks, crc32c_of_buffers
from kvd.planner.load_time import RateMeter
from kvd.tiers.host import HostArena

log = logging.getLogger("kvd.cluster")

# The client id of the fetch leases, which hold the reserved slots while the bytes arrive.
FETCH_CLIENT = "kvd-cluster-fetch"
# A NIXL fetch READs in pieces of about this size, checking each while the next one lands.
READ_PIECE_BYTES = 32 << 20


class PinnedBlocks(Protocol):
    """Blocks a holder pinned for a READ (kvd.cluster.peer_blocks.PeerPin)."""

    lease_id: int
    offsets: Sequence[int]
    block_bytes: int
    arena_address: int
    grant: bytes


class Peers(Protocol):
    """What a fetch asks of other nodes (kvd.cluster.peer_blocks.PeerBlocks); `keys` is always the
    chain from its root, and `first` the position of the first block wanted."""

    async def holder(self, namespace_id: bytes, keys: Sequence[bytes], local: int) -> tuple[str, int] | None: ...

    def reachable(self, peer: str) -> bool: ...

    def over_nixl(self, peer: str) -> bool: ...

    def read_blocks(self, peer: str, namespace_id: bytes, keys: Sequence[bytes], first: int, lease_ms: int,
                    timeout_s: float) -> AsyncIterator[tuple[int, list[bytes], list[int]]]: ...

    async def pin(self, peer: str, namespace_id: bytes, keys: Sequence[bytes], first: int, lease_ms: int,
                  timeout_s: float) -> PinnedBlocks | None: ...

    async def read(self, peer: str, pin: PinnedBlocks, local: list[int], remote: list[int], length: int,
                   timeout_s: float) -> tuple[bool, asyncio.Future | None]: ...

    async def release(self, peer: str, lease_id: int) -> list[int] | None: ...


class ClusterFetch:
    def __init__(self, engine: Engine, arena: HostArena, now_ms: Callable[[], int], peers: Peers,
                 fetch_timeout_s: float) -> None:
        self.engine = engine
        self.arena = arena
        self.now_ms = now_ms
        self.peers = peers
        self.fetch_timeout_s = fetch_timeout_s
        # The fetch's leases (its reservation here, the holder's pins for a READ) outlive its deadline.
        self.lease_ms = int(fetch_timeout_s * 1000) + 1000
        # Blocks sealed here from peers, by transport; fetches cut short (kvd_cluster_* metrics).
        # Blocks sealed here from peers, by (peer, transport); fetches cut short, by peer.
        self.fetched_blocks: collections.Counter[tuple[str, str]] = collections.Counter()
        self.failed_fetches: collections.Counter[str] = collections.Counter()
        # Seconds fetches spent in each stage, by (transport, stage), whole ones included ("whole"),
        # and the bytes they moved, by transport: a NIXL READ's own rate beside the whole fetch's,
        # and each transport's fetch beside the other's (kvd_cluster_fetch_*).
        self.stage_seconds: collections.Counter[tuple[str, str]] = collections.Counter()
        self.moved_bytes: collections.Counter[str] = collections.Counter()
        # Bytes per second of whole fetches, lookup included: what a remote hit costs now.
        self.rate = RateMeter()
        # Where a bug in a callback goes (the daemon's supervisor: kvd stops loudly).
        self.on_bug: Callable[[str, BaseException], None] = _raise_bug

    async def fetch_for_get(self, namespace_id: bytes, keys: list[bytes]) -> int:
        """Bring the part of `keys` (a chain from its root) that a peer holds and this node lacks;
        how many blocks were sealed."""
        local = len(self.engine.lookup(namespace_id, keys))
        if local >= len(keys):
            return 0
        started = time.perf_counter()
        holder = await self.peers.holder(namespace_id, keys, local)
        if holder is None:
            return 0
        peer, matched = holder
        looked_up = time.perf_counter() - started
        if self.peers.over_nixl(peer):
            fetched = await self._fetch_nixl(peer, namespace_id, keys, local, matched)
            if fetched is not None:
                self._timed("nixl", lookup=looked_up, whole=time.perf_counter() - started)
                self._rated(namespace_id, fetched, time.perf_counter() - started)
                return fetched
        fetched = await self._fetch(peer, namespace_id, keys, local, matched)
        self._timed("grpc", lookup=looked_up, whole=time.perf_counter() - started)
        self._rated(namespace_id, fetched, time.perf_counter() - started)
        return fetched

    def _timed(self, transport: str, **stages: float) -> None:
        for stage, seconds in stages.items():
            self.stage_seconds[transport, stage] += seconds

    def _rated(self, namespace_id: bytes, fetched: int, seconds: float) -> None:
        """A whole fetch that brought blocks feeds the fetch rate (LookupResponse.load_s)."""
        if fetched:
            self.rate.add(fetched * self.engine.namespace(namespace_id).spec.block_bytes, seconds, time.perf_counter())

    def _reserve(self, peer: str, namespace_id: bytes, keys: list[bytes], first: int, end: int) -> ReserveResult | None:
        """Host slots for keys[first:end] under a fetch lease; None when nothing could be reserved."""
        reserve = KeysRequest(namespace_id, FETCH_CLIENT, keys[first:end], self.lease_ms, self.now_ms(),
                              parent_key=keys[first - 1] if first else b"")
        try:
            result = self.engine.reserve(reserve)
        except KvdError as error:
            log.info("remote fetch skipped: no room", extra={"peer": peer, "reason": error.message})
            return None
        return result if result.lease is not None else None

    def _reserved_slots(self, result: ReserveResult) -> tuple[list[int], list[int]]:
        """(positions of the reserved keys, arena offsets of their slots)."""
        positions = [i for i, status in enumerate(result.statuses) if status == ReserveStatus.RESERVED]
        return positions, self.engine.host.pool.offsets_of([result.slots[i] for i in positions])

    def _seal(self, peer: str, fill: Fill, verified: int, transport: str) -> int:
        """Seal the first `verified` reserved blocks and give the rest back: a cut-short fetch leaves
        misses, not holes; one whose lease ended meanwhile, only misses (Fill.landed)."""
        sealed = fill.landed(verified, self.now_ms())
        self.fetched_blocks[peer, transport] += sealed
        return sealed

    # -- over the holder's ReadBlocks stream -------------------------------------

    async def _fetch(self, peer: str, namespace_id: bytes, keys: list[bytes], first: int, end: int) -> int:
        if not self.peers.reachable(peer):
            return 0
        result = self._reserve(peer, namespace_id, keys, first, end)
        if result is None:
            return 0
        started = time.perf_counter()
        # Held while the stream's blocks are written into the slots: their lease cannot end and free them.
        fill = Fill(self.engine, result.lease)
        try:
            verified, cut_short = await self._receive(peer, namespace_id, keys, first, result)
        except BaseException:
            fill.let_lapse()
            raise
        self._timed("grpc", stream=time.perf_counter() - started)
        self.moved_bytes["grpc"] += verified * self.engine.namespace(namespace_id).spec.block_bytes
        sealed = self._seal(peer, fill, verified, "grpc")
        if fill.phase is FillPhase.LAPSED and not cut_short:
            self._cut_short(peer, verified, LeaseLapsed("the reservation's lease ended while its blocks arrived"))
        return sealed

    async def _receive(self, peer: str, namespace_id: bytes, keys: list[bytes], first: int,
                       result: ReserveResult) -> tuple[int, bool]:
        """Stream the blocks into their reserved slots: (how many reserved ones are verified, in order,
        whether the stream was cut short)."""
        spec = self.engine.namespace(namespace_id).spec
        end = first + len(result.statuses)
        positions, offsets = self._reserved_slots(result)
        slot_offsets = dict(zip(positions, offsets))
        stream = self.peers.read_blocks(peer, namespace_id, keys[:end], first, int(self.fetch_timeout_s * 1000),
                                        self.fetch_timeout_s)
        position, verified = first, 0
        try:
            async with asyncio.timeout(self.fetch_timeout_s), contextlib.aclosing(stream):
                async for message_first, blocks, crcs in stream:
                    good = await checked_prefix(message_first, blocks, crcs, position, end, spec)
                    for index, block in enumerate(blocks[:good], position - first):
                        offset = slot_offsets.get(index)
                        if offset is not None:
                            self.arena.write_at(offset, block)
                            verified += 1
                    position += good
                    if good < len(blocks):
                        raise ValueError(f"block {position} failed its size or per-layer CRC-32C check")
        except (PeerCallFailed, TimeoutError, ValueError) as error:
            self._cut_short(peer, position - first, error)
            return verified, True
        return verified, False

    def _cut_short(self, peer: str, fetched: int, error: BaseException) -> None:
        self.failed_fetches[peer] += 1
        reason = str(error) if isinstance(error, PeerCallFailed) else f"{type(error).__name__}: {error}"
        log.warning("remote fetch cut short", extra={"peer": peer, "fetched": fetched, "reason": reason})

    # -- over NIXL -------------------------------------------------------------------

    async def _fetch_nixl(self, peer: str, namespace_id: bytes, keys: list[bytes], first: int, end: int) -> int | None:
        """Pin on the holder, READ into reserved slots, release (which hands over the checksums),
        verify, seal; None: use the gRPC stream instead."""
        started = time.perf_counter()
        pin = await self.peers.pin(peer, namespace_id, keys[:end], first, self.lease_ms, self.fetch_timeout_s)
        self._timed("nixl", pin=time.perf_counter() - started)
        if pin is None:
            return None
        released = False
        try:
            sealed, read = await self._read_pinned(peer, namespace_id, keys, first, pin)
            released = True
            # A READ that failed (not a bad checksum) is tried again over the gRPC stream.
            return sealed if read else None
        finally:
            if not released:
                await self.peers.release(peer, pin.lease_id)

    async def _read_pinned(self, peer: str, namespace_id: bytes, keys: list[bytes], first: int,
                           pin: PinnedBlocks) -> tuple[int, bool]:
        """(blocks sealed, whether the READ itself completed); releases the pins either way."""
        spec = self.engine.namespace(namespace_id).spec
        result = None
        if pin.offsets and pin.block_bytes == spec.block_bytes:
            result = self._reserve(peer, namespace_id, keys, first, first + len(pin.offsets))
        if result is None:
            await self.peers.release(peer, pin.lease_id)
            return 0, True
        positions, offsets = self._reserved_slots(result)
        local = np.array([self.arena.address_at(offset) for offset in offsets], dtype=np.uint64)
        remote = np.array([pin.arena_address + pin.offsets[i] for i in positions], dtype=np.uint64)
        started = time.perf_counter()
        # Held while the READ may write into the slots: their lease cannot end (expire) and free them.
        fill = Fill(self.engine, result.lease)
        try:
            read, running, computed = await self._read_in_pieces(peer, pin, local, remote, spec)
            read_at = time.perf_counter()
            # Released only now: pins that were still held at the release were held for the whole READ.
            expected = await self.peers.release(peer, pin.lease_id)
        except BaseException:  # cancelled, or a bug: a READ may still be landing
            fill.let_lapse()
            raise
        released_at = time.perf_counter()
        if running is not None:
            self._keep_reserved_until(running, fill)
            self.failed_fetches[peer] += 1
            return 0, read
        verified = 0 if fill.lapsed or not read else self._vouched_for(peer, first, pin, positions, computed,
                                                                       expected, spec)
        verified_at = time.perf_counter()
        sealed = self._seal(peer, fill, verified, "nixl")
        if fill.phase is FillPhase.LAPSED or not read:  # lapsed: expired during the READ, its slots free again
            self.failed_fetches[peer] += 1
        if fill.phase is FillPhase.LAPSED:
            return 0, read
        sealed_at = time.perf_counter()
        self._timed("nixl", read=read_at - started, release=released_at - read_at, verify=verified_at - released_at,
                    seal=sealed_at - verified_at)
        self.moved_bytes["nixl"] += len(positions) * spec.block_bytes if read else 0
        log.debug("NIXL fetch", extra={"peer": peer, "blocks": len(positions), "read_ms": _ms(started, read_at),
                                       "release_ms": _ms(read_at, released_at), "verify_ms": _ms(released_at, verified_at),
                                       "seal_ms": _ms(verified_at, sealed_at)})
        return sealed, read

    @staticmethod
    def _vouched_for(peer: str, first: int, pin: PinnedBlocks, positions: list[int], computed: np.ndarray,
                     expected: list[int] | None, spec: NamespaceSpec) -> int:
        """How many READ blocks, in order, the checksums the release handed over vouch for."""
        if expected is None or len(expected) != len(pin.offsets) * spec.num_layers:
            log.warning("NIXL read not verified: the holder's pins were gone", extra={"peer": peer})
            return 0
        expected = np.array(expected, dtype=np.uint32).reshape(len(pin.offsets), spec.num_layers)[positions]
        return _verified_prefix(peer, first, computed, expected)

    async def _read_in_pieces(self, peer: str, pin: PinnedBlocks, local: np.ndarray, remote: np.ndarray,
                              spec: NamespaceSpec) -> tuple[bool, asyncio.Future | None, np.ndarray]:
        """READ the blocks in pieces of about READ_PIECE_BYTES, each piece's per-layer CRC-32Cs computed
        on a worker thread while the next piece lands: (whether every piece arrived in time, a future
        when a READ could not be cancelled (see Peers.read), the CRC-32Cs [blocks read, layers])."""
        per_piece = max(1, READ_PIECE_BYTES // spec.block_bytes)
        deadline = time.monotonic() + self.fetch_timeout_s
        checksums: list[asyncio.Future] = []
        read, running = True, None
        try:
            for start in range(0, len(local), per_piece):
                piece = slice(start, start + per_piece)
                read, running = await self.peers.read(peer, pin, local[piece].tolist(), remote[piece].tolist(),
                                                      spec.block_bytes, max(0.0, deadline - time.monotonic()))
                if not read:
                    break
                checksums.append(asyncio.ensure_future(asyncio.to_thread(
                    crc32c_chunks, local[piece], spec.layer_bytes, spec.num_layers)))
        finally:
            # Every checksum thread reads the slots: all end before the caller may give them back.
            computed = await asyncio.gather(*checksums, return_exceptions=True)
        for crcs in computed:
            if isinstance(crcs, BaseException):
                raise crcs
        rows = np.concatenate(computed) if computed else np.zeros((0, spec.num_layers), dtype=np.uint32)
        return read, running, rows

    def _keep_reserved_until(self, running: asyncio.Future, fill: Fill) -> None:
        """A READ that could not be cancelled may still write into the reserved slots: they stay
        reserved (the fill holds their lease since the READ began: no expiry, no reuse) until it has
        ended, then are given back."""
        def ended(_running) -> None:
            try:
                fill.abandon(self.now_ms())  # a lease that expired meanwhile ends here, its slots freed
            except Exception as error:  # a bug, in a callback no task awaits: to the supervisor
                self.on_bug("giving back the slots of a READ that could not be cancelled", error)
        running.add_done_callback(ended)


class LeaseLapsed(Exception):
    """A fetch's reservation lease ended (expired, drained) before its blocks were sealed."""


def _raise_bug(what: str, error: BaseException) -> None:
    """Without a supervisor (tests): the bug is raised where it happened."""
    raise error


def _verified_prefix(peer: str, first: int, computed: np.ndarray, expected: np.ndarray) -> int:
    """How many blocks, in order, have the per-layer CRC-32Cs the holder computed under its pins."""
    mismatch = np.flatnonzero((computed != expected).any(axis=1))
    if len(mismatch):
        log.warning("NIXL read failed its CRC-32C check", extra={"peer": peer, "block": first + int(mismatch[0])})
        return int(mismatch[0])
    return len(expected)


async def checked_prefix(first: int, blocks: list[bytes], crcs: list[int], position: int, end: int,
                         spec: NamespaceSpec) -> int:
    """How many of a ReadBlocks message's blocks, in order, pass their size and per-layer CRC-32C
    checks; ValueError for a message out of place or of the wrong shape."""
    if first != position:
        raise ValueError(f"a ReadBlocks message for position {first}, expected {position}")
    count = len(blocks)
    if position + count > end:
        raise ValueError("more blocks than asked for")
    if len(crcs) != count * spec.num_layers:
        raise ValueError(f"{len(crcs)} checksums for {count} blocks of {spec.num_layers} layers")
    sized = next((i for i, block in enumerate(blocks) if len(block) != spec.block_bytes), count)
    if not sized:
        raise ValueError(f"block {position} is not {spec.block_bytes} bytes")
    computed = await asyncio.to_thread(crc32c_of_buffers, blocks[:sized], spec.layer_bytes, spec.num_layers)
    expected = np.array(crcs, dtype=np.uint32).reshape(count, spec.num_layers)[:sized]
    mismatch = np.flatnonzero((computed != expected).any(axis=1))
    return int(mismatch[0]) if len(mismatch) else sized


def _ms(start: float, end: float) -> float:
    return round((end - start) * 1000, 2)
