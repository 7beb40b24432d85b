"""`kvd status`: fetch Stats from a running daemon and render a table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc

from kvd.v1 import kvd_pb2, kvd_pb2_grpc

TIER_NAMES = {kvd_pb2.TIER_DEVICE: "device", kvd_pb2.TIER_HOST: "host", kvd_pb2.TIER_DISK: "disk", kvd_pb2.TIER_REMOTE: "remote"}


def resolve_target(target: str | None, state_dir: str) -> str:
    if target:
        return target
    endpoints_path = Path(state_dir) / "endpoints.json"
    try:
        endpoints = json.loads(endpoints_path.read_text())
    except FileNotFoundError:
        raise ConnectionError(f"no daemon found: {endpoints_path} does not exist (is kvd serve running?)") from None
    if endpoints.get("unix_socket"):
        return f"unix://{endpoints['unix_socket']}"
    return f"127.0.0.1:{endpoints['tcp_port']}"


def fetch_status(target: str, timeout_s: float = 5.0) -> dict[str, Any]:
    with grpc.insecure_channel(target) as channel:
        stub = kvd_pb2_grpc.KvdStub(channel)
        try:
            response = stub.Stats(kvd_pb2.StatsRequest(), timeout=timeout_s)
        except grpc.RpcError as error:
            raise ConnectionError(f"cannot reach kvd at {target}: {error.code().name}: {error.details()}") from None
    return {
        "target": target,
        "version": response.version,
        "instance_id": response.instance_id,
        "uptime_s": response.uptime_s,
        "leases": response.leases,
        "leases_expired": response.leases_expired,
        "tiers": [
            {
                "tier": TIER_NAMES.get(tier.tier, str(tier.tier)),
                "blocks": tier.blocks,
                "used_bytes": tier.bytes_used,
                "payload_bytes": tier.payload_bytes,
                "capacity_bytes": tier.capacity_bytes,
                "pinned_blocks": tier.pinned_blocks,
                "evictions": tier.evictions,
            }
            for tier in response.tiers
        ],
        "namespaces": [
            {
                "namespace_id": namespace.namespace_id.hex(),
                "model_id": namespace.model_id,
                "blocks": namespace.blocks,
                "block_bytes": namespace.block_bytes,
                "hits": namespace.hits,
                "misses": namespace.misses,
            }
            for namespace in response.namespaces
        ],
    }


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(headers, widths))]
    lines.append("  ".join("-" * width for width in widths))
    lines.extend("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)) for row in rows)
    return "\n".join(lines)


def render_status(status: dict[str, Any]) -> str:
    parts = [
        f"kvd {status['version']}  instance {status['instance_id']}  up {status['uptime_s']:.0f}s  "
        f"at {status['target']}",
        f"leases open {status['leases']}, expired {status['leases_expired']}",
        "",
    ]
    tier_rows = []
    for tier in status["tiers"]:
        capacity = tier["capacity_bytes"]
        fill = 100.0 * tier["used_bytes"] / capacity if capacity else 0.0
        tier_rows.append(
            [
                tier["tier"],
                str(tier["blocks"]),
                human_bytes(tier["used_bytes"]),
                human_bytes(tier["payload_bytes"]),
                human_bytes(capacity),
                f"{fill:.1f}%",
                str(tier["pinned_blocks"]),
                str(tier["evictions"]),
            ]
        )
    parts.append(_table(["tier", "blocks", "used", "payload", "capacity", "fill", "pinned", "evictions"], tier_rows))
    parts.append("")
    namespace_rows = []
    for namespace in status["namespaces"]:
        requests = namespace["hits"] + namespace["misses"]
        hit_rate = f"{100.0 * namespace['hits'] / requests:.1f}%" if requests else "-"
        namespace_rows.append(
            [
                namespace["namespace_id"][:16],
                namespace["model_id"],
                str(namespace["blocks"]),
                human_bytes(namespace["block_bytes"]),
                str(namespace["hits"]),
                str(namespace["misses"]),
                hit_rate,
            ]
        )
    if namespace_rows:
        parts.append(_table(["namespace", "model", "blocks", "block size", "hits", "misses", "hit rate"], namespace_rows))
    else:
        parts.append("no namespaces registered")
    return "\n".join(parts)
