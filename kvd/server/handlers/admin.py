"""Calls for operators: Stats (kvd status) and Demote (kvd demote).

A part of kvd.server.service.KvdService (its handlers by concern); they share the
service's state and reach each other's helpers through self."""

from __future__ import annotations

import asyncio
import logging


from kvd import __version__
from kvd.server import convert
from kvd.server.rpc import rpc
from kvd.v1 import kvd_pb2


log = logging.getLogger(__name__)

# Demote drops host copies this many candidates at a time, then lets other
# calls run (about 20 ms of the loop here, at 4-5 us a block).
DEMOTE_STEP_BLOCKS = 4096


class AdminHandlers:
    @rpc("Demote")
    async def Demote(self, request, context):
        """Drop every host copy a lower tier also holds (admin; see the proto)."""
        demoted, payload = await self._demote()
        kept = self.engine.host.pool.resident_blocks
        log.info("Demote: %d host copies dropped (%d bytes), %d kept", demoted, payload, kept)
        return kvd_pb2.DemoteResponse(blocks_demoted=demoted, bytes_demoted=payload, blocks_kept=kept)

    async def _demote(self) -> tuple[int, int]:
        """The candidates of now, DEMOTE_STEP_BLOCKS at a time, other calls running between steps."""
        candidates = self.engine.host_candidates()
        demoted = payload = 0
        for start in range(0, len(candidates), DEMOTE_STEP_BLOCKS):
            blocks, nbytes = self.engine.demote(candidates[start:start + DEMOTE_STEP_BLOCKS])
            demoted, payload = demoted + blocks, payload + nbytes
            await asyncio.sleep(0)
        return demoted, payload

    @rpc("Stats")
    async def Stats(self, request, context):
        engine = self.engine
        return kvd_pb2.StatsResponse(
            version=__version__,
            instance_id=self.arena.instance_id,
            uptime_s=(self.clock.now_ms() - self.started_ms) / 1000.0,
            tiers=[
                kvd_pb2.TierStats(
                    tier=int(tier.tier_id),
                    blocks=tier.pool.resident_blocks,
                    bytes_used=tier.pool.occupied_bytes,
                    payload_bytes=tier.pool.used_bytes,
                    capacity_bytes=tier.pool.capacity_bytes,
                    # Pins hold blocks where clients map them.
                    pinned_blocks=engine.pinned_blocks if tier.caps.client_mappable else 0,
                    evictions=tier.counters.evictions,
                )
                for tier in engine.tiers
            ],
            namespaces=[
                kvd_pb2.NamespaceStats(
                    namespace_id=state.namespace_id,
                    model_id=state.spec.model_id,
                    tenant=state.spec.tenant,
                    blocks=len(state.index),
                    block_bytes=state.block_bytes,
                    hits=state.lookup_hits + state.get_hits,
                    misses=state.lookup_misses + state.get_misses,
                )
                for state in engine.namespaces()
            ],
            leases=len(engine.leases),
            leases_expired=engine.leases.expired_total,
            metrics=convert.metric_samples(self.metrics.registry) if request.include_metrics else [],
        )
