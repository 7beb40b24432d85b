"""A pool's I/O ring: disk hits read at the engine's request straight into its pages.

A pool registered with `io_ring` gets a ring (kvd.device.io_ring.RingMemory: a memfd the engine
maps, handed over the arena socket to whoever names the pool's ring token) and a proxy thread that
reads only the disk tier's segment files, only into the pool's layer memory, and only what this
daemon granted. A LoadLayers of blocks that are only on disk grants one read per block and layer
(file, offset, length, target page, layer, crc32c) and answers them; the engine publishes them
(the submit kernel on a GPU, io_ring_publish on the host), the proxy reads each into staging,
checks its crc32c, copies it to the page and counts it in its layer, and the engine waits on the
layer's count (the wait kernel, or RingMemory.wait). No host-tier slot is taken.

    LoadLayers --grant--> proxy's table      engine --publish--> ring --proxy--> pages, done[layer]
         \\--answer: the reads--> engine       kvd polls the grants: all over, or revoked at the deadline

A load's grants are one contiguous range of tags, layer-major (tag = first + layer * blocks +
block), so a layer's reads go out as one launch with first_tag = first + layer * blocks. Its
lease, and the blocks' pins, end once every grant was read or, at the deadline, revoked (a read
already taken is let finish first): the slots cannot be reused under a read.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass

import numpy as np

from kvd.device.io_ring import GRANT_FAILED, GRANT_OUT, GRANT_VERIFIED, RingMemory, start_proxy
from kvd.device.transfer import PoolLayout
from kvd.errors import ResourceExhausted
from kvd.invariants import check

GRANTS = 1 << 20          # grants one pool's proxy holds at a time (blocks x layers of its loads; 64 B each, touched as used)
RING_CAPACITY = 4096      # descriptors in flight between the engine and the proxy
STAGING_BYTES = 32 << 20  # the proxy's staging, two halves: one read at most half
POLL_S = 0.001            # how often kvd looks at a load's grants


class TagRanges:
    """First-fit ranges of grant tags: a load takes one contiguous range and gives it back whole."""

    def __init__(self, count: int) -> None:
        self.free: list[tuple[int, int]] = [(0, count)]  # (first, length), sorted, disjoint, not touching

    def take(self, length: int) -> int | None:
        for i, (first, free) in enumerate(self.free):
            if free >= length:
                self.free[i:i + 1] = [(first + length, free - length)] if free > length else []
                return first
        return None

    def give(self, first: int, length: int) -> None:
        ranges = sorted([*self.free, (first, length)])
        merged: list[tuple[int, int]] = []
        for start, size in ranges:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + size)
            else:
                check(not merged or merged[-1][0] + merged[-1][1] < start, "grant tags {} given back twice", first)
                merged.append((start, size))
        self.free = merged


@dataclass(slots=True, eq=False)
class RingLoad:
    """One LoadLayers' grants: rows of READ_FIELDS, layer-major, and their stamps."""

    rows: np.ndarray
    stamps: np.ndarray
    blocks: int

    @property
    def first_tag(self) -> int:
        return int(self.rows[0, 6])


class PoolRing:
    """The ring, the proxy and the grants of one pool."""

    def __init__(self, layout: PoolLayout, device, fds: list[int]) -> None:
        self.layout = layout
        self.memory = RingMemory(RING_CAPACITY, len(layout.layers))
        split = (layout.page_bytes // 2, layout.v_offset) if layout.v_offset else (0, 0)
        try:
            self.proxy = start_proxy(device, self.memory, fds, list(layout.layers), staging_bytes=STAGING_BYTES,
                                     grants=GRANTS, split=split)
        except BaseException:
            self.memory.close()
            raise
        self.token = secrets.token_hex(16)
        self.tags = TagRanges(GRANTS)
        self._stamps = 0

    def grant(self, pages: np.ndarray, files: np.ndarray, offsets: np.ndarray, checksums: np.ndarray) -> RingLoad:
        """Grants the reads of every layer of the blocks (on the drives at files/offsets, checksums
        [blocks, layers]) into `pages`; ResourceExhausted when the pool has too many out already."""
        layout, blocks = self.layout, len(pages)
        layers = len(layout.layers)
        count = blocks * layers
        first = self.tags.take(count)
        if first is None:
            raise ResourceExhausted(f"the pool's I/O ring has its {GRANTS} grants out to earlier loads; "
                                    f"this one needs {count} (blocks x layers): load fewer blocks at a time")
        layer_of = np.repeat(np.arange(layers, dtype=np.uint64), blocks)
        block_of = np.tile(np.arange(blocks), layers)
        bases = np.array([memory.address for memory in layout.layers], dtype=np.uint64)
        rows = np.empty((count, 7), dtype=np.uint64)
        rows[:, 0] = np.asarray(files, dtype=np.uint64)[block_of]
        rows[:, 1] = np.asarray(offsets, dtype=np.uint64)[block_of] + layer_of * np.uint64(layout.page_bytes)
        rows[:, 2] = layout.page_bytes
        rows[:, 3] = bases[layer_of] + np.asarray(pages, dtype=np.uint64)[block_of] * np.uint64(layout.stride)
        rows[:, 4] = layer_of
        rows[:, 5] = np.asarray(checksums, dtype=np.uint64).T.reshape(-1)
        rows[:, 6] = np.arange(first, first + count, dtype=np.uint64)
        stamps = np.arange(self._stamps + 1, self._stamps + 1 + count, dtype=np.uint64)
        self._stamps += count
        try:
            self.proxy.grant(rows, stamps)
        except BaseException:
            self.proxy.settle(rows[:, 6], stamps, revoke=True)
            self.tags.give(first, count)
            raise
        return RingLoad(rows, stamps, blocks)

    async def settle(self, load: RingLoad, deadline: float) -> np.ndarray:
        """Once every grant of the load was read, or at `deadline` (time.monotonic) revoked (a read
        taken by then is let finish): how each ended (GRANT_*, in the load's row order). Its tags
        are free again."""
        tags, stamps = load.rows[:, 6], load.stamps
        final = np.full(len(tags), GRANT_OUT, dtype=np.int8)
        while True:
            out = np.nonzero(final == GRANT_OUT)[0]
            if not out.size:
                break
            final[out] = self.proxy.settle(tags[out], stamps[out], revoke=time.monotonic() >= deadline)
            if (final == GRANT_OUT).any():
                await asyncio.sleep(POLL_S)
        self.tags.give(load.first_tag, len(tags))
        return final

    def close(self) -> None:
        """Stops the proxy (its reads in hand finish first), then unmaps the ring. The pool's
        transfers must be over: nothing may still wait on a grant."""
        self.proxy.stop()
        self.memory.close()


async def settle_load(pool, load: RingLoad, deadline: float, counts: dict[str, int], on_settled,
                      on_bad_reads) -> None:
    """A ring load's end: once its grants are settled (PoolRing.settle), counted in `counts`
    (verified or failed), the pool's transfer ends and `on_settled()` runs. Blocks a read of which
    was taken and failed (the drive, or the bytes' CRC-32C: never an engine's forgery, which takes
    no grant) go to `on_bad_reads(positions)` after that, positions in the load's blocks."""
    final = None
    try:
        final = await pool.ring.settle(load, deadline)
        counts["verified" if (final == GRANT_VERIFIED).all() else "failed"] += 1
    finally:
        pool.end()
        on_settled()
    bad = np.unique(np.nonzero(final == GRANT_FAILED)[0] % load.blocks)
    if bad.size:
        on_bad_reads(bad.tolist())


def ring_answer(pools, tenant: str, token: str) -> tuple[dict, int]:
    """The arena socket's answer to {"op": "ring"}: the memfd of the ring `token` names, to the
    tenant whose pool it is; NOT_FOUND for anyone else, alike whether the token exists."""
    for pool in pools:
        ring = pool.ring
        if ring is not None and not pool.closing and secrets.compare_digest(ring.token, token) \
                and pool.tenant == tenant:
            return {"ok": True, "capacity": ring.memory.capacity, "layers": ring.memory.layers}, ring.memory.fd
    return {"ok": False, "code": "NOT_FOUND", "message": "no pool of this tenant has that ring token "
                                                          "(unregistered, or a token of another tenant)"}, -1
