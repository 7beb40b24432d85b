"""Calls for operators: Stats (kvd status), Demote (kvd demote), ListNamespaces (kvd namespaces)
and DeleteNamespace (kvd delete --namespace).

A part of kvd.server.service.KvdService (its handlers by concern); they share the
service's state and reach each other's helpers through self."""

from __future__ import annotations

import asyncio
import logging

from kvd.core.keys import KEY_BYTES, MAX_STRING_BYTES
from kvd.core.namespaces import NamespaceState
from kvd.errors import InvalidArgument, NotFound
from kvd.server import convert
from kvd.server.rpc import rpc


log = logging.getLogger(__name__)

# Demote drops host copies this many candidates at a time, then lets other
# calls run (about 20 ms of the loop here, at 4-5 us a block).
DEMOTE_STEP_BLOCKS = 4096
# ListNamespaces counts a namespace's copies this many blocks at a time (about
# 3 ms of the loop here, at 40-50 ns a block), DeleteNamespace removes this
# many (about 12 ms, at 5-8 us a block); other calls run between steps.
USAGE_STEP_BLOCKS = 65536
DELETE_STEP_BLOCKS = 2048


class AdminHandlers:
    @rpc("Demote")
    async def Demote(self, request, context):
        """Drop every host copy a lower tier also holds (admin; see the proto)."""
        demoted, payload = await self._demote()
        kept = self.engine.host.pool.resident_blocks
        log.info("Demote: %d host copies dropped (%d bytes), %d kept", demoted, payload, kept)
        return convert.demote_response(demoted, payload, kept)

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
        uptime_s = (self.clock.now_ms() - self.started_ms) / 1000.0
        return convert.stats_response(self.engine, self.arena.instance_id, uptime_s,
                                      self.metrics.registry if request.include_metrics else None)

    @rpc("ListNamespaces")
    async def ListNamespaces(self, request, context):
        """Every namespace (of one tenant), its spec and its blocks per tier (admin; see the proto)."""
        if len(request.tenant.encode()) > MAX_STRING_BYTES:
            raise InvalidArgument(f"tenant is longer than {MAX_STRING_BYTES} bytes; no tenant's name is")
        states = sorted((state for state in self.engine.namespaces()
                         if not request.tenant or state.spec.tenant == request.tenant),
                        key=lambda state: (state.spec.tenant, state.spec.model_id, state.namespace_id))
        listed = []
        for state in states:
            count = self.engine.namespace_usage(state.namespace_id)
            while not count.done:
                count.step(USAGE_STEP_BLOCKS)
                await asyncio.sleep(0)
            listed.append(convert.namespace_info(state, count.usage))
        return convert.list_namespaces_response(listed)

    @rpc("DeleteNamespace")
    async def DeleteNamespace(self, request, context):
        """Every block of one namespace removed from every tier, durably (admin; see the proto)."""
        state = self._namespace_by_daemon_id(request.daemon_namespace_id)
        deletion = self.engine.delete_namespace(state.namespace_id)
        while not deletion.done:
            deleted = deletion.step(DELETE_STEP_BLOCKS)
            # Each step's removals journalled before the next: the same promise as Delete's.
            await self._deletions_durable(deleted, f"; DeleteNamespace stopped there ({deletion.deleted} of the "
                                          "namespace's blocks deleted, the ones it had not reached kept)")
            await asyncio.sleep(0)
        caller = self._caller()
        log.info("DeleteNamespace: %d blocks deleted, %d pinned ones kept", deletion.deleted, deletion.pinned,
                 extra={"namespace": state.namespace_id.hex(), "model_id": state.spec.model_id,
                        "tenant": state.spec.tenant, "caller": caller.name if caller is not None else ""})
        return convert.delete_namespace_response(deletion.deleted, deletion.pinned)

    def _namespace_by_daemon_id(self, daemon_id: bytes) -> NamespaceState:
        """Any tenant's namespace, by the daemon's id of it (NamespaceInfo.namespace_id)."""
        if len(daemon_id) != KEY_BYTES:
            raise InvalidArgument(f"daemon_namespace_id must be {KEY_BYTES} bytes (a namespace_id ListNamespaces "
                                  f"reports), got {len(daemon_id)}")
        try:
            return self.engine.namespace(daemon_id)
        except NotFound:
            raise NotFound(f"no namespace has the daemon id {daemon_id.hex()} (`kvd namespaces` lists them)") from None
