"""Gets: unary (arena offsets or inline bytes) and streamed (GetLayers, GetBlocks), each
planned, read and settled through one kvd.core.get_life.GetLife.

A part of kvd.server.service.KvdService (its handlers by concern); they share the
service's state and reach each other's helpers through self."""

from __future__ import annotations

import asyncio
from typing import NamedTuple


from kvd.core.engine import KeysRequest
from kvd.core.get_life import GetLife, GetPhase, Served
from kvd.core.lease_use import ReadPin
from kvd.core.reads import GetCut
from kvd.errors import FailedPrecondition, ResourceExhausted
from kvd.invariants import check
from kvd.server import convert
from kvd.server.auth import scoped_client_id
from kvd.server.get_stream import BlockSteps, LayerSteps
from kvd.server.rpc import rpc, stream_rpc


# A Get short of host slots waits this long for one write-back batch, then takes what it can.
STARVED_GET_WAIT_S = 5.0
# Inline Gets pin under a lease of their own, never one a client can name.
INLINE_CLIENT_PREFIX = "inline\x00"


class Pinned(NamedTuple):
    """A Get planned, read and settled: its lease, the servable blocks, their tiers before the Get,
    why not more, and their offsets in the host arena."""

    lease: object
    blocks: list
    tiers: bytes
    cut: GetCut
    offsets: list[int]


class ReadHandlers:
    async def _begin_get(self, request, client_id: str) -> GetLife:
        """A Get planned (kvd.core.get_life): when host memory is held by blocks waiting for
        write-back, it waits for write rounds to make room, up to STARVED_GET_WAIT_S, or until
        the daemon drains; then it takes what there is."""
        loop = asyncio.get_running_loop()
        life = GetLife(self.engine, self.disk_plane.mover if self.disk_plane is not None else None,
                       loop.time() + STARVED_GET_WAIT_S)

        def keys_request() -> KeysRequest:
            return KeysRequest(request.namespace_id, client_id, list(request.keys), request.lease_ms,
                               self.clock.now_ms(), parent_key=request.parent_key)

        try:
            phase = life.begin(keys_request(), loop.time())
            while phase is GetPhase.WAITING_FOR_ROOM:
                left = life.room_deadline - loop.time()
                round_ended = await self._unless_draining(lambda: self.disk_plane.wait_for_round(left))
                phase = life.begin(keys_request(), loop.time(), final=not round_ended)
        except BaseException:
            if life.phase in (GetPhase.PLANNING, GetPhase.WAITING_FOR_ROOM):
                life.cancel()
            raise
        return life

    async def _pinned_prefix(self, request, client_id: str) -> Pinned:
        """A Get planned, read and settled (see Pinned)."""
        return await self._settled_get(await self._begin_get(request, client_id), request)

    async def _settled_get(self, life: GetLife, request) -> Pinned:
        """A planned Get read and settled (see Pinned)."""
        plan = life.plan
        if life.pending:
            # On failure the get task drops the Get itself (lease and pins), once no read
            # into the pinned slots is still running.
            served = await self.disk_plane.start_get(life)
        else:
            served = life.settle()
        self._check_lease_outlived_reads(request, served)
        count = len(served.blocks)
        return Pinned(plan.lease, served.blocks, life.tiers[:count], served.cut, life.offsets[:count])

    def _check_lease_outlived_reads(self, request, served: Served) -> None:
        """A Get whose lease ended while its disk reads ran has nothing pinned: refuse it by name
        rather than hand out slots another block may take at any moment."""
        if served.cut == GetCut.LEASE_ENDED:
            raise FailedPrecondition(
                f"the Get's lease ran out before its disk reads finished, so nothing is pinned for it "
                f"(lease_ms {request.lease_ms or self.engine.limits.lease_ms_default}); ask for a longer lease_ms")

    async def _fetch_remote(self, request) -> None:
        """In a cluster: bring what a peer holds of a chain that misses here (kvd.planes.cluster_fetch),
        also past a parent stored here (an engine that holds the chain's start asks for the rest)."""
        if self.cluster_fetch is None or not request.keys:
            return
        chain = self._chain_before(request)
        if chain is not None:
            await self.cluster_fetch.fetch_for_get(request.namespace_id, chain + list(request.keys))

    @rpc("Get")
    async def Get(self, request, context):
        await self._fetch_remote(request)
        if request.inline:
            state = self.engine.namespace(request.namespace_id)
            # Pinned under a private lease while the bytes are copied out.
            # Per client, or per tenant for a Get that names none: one
            # tenant's inline Gets never take from another's pin cap.
            owner = request.client_id or scoped_client_id(self._caller(), "-")
            lease, matched, tiers, cut, offsets = await self._pinned_prefix(request, INLINE_CLIENT_PREFIX + owner)
            pin = ReadPin(self.engine, lease)
            try:
                response_bytes = len(matched) * (state.block_bytes + 8)
                if response_bytes > self.max_message_bytes:
                    raise ResourceExhausted(
                        f"an inline Get of {len(matched)} blocks is {response_bytes} bytes, over the "
                        f"{self.max_message_bytes}-byte message limit; ask for at most "
                        f"{max(1, self.max_message_bytes // (state.block_bytes + 8) - 1)} keys per call"
                    )
                blocks = [self.arena.read_at(offset, state.block_bytes) for offset in offsets]
            finally:
                pin.release()
            return convert.inline_get_response(len(matched), blocks, tiers, cut)
        self._check_arena(request)
        lease, matched, tiers, cut, offsets = await self._pinned_prefix(request, request.client_id)
        return convert.get_response(len(matched), lease, self._offsets(lease, offsets), tiers, cut)

    @staticmethod
    def _offsets(lease, offsets: list[int]) -> list[int]:
        """Arena offsets of the blocks a Get hands out (each in host memory, never a slot another
        block may take: GetLife took them at its plan), checked to be pinned by the Get's lease."""
        check(not offsets or (lease is not None and not lease.ended),
              "a Get hands out {} blocks without a live lease", len(offsets))
        return offsets

    @stream_rpc("GetLayers")
    async def GetLayers(self, request, context):
        """Server-streaming Get: one message per layer landed (see the proto)."""
        async for message in self._stream_get(request, LayerSteps):
            yield message

    @stream_rpc("GetBlocks")
    async def GetBlocks(self, request, context):
        """Server-streaming Get: one message per run of leading blocks landed (see the proto)."""
        async for message in self._stream_get(request, BlockSteps):
            yield message

    async def _stream_get(self, request, steps_kind: type[LayerSteps | BlockSteps]):
        self._check_arena(request)
        await self._fetch_remote(request)
        life = await self._begin_get(request, request.client_id)
        plan = life.plan
        pending = life.pending
        layers = life.spec.num_layers
        # Nothing to read: settled at once, the first message is the last.
        cut = {} if pending else {"cut": life.settle().cut}
        matched = list(plan.matched)
        lease = plan.lease
        load_positions, first_wait = self._pending_positions(plan, matched) if pending else ([], len(matched))
        steps = steps_kind(layers, len(matched), load_positions, first_wait)
        first = steps.first(
            len(matched), pending,
            lease_id=lease.lease_id if lease else 0,
            lease_deadline_ms=lease.deadline_ms if lease else 0,
            offsets=self._offsets(lease, life.offsets),
            tiers=life.tiers,
            **cut,
        )
        if not pending:
            yield first
            return
        updates: asyncio.Queue = asyncio.Queue()
        # Started before the first message goes out: the plan's loads are
        # reads other Gets may wait on from now on. On failure the task drops
        # the Get itself, once no read into the pinned slots is running.
        getting = self.disk_plane.start_get(life, **{steps.callback: lambda step, ok: updates.put_nowait((step, ok))})
        servable = len(matched)
        try:
            yield first
            while not getting.done() or not updates.empty():
                waiter = asyncio.ensure_future(updates.get())
                await asyncio.wait({waiter, getting}, return_when=asyncio.FIRST_COMPLETED)
                if not waiter.done():
                    waiter.cancel()
                    continue
                step, ok = waiter.result()
                servable = min([servable, *(position for position, good in zip(load_positions, ok) if not good)])
                if plan.waits:
                    continue  # another Get is loading some blocks: only the end counts
                yield steps.step(step, servable)
            served = await getting
        finally:
            if not getting.done():
                getting.cancel()
        self._check_lease_outlived_reads(request, served)
        yield steps.last(min(servable, len(served.blocks)), served.cut)

    @staticmethod
    def _pending_positions(plan, matched: list) -> tuple[list[int], int]:
        """Where in `matched` the plan's own loads are, and the first block another read is loading."""
        position_of = {id(block): position for position, block in enumerate(matched)}
        return ([position_of[id(load.block)] for load in plan.loads],
                min((position_of[id(block)] for block in plan.waits), default=len(matched)))
