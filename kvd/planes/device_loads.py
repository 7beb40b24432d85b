"""A LoadLayers whose blocks are still being read from disk: each layer goes to the engine as it lands.

The disk plane reads the Get's blocks in extents of whole layers, verifying
each layer's CRC-32C in the read (kvd.tiers.disk.reads), into host-arena
slots that serve as the staging buffer (pinned host memory, registered with
the device). As soon as layer l of every block has landed and checked out,
its copies into the engine's pages are issued on the pool's stream, then
the flag word that tells the engine layer l is there: attention of layer 0
may run while the drives still read layer 1. Without this, a disk hit went
disk -> host tier -> device only once the whole Get had landed.

A read that fails (a media error, a checksum that does not match) or a Get
that ends early stops the issuing: once every copy issued so far has landed,
the flag word gets the FAILED mark, so the engine recomputes instead of
reading pages kvd no longer vouches for. Layers flagged before the failure
were good (each flag covers every block of that layer), so nothing the
engine already used was wrong.

A load the engine cancels (LoadLayersRequest.cancel_flag: it stores the
load's base into a flag word of its own, once computing the blocks would be
sooner) ends the same way: no layer is issued after kvd reads the cancel,
the Get is let go (its reads finish into kvd's own slots), and FAILED is
stored once the copies already issued have landed. kvd looks at the cancel
word as each layer lands and every CANCEL_POLL_S while it waits for one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from kvd.core.get_life import Served
from kvd.core.reads import GetCut
from kvd.device import DeviceError
from kvd.device.cpu import read_flag, store_flag
from kvd.device.transfer import ABSENT, FAILED, load_layer, load_layers, load_places

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.002  # how often a load waiting for its next layer looks at its cancel word


def cancel_word(pool, index: int | None, base: int) -> Callable[[], bool] | None:
    """Whether the engine has cancelled the load of `base` through flags[index] (None: no cancel word).
    A pool being unregistered counts as cancelled: its flag memory is about to go."""
    if index is None:
        return None
    return lambda: pool.closing or read_flag(pool.flags, index) >= base


async def nothing_issued() -> bool:
    """The issuing of a load cancelled before its first copy."""
    return False


def issue_now(pool, sources: list, kvd_flag: int, base: int, on_landed: Callable[[], None],
              cancelled: Callable[[], bool] | None) -> tuple[int, Awaitable[bool]]:
    """A load of blocks already in memory: every layer's copies issued at once, or none if the
    engine has cancelled it already. The flag value that means every layer landed, and the load's
    end to await (`load_landed`)."""
    if cancelled is not None and cancelled():
        done = base + len(pool.layout.layers)
        return done, load_landed(pool, kvd_flag, done, on_landed, nothing_issued())
    done = load_layers(pool.stream, pool.layout, sources, pool.flags_on_device, kvd_flag, base)
    return done, load_landed(pool, kvd_flag, done, on_landed)


@dataclass(slots=True)
class LayerLoad:
    """One pool's load as its layers land: `steps` gets (last layer landed, ok per load) from the
    disk plane's on_layer, `getting` is the Get's task (it ends with what the Get serves)."""

    pool: object
    sources: list
    kvd_flag: int
    base: int
    matched: int
    steps: asyncio.Queue
    getting: asyncio.Future
    cancelled: Callable[[], bool] | None = None  # the engine's cancel (cancel_word), if it gave one

    @property
    def done(self) -> int:
        return self.base + len(self.pool.layout.layers)

    async def run(self, on_landed: Callable[[], None]) -> bool:
        """Issue each layer as it lands, then end the load (`load_landed`). Whether every layer landed."""
        return await load_landed(self.pool, self.kvd_flag, self.done, on_landed, self._issue_as_landed())

    async def _issue_as_landed(self) -> bool:
        """Whether every layer was issued and the Get served every block it promised."""
        layout = self.pool.layout
        places = load_places(layout, self.sources)
        issued = 0
        while issued < len(layout.layers):
            step = await self._next_step()
            if step is None:
                break  # the Get ended before its last layer landed, or the engine cancelled
            layer, ok = step
            if not all(ok) or self._cancel():
                break  # a read failed, or the engine cancelled: it recomputes these blocks
            for next_layer in range(issued, layer + 1):
                load_layer(self.pool.stream, layout, places, next_layer, self.pool.flags_on_device, self.kvd_flag,
                           self.base)
            issued = layer + 1
        if issued < len(layout.layers) and self._cancel():
            self.getting.cancel()  # its reads still finish, into kvd's slots; nothing more is issued
        try:
            served: Served = await self.getting
        except (Exception, asyncio.CancelledError) as error:  # the Get failed or was cancelled: nothing more lands
            if isinstance(error, asyncio.CancelledError) and asyncio.current_task().cancelling():
                raise  # this load itself is being cancelled
            log.info("a load from disk into an engine's pool ended early", extra={"pool_id": self.pool.pool_id,
                                                                               "reason": repr(error)})
            return False
        return issued == len(layout.layers) and served.cut != GetCut.LEASE_ENDED and len(served.blocks) == self.matched

    async def _next_step(self) -> tuple[int, list[bool]] | None:
        """The next (layer, ok) the reads report, or None once the Get has ended with none left."""
        if not self.steps.empty():
            return self.steps.get_nowait()
        poll = CANCEL_POLL_S if self.cancelled is not None else None
        waiter = asyncio.ensure_future(self.steps.get())
        try:
            while not waiter.done():
                if self.getting.done() or self._cancel():
                    return None
                await asyncio.wait({waiter, self.getting}, timeout=poll, return_when=asyncio.FIRST_COMPLETED)
            return waiter.result()
        finally:
            waiter.cancel()  # (a no-op once it is done; its step, if any, stays queued otherwise)

    def _cancel(self) -> bool:
        return self.cancelled is not None and self.cancelled()


async def load_landed(pool, kvd_flag: int, done: int, on_landed: Callable[[], None],
                      issuing: Awaitable[bool] | None = None) -> bool:
    """The end of a load into an engine's pool, whichever way it was issued: once `issuing` (the
    copies still to issue; None: all issued) is over and the pool's stream has drained, the flag
    gets FAILED unless every layer was issued and landed; then the pool's transfer ends and
    `on_landed` runs. Whether every layer landed."""
    good = issuing is None
    try:
        if issuing is not None:
            good = await issuing
    finally:
        try:
            await asyncio.to_thread(pool.stream.synchronize)
        except DeviceError as error:
            # The stream skipped the layers' flags after the failure: release the engine's waits
            # with the failed mark rather than leave its stream waiting forever.
            good = False
            log.error("a load into an engine's pool failed", extra={"pool_id": pool.pool_id, "error": str(error)})
        if not good:
            # After the stream: no copy still lands in the pages once the engine reads FAILED.
            store_flag(pool.flags, kvd_flag, FAILED | done)
        pool.end()
        on_landed()
    return good


def load_sources(pool, tier, pages: np.ndarray, slot_offsets, entries) -> list:
    """A load's sources: the device tier for the layers its entries hold, the arena for the rest."""
    layout = pool.layout
    from_arena = np.asarray(slot_offsets, dtype=np.int64).reshape(-1, 1) \
        + np.arange(len(layout.layers), dtype=np.int64) * layout.page_bytes
    sources = [(pool.arena, pages, from_arena)]
    rows = [i for i, entry in enumerate(entries) if entry is not None]
    if rows:
        in_tier = np.stack([entries[i].offsets for i in rows])
        from_arena[rows] = np.where(in_tier == ABSENT, from_arena[rows], ABSENT)
        sources.append((tier.memory, pages[rows], in_tier))
    return sources
