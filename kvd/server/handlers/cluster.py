"""The cluster's calls from clients: ClusterLookup.

A part of kvd.server.service.KvdService (its handlers by concern); they share the
service's state and reach each other's helpers through self."""

from __future__ import annotations

from kvd.errors import FailedPrecondition
from kvd.server import convert
from kvd.server.rpc import rpc


class ClusterHandlers:
    @rpc("ClusterLookup")
    async def ClusterLookup(self, request, context):
        if self.cluster is None:
            raise FailedPrecondition("this kvd is not in a cluster ([cluster] etcd_endpoints is empty)")
        keys = convert.cluster_lookup_keys(request, self.engine.limits.max_batch_keys)
        local = self.engine.lookup(request.namespace_id, keys)
        return await self.cluster.lookup(request.namespace_id, request.packed_keys, len(local))
