"""The device plane's calls (engines' pools, kvd-driven SaveLayers and LoadLayers) and
placement planning (PlanPlacement, ReportStep).

A part of kvd.server.service.KvdService (its handlers by concern); they share the
service's state and reach each other's helpers through self."""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from kvd.core.block import NO_SLOT
from kvd.core.engine import ReserveStatus
from kvd.core.lease_use import Fill, FillPhase, ReadPin
from kvd.core.reads import GetCut
from kvd.core.requests import KeysRequest
from kvd.errors import FailedPrecondition, InvalidArgument, KvdError
from kvd.invariants import check
from kvd.planes.device_loads import CANCEL_POLL_S, cancel_word, load_landed, nothing_issued
from kvd.planner.distance import NONE
from kvd.tiers.host import DEFAULT_TENANT
from kvd.server import convert
from kvd.server.rpc import rpc

log = logging.getLogger(__name__)


class DeviceHandlers:
    def _tenant_name(self) -> str:
        tenant = self._caller()
        return tenant.name if tenant is not None else DEFAULT_TENANT

    @rpc("PlanPlacement")
    async def PlanPlacement(self, request, context):
        return await self.planning.plan(request, self._tenant_name())

    @rpc("ReportStep")
    async def ReportStep(self, request, context):
        return self.planning.report(request, self._tenant_name())

    def _device_plane(self):
        if self.device_plane is None:
            raise FailedPrecondition("this kvd has no device plane ([device] kind = \"off\")")
        return self.device_plane

    @rpc("RegisterPool")
    async def RegisterPool(self, request, context):
        plane = self._device_plane()
        await plane.sweep(self.clock.now_ms())
        spec = self.engine.namespace(request.namespace_id).spec
        ring_fds = self.disk_plane.segment_fds() if request.io_ring and self.disk_plane is not None else None
        pool = plane.register(request, spec.num_layers, spec.layer_bytes, self.clock.now_ms(), self._tenant_name(),
                              ring_fds)
        return convert.register_pool_response(pool)

    @rpc("UnregisterPool")
    async def UnregisterPool(self, request, context):
        await self._device_plane().unregister(request.client_id, request.pool_id)
        return convert.unregister_pool_response()

    def _device_pool(self, request, flags: dict[str, int]):
        plane = self._device_plane()
        pool = plane.pool(request.client_id, request.pool_id, request.namespace_id)
        plane.renew(pool, self.clock.now_ms())
        return plane, pool, plane.check_transfer(pool, request.keys, request.pages, flags, request.base)

    @rpc("SaveLayers")
    async def SaveLayers(self, request, context):
        plane, pool, pages = self._device_pool(request, {"engine_flag": request.engine_flag,
                                                         "kvd_flag": request.kvd_flag})
        distance = _offload_distance(request.offload_distance, len(pool.layout.layers))
        result = await self._reserve(request, 0)
        reserved = [i for i, status in enumerate(result.statuses) if status == ReserveStatus.RESERVED]
        offsets = self._reserved_offsets(result.slots)
        keys = [request.keys[i] for i in reserved]
        lease = result.lease
        writing = {handle.key: handle.block for handle in lease.handles if handle.writable} if lease else {}
        # The copies write into the reserved slots after this call yields: the fill holds the
        # lease, which cannot end (expire, drain) and free them under the copy.
        fill = Fill(self.engine, lease) if lease is not None else None
        try:
            done = await plane.save(pool, pages[reserved], [offsets[i] for i in reserved], request.engine_flag,
                                    request.kvd_flag, request.base, keys, [writing[key] for key in keys], distance)
        except BaseException:
            if fill is not None:
                fill.abandon(self.clock.now_ms())
            raise
        stored = self._commit_saved(fill, len(keys))
        return convert.save_layers_response(result.statuses, stored, done)

    def _commit_saved(self, fill: Fill | None, copied: int) -> int:
        """Seal the `copied` blocks a SaveLayers reserved, all of them; refused by name when its lease
        ran out meanwhile."""
        if fill is None:
            return 0
        stored = fill.landed(copied, self.clock.now_ms())
        if fill.phase is FillPhase.LAPSED:
            raise FailedPrecondition(
                f"the SaveLayers' reservation lease ran out (leases.default_ms) while kvd copied its layers, so "
                f"nothing is stored; {copied} blocks were not kept")
        if self.disk_plane is not None:
            self.disk_plane.wake()
        return stored

    @rpc("LoadLayers")
    async def LoadLayers(self, request, context):
        flags = {"kvd_flag": request.kvd_flag}
        if request.HasField("cancel_flag"):
            if request.cancel_flag == request.kvd_flag:
                raise InvalidArgument(f"cancel_flag must be a word other than kvd_flag ({request.kvd_flag})")
            flags["cancel_flag"] = request.cancel_flag
        plane, pool, pages = self._device_pool(request, flags)
        cancelled = cancel_word(pool, flags.get("cancel_flag"), request.base)
        get = KeysRequest(request.namespace_id, request.client_id, list(request.keys), 0, self.clock.now_ms(),
                          parent_key=request.parent_key)
        await self._fetch_remote(get)
        if pool.ring is not None:
            return await self._load_in_place(plane, pool, pages, request, cancelled)
        life = await self._begin_get(get, request.client_id)
        if life.pending and not life.plan.waits:
            # Disk reads of its own only: each layer goes to the engine as it lands (device_loads).
            return self._load_as_read(plane, pool, pages, request, life, cancelled)
        pinned = await self._settled_unless_cancelled(life, get, cancelled)
        if pinned is None:  # cancelled while the Get waited for other requests' reads: nothing issued
            done = request.base + len(pool.layout.layers)
            pool.begin()  # (NotFound if the pool went meanwhile: its flag memory with it)
            await load_landed(pool, request.kvd_flag, done, lambda: None, nothing_issued())  # FAILED, then end
            return convert.load_layers_response(0, done, [], b"", GetCut.NONE)
        lease, matched, tiers, cut, offsets = pinned
        # Copied out of the pinned slots on a device stream after this call returns: held,
        # the lease cannot end (expire, drain) and let them go before the copy has landed.
        landed = self._close_when_landed(ReadPin(self.engine, lease).hold())
        try:
            done, from_tier = plane.load(pool, pages[:len(matched)], request.keys[:len(matched)], matched,
                                         self._offsets(lease, offsets), request.kvd_flag, request.base, landed,
                                         cancelled=cancelled)
        except BaseException:
            landed()
            raise
        return convert.load_layers_response(len(matched), done, from_tier, tiers, cut)

    async def _settled_unless_cancelled(self, life, get, cancelled):
        """_settled_get; or None if the engine cancels the load first (looked at every
        CANCEL_POLL_S): the Get is let go, and its reads finish into kvd's own slots."""
        settling = asyncio.ensure_future(self._settled_get(life, get))
        while cancelled is not None and not settling.done():
            await asyncio.wait({settling}, timeout=CANCEL_POLL_S)
            if not settling.done() and cancelled():
                settling.cancel()
                try:
                    await settling
                except asyncio.CancelledError:
                    if asyncio.current_task().cancelling():
                        raise  # this call itself is being cancelled
                return None if settling.cancelled() else settling.result()
        return await settling

    def _close_when_landed(self, pin: ReadPin, staged=()):
        """What ends a load's lease (held by `pin`) once its copies have landed (the Get's pins go
        with it); the host copies of `staged` blocks (read from disk only to reach the engine, leaf
        first) then go, where nothing else pins them."""
        def landed() -> None:
            pin.release()
            if staged:
                self.engine.demote(staged, chains=False)
        return landed

    def _load_as_read(self, plane, pool, pages, request, life, cancelled):
        """Answer at once; the layers follow the disk reads (the engine waits on the flag word).
        A read that fails later turns the flag FAILED: the engine recomputes."""
        plan = life.plan
        matched, lease = list(plan.matched), plan.lease
        # Held from now: the slots are read by the device stream until the last copy lands, even if
        # the Get ends early (its pins then go only when the lease is closed after that).
        pin = ReadPin(self.engine, lease).hold()
        steps: asyncio.Queue = asyncio.Queue()
        getting = self.disk_plane.start_get(life, on_layer=lambda layer, ok: steps.put_nowait((layer, ok)))
        staged = [] if self.keep_disk_loads_in_host else [load.block for load in reversed(plan.loads)]
        landed = self._close_when_landed(pin, staged)
        try:
            done, from_tier = plane.load(pool, pages[:len(matched)], request.keys[:len(matched)], matched,
                                         self._offsets(lease, life.offsets), request.kvd_flag, request.base, landed,
                                         reading=(steps, getting), cancelled=cancelled)
        except BaseException:
            getting.cancel()
            landed()
            raise
        return convert.load_layers_response(len(matched), done, from_tier, life.tiers, plan.cut)

    async def _load_in_place(self, plane, pool, pages, request, cancelled):
        """A pool with an I/O ring: blocks in host memory are copied by kvd as for any load (the
        flag word), blocks only on disk are granted to the engine's ring and read from their disk
        slots straight into the pages; the lease ends once both are over."""
        placed = self.engine.pin_in_place(KeysRequest(request.namespace_id, request.client_id, list(request.keys),
                                                      0, self.clock.now_ms(), parent_key=request.parent_key))
        matched, lease = placed.matched, placed.lease
        by_ring = np.array([slot != NO_SLOT for slot in placed.disk_slots], dtype=bool)
        keys = list(request.keys[:len(matched)])
        landed = _after(2 if by_ring.any() else 1, self._close_when_landed(ReadPin(self.engine, lease).hold()))
        try:
            ring = None
            if by_ring.any():
                rows = np.nonzero(by_ring)[0]
                places = await self.disk_plane.places(request.namespace_id, [keys[i] for i in rows],
                                                      [placed.disk_slots[i] for i in rows])
                ring = plane.load_by_ring(pool, pages[rows], places, landed,
                                          lambda bad: self._check_bad_reads(request, [keys[rows[i]] for i in bad]))
            host = np.nonzero(~by_ring)[0]
            done, _ = plane.load(pool, pages[host], [keys[i] for i in host], [matched[i] for i in host],
                                 [placed.host_offsets[i] for i in host], request.kvd_flag, request.base, landed,
                                 cancelled=cancelled)
        except BaseException:
            if ring is None and by_ring.any():
                landed()  # the ring's part never started: its end never comes
            landed()
            raise
        return convert.load_layers_response(len(matched), done, [False] * len(matched),
                                            self.engine.tier_bytes(matched), GetCut.NONE, by_ring=by_ring.tolist(),
                                            ring=ring)

    def _check_bad_reads(self, request, bad_keys: list[bytes]) -> None:
        """Blocks a ring read of which failed (the drive, or the bytes' CRC-32C) are read once more
        through kvd's own path, which drops a block that fails its checksum (with the chain under
        it), journals that and counts it: the index never keeps offering a block it cannot serve."""
        last = list(request.keys).index(bad_keys[-1])
        get = KeysRequest(request.namespace_id, request.client_id, list(request.keys[:last + 1]), 0,
                          self.clock.now_ms(), parent_key=request.parent_key)

        async def reread() -> None:
            try:
                lease = (await self._pinned_prefix(get, request.client_id)).lease
            except KvdError as error:  # the namespace went, the daemon drains, ...: nothing to check now
                log.warning("a ring load's failed blocks were not read again", extra={"reason": str(error)})
                return
            ReadPin(self.engine, lease).release()
        self.device_plane.spawn(reread())


def _after(count: int, then):
    """A callable that runs `then` on its `count`th call."""
    left = [count]

    def one() -> None:
        left[0] -= 1
        check(left[0] >= 0, "a load's end was reported more often than it has parts")
        if not left[0]:
            then()
    return one


def _offload_distance(distance: int, layers: int) -> int:
    """SaveLayers' offload_distance as the planner's (NONE for 0 or -1), or INVALID_ARGUMENT."""
    if distance in (0, NONE):
        return NONE
    if not 1 <= distance < layers:
        raise InvalidArgument(f"offload_distance must be -1 or 0 (every layer kept) or in [1, {layers - 1}] for "
                              f"{layers} layers, got {distance}")
    return distance
