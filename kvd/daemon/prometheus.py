"""The daemon's Prometheus side: the collectors over its planes, its arena and its cluster node,
added to the registry kvd.metrics makes, and the metrics endpoint (metrics.address) that serves it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvd.config import parse_address
from kvd.metrics import ArenaCollector, ClusterCollector, DeviceCollector, DiskIoMetrics
from kvd.tiers.host import HostArena, shmem_huge_page_bytes

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from kvd.cluster.node import ClusterNode
    from kvd.planes.cluster_fetch import ClusterFetch
    from kvd.planes.device import DevicePlane
    from kvd.planes.disk import DiskPlane
    from kvd.server.arena_socket import ArenaSocket


def watch_disk_plane(registry: CollectorRegistry, plane: DiskPlane) -> None:
    """The disk plane's I/O: queues, bytes, drive states, losses, slack writes, chunks; each job as it ends."""
    schedule = plane.io.schedule
    disk_metrics = DiskIoMetrics(registry, plane.io.queued, plane.io_bytes, plane.drive_states,
                                 plane.recovery_lost_blocks, lambda: schedule.counters.slack_writes,
                                 lambda: plane.counters.chunks, plane.totals, plane.oldest_unwritten_s)
    plane.io.on_job = disk_metrics.observe_job


def watch_arena(registry: CollectorRegistry, arena: HostArena, arena_socket: ArenaSocket | None,
                device_plane: DevicePlane | None) -> None:
    """The arena files handed out and slots reassigned between tenants; the device plane's counters."""
    registry.register(ArenaCollector(lambda: arena_socket.handed_out if arena_socket else 0,
                                     lambda: arena.reassigned_slots, shmem_huge_page_bytes))
    if device_plane is not None:
        registry.register(DeviceCollector(device_plane.counters))


def watch_cluster(registry: CollectorRegistry, cluster: ClusterNode, fetch: ClusterFetch) -> None:
    """The cluster as this node sees it: members, joined, etcd sessions, blocks fetched from peers."""
    registry.register(ClusterCollector(lambda: len(cluster.view), cluster.joined.is_set,
                                       lambda: cluster.membership.sessions, lambda: fetch.fetched_blocks,
                                       lambda: fetch.failed_fetches, cluster.peer_transports,
                                       lambda: fetch.stage_seconds, lambda: fetch.moved_bytes))


def serve_metrics(address: str, registry: CollectorRegistry):
    """The metrics endpoint on `address` (metrics.address), in a thread of its own: its HTTP server."""
    from prometheus_client import start_http_server

    host, port = parse_address("metrics.address", address)
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise OSError(f"cannot serve metrics on {address} (metrics.address): "
                      f"{error.strerror or error}") from None
    return server
