"""`kvd status`: fetch Stats from a running daemon and render it readably.

The daemon answers Stats with its summary (tiers, namespaces, leases) and,
asked for them, every metric sample it exports (StatsRequest
.include_metrics). So the hits and misses by tier, the evictions by
reason, the moves between tiers, the disk I/O queues, bytes and
latencies, the pins and the events shown here are the very numbers
Prometheus scrapes from /metrics, whichever listener `kvd status` reached
and even with the metrics endpoint off. A section whose metrics the daemon
does not export (no disk tier, no prefetch, an older daemon) is left out.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import grpc

from kvd.v1 import kvd_pb2, kvd_pb2_grpc

TIER_NAMES = {kvd_pb2.TIER_DEVICE: "device", kvd_pb2.TIER_HOST: "host", kvd_pb2.TIER_DISK: "disk", kvd_pb2.TIER_REMOTE: "remote"}
PREFETCH_PREFIX = "kvd_prefetch_"

Labels = dict[str, str]


class Samples:
    """Metric samples by name, with label filters and histogram quantiles."""

    def __init__(self, samples: Iterable[tuple[str, Labels, float]]) -> None:
        self._by_name: dict[str, list[tuple[Labels, float]]] = {}
        for name, labels, value in samples:
            self._by_name.setdefault(name, []).append((dict(labels), value))

    def __contains__(self, name: str) -> bool:
        return name in self._by_name

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def matching(self, name: str, labels: Labels | None = None) -> list[tuple[Labels, float]]:
        """The samples of `name` whose labels include `labels`."""
        wanted = (labels or {}).items()
        return [(have, value) for have, value in self._by_name.get(name, []) if wanted <= have.items()]

    def value(self, name: str, labels: Labels | None = None) -> float | None:
        """The sum of the matching samples; None if there is none."""
        found = self.matching(name, labels)
        return sum(value for _, value in found) if found else None

    def by_label(self, name: str, label: str, labels: Labels | None = None) -> dict[str, float]:
        totals: dict[str, float] = {}
        for have, value in self.matching(name, labels):
            totals[have.get(label, "")] = totals.get(have.get(label, ""), 0.0) + value
        return totals

    def quantile(self, name: str, q: float, labels: Labels | None = None) -> float | None:
        """The q-quantile of histogram `name`, interpolated linearly inside its
        bucket as PromQL's histogram_quantile does; None before any observation."""
        buckets = sorted((float(have["le"]), count) for have, count in self.matching(name + "_bucket", labels))
        if not buckets or buckets[-1][1] == 0:
            return None
        rank = q * buckets[-1][1]
        lower_bound, lower_count = 0.0, 0.0
        for bound, count in buckets:
            if count >= rank:
                if math.isinf(bound):
                    return lower_bound  # above the largest finite bucket: its bound is all we know
                if count == lower_count:
                    return bound
                return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
            lower_bound, lower_count = bound, count
        return lower_bound


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


def open_channel(target: str, tls_ca_file: str | None = None) -> grpc.Channel:
    """A channel to `target`: TLS trusting the CAs of `tls_ca_file` if given, else plaintext."""
    if tls_ca_file:
        return grpc.secure_channel(target, grpc.ssl_channel_credentials(Path(tls_ca_file).read_bytes()))
    return grpc.insecure_channel(target)


def call_admin(target: str, method: str, request: Any, timeout_s: float = 5.0, token: str | None = None,
               tls_ca_file: str | None = None) -> Any:
    """One call of an administrative `method` of the daemon at `target`; with
    auth.mode = "token", `token` must be an admin tenant's."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    with open_channel(target, tls_ca_file) as channel:
        stub = kvd_pb2_grpc.KvdStub(channel)
        try:
            return getattr(stub, method)(request, timeout=timeout_s, metadata=metadata)
        except grpc.RpcError as error:
            raise ConnectionError(f"cannot reach kvd at {target}: {error.code().name}: {error.details()}") from None


def fetch_status(target: str, timeout_s: float = 5.0, token: str | None = None,
                 tls_ca_file: str | None = None) -> dict[str, Any]:
    """Stats of the daemon at `target`, as plain data."""
    response = call_admin(target, "Stats", kvd_pb2.StatsRequest(include_metrics=True), timeout_s, token, tls_ca_file)
    return status_from_response(target, response)


def demote(target: str, timeout_s: float = 5.0, token: str | None = None,
           tls_ca_file: str | None = None) -> dict[str, int]:
    """Demote on the daemon at `target` (`kvd demote`): what it dropped and kept, as plain data."""
    response = call_admin(target, "Demote", kvd_pb2.DemoteRequest(), timeout_s, token, tls_ca_file)
    return {"blocks_demoted": response.blocks_demoted, "bytes_demoted": response.bytes_demoted,
            "blocks_kept": response.blocks_kept}


def status_from_response(target: str, response: kvd_pb2.StatsResponse) -> dict[str, Any]:
    """The status as plain data (what `kvd status --json` prints)."""
    samples = Samples((sample.name, dict(sample.labels), sample.value) for sample in response.metrics)
    tiers = []
    for tier in response.tiers:
        name = TIER_NAMES.get(tier.tier, str(tier.tier))
        only = {"tier": name}
        tiers.append(
            {
                "tier": name,
                "blocks": tier.blocks,
                "used_bytes": tier.bytes_used,
                "payload_bytes": tier.payload_bytes,
                "capacity_bytes": tier.capacity_bytes,
                "pinned_blocks": tier.pinned_blocks,
                "evictions": tier.evictions,
                "hits": _count(samples.value("kvd_tier_hits_total", only)),
                "misses": _count(samples.value("kvd_tier_misses_total", only)),
                "evicted": _counts(samples.by_label("kvd_tier_evicted_blocks_total", "reason", only)),
            }
        )
    return {
        "target": target,
        "version": response.version,
        "instance_id": response.instance_id,
        "uptime_s": response.uptime_s,
        "leases": response.leases,
        "leases_expired": response.leases_expired,
        "tiers": tiers,
        "moves": [
            {"source_tier": labels["source_tier"], "target_tier": labels["target_tier"], "blocks": int(value)}
            for labels, value in samples.matching("kvd_tier_moves_total")
        ],
        "pins": _pins(samples),
        "disk_io": _disk_io(samples),
        "events": _events(samples),
        "prefetch": _prefetch(samples),
        "tenants": _tenants(samples),
        "peers": _peers(samples),
        "namespaces": [
            {
                "namespace_id": namespace.namespace_id.hex(),
                "tenant": namespace.tenant,
                "model_id": namespace.model_id,
                "blocks": namespace.blocks,
                "block_bytes": namespace.block_bytes,
                "hits": namespace.hits,
                "misses": namespace.misses,
            }
            for namespace in response.namespaces
        ],
    }


def _count(value: float | None) -> int | None:
    return None if value is None else int(value)


def _counts(values: dict[str, float]) -> dict[str, int]:
    return {key: int(value) for key, value in sorted(values.items())}


def _tenants(samples: Samples) -> list[dict[str, Any]]:
    """Usage, quota and quota outcomes of each tenant, by tier (auth.mode = "token")."""
    tenants = []
    for name in sorted(samples.by_label("kvd_tenant_used_bytes", "tenant")):
        only = {"tenant": name}
        tenants.append({
            "tenant": name,
            "used_bytes": _counts(samples.by_label("kvd_tenant_used_bytes", "tier", only)),
            "quota_bytes": _counts(samples.by_label("kvd_tenant_quota_bytes", "tier", only)),
            "refusals": _counts(samples.by_label("kvd_tenant_quota_refusals_total", "tier", only)),
            "evictions": _counts(samples.by_label("kvd_tenant_quota_evictions_total", "tier", only)),
        })
    return tenants


def _peers(samples: Samples) -> list[dict[str, Any]]:
    """The cluster's other nodes as this daemon sees them: transport, blocks fetched, fetches cut short."""
    return [{"peer": labels["peer"], "transport": labels["transport"],
             "fetched_blocks": _count(samples.value("kvd_cluster_fetched_blocks_total", {"peer": labels["peer"]})) or 0,
             "failed_fetches": _count(samples.value("kvd_cluster_failed_fetches_total", {"peer": labels["peer"]})) or 0}
            for labels, _ in sorted(samples.matching("kvd_cluster_peer"), key=lambda sample: sample[0]["peer"])]


def _pins(samples: Samples) -> dict[str, int] | None:
    if "kvd_lease_pinned_blocks" not in samples:
        return None
    return {
        "pinned_blocks": _count(samples.value("kvd_lease_pinned_blocks")),
        "clients": _count(samples.value("kvd_lease_clients")),
        "client_max_blocks": _count(samples.value("kvd_lease_client_pinned_blocks_max")),
        "cap_blocks": _count(samples.value("kvd_lease_client_pin_cap_blocks")),
        "cap_rejections": _count(samples.value("kvd_lease_pin_cap_rejections_total")),
    }


def _disk_io(samples: Samples) -> dict[str, Any] | None:
    if "kvd_disk_queue_jobs" not in samples:
        return None
    classes = []
    for io_class, queued in samples.by_label("kvd_disk_queue_jobs", "class").items():
        only = {"class": io_class}
        jobs = samples.value("kvd_disk_job_run_seconds_count", only) or 0.0
        run_sum = samples.value("kvd_disk_job_run_seconds_sum", only) or 0.0
        classes.append(
            {
                "class": io_class,
                "queued": int(queued),
                "jobs": int(jobs),
                "wait_p50_s": samples.quantile("kvd_disk_job_wait_seconds", 0.5, only),
                "wait_p99_s": samples.quantile("kvd_disk_job_wait_seconds", 0.99, only),
                "run_p50_s": samples.quantile("kvd_disk_job_run_seconds", 0.5, only),
                "run_p99_s": samples.quantile("kvd_disk_job_run_seconds", 0.99, only),
                "run_mean_s": run_sum / jobs if jobs else None,
            }
        )
    return {
        "read_bytes": _count(samples.value("kvd_disk_io_bytes_total", {"operation": "read"})),
        "written_bytes": _count(samples.value("kvd_disk_io_bytes_total", {"operation": "write"})),
        "write_backlog_blocks": _count(samples.value("kvd_disk_write_queue")),
        "failures": _counts(samples.by_label("kvd_disk_failures_total", "operation")),
        "drives": {state: int(count) for state, count in
                   samples.by_label("kvd_disk_drive_state", "state").items()},
        "lost_at_start_blocks": _count(samples.value("kvd_disk_recovery_lost_blocks")),
        "classes": classes,
    }


def _events(samples: Samples) -> dict[str, Any] | None:
    if "kvd_events_total" not in samples:
        return None
    return {
        "subscribers": _count(samples.value("kvd_event_subscribers")),
        "published": _counts(samples.by_label("kvd_events_total", "kind")),
        "keys": _counts(samples.by_label("kvd_event_keys_total", "kind")),
        "resyncs": _counts(samples.by_label("kvd_event_resyncs_total", "reason")),
    }


def _prefetch(samples: Samples) -> dict[str, Any] | None:
    """Every kvd_prefetch_* sample, and the share of settled prefetches a Get used."""
    values = {}
    for name in samples.names():
        if name.startswith(PREFETCH_PREFIX):
            for labels, value in samples.matching(name):
                label_text = ",".join(f"{key}={labels[key]}" for key in sorted(labels))
                values[name[len(PREFETCH_PREFIX):] + (f"[{label_text}]" if label_text else "")] = value
    if not values:
        return None
    used, wasted = samples.value("kvd_prefetch_used_total"), samples.value("kvd_prefetch_wasted_total")
    settled = (used or 0.0) + (wasted or 0.0)
    return {"samples": values, "useful_ratio": used / settled if used is not None and settled else None}


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    raise AssertionError("unreachable")


def human_seconds(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    return f"{seconds:.2f} s"


def _number(value: int | float | None) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _listing(values: dict[str, int | float]) -> str:
    return ", ".join(f"{key} {_number(value)}" for key, value in values.items()) or "none"


def text_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * width for width in widths))
    lines.extend("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)
    return "\n".join(lines)


def _section(title: str, lines: list[str]) -> list[str]:
    """`title` before the first line, the others indented under it."""
    width = 10
    return [(title if index == 0 else "").ljust(width) + line for index, line in enumerate(lines)]


def _tier_table(status: dict[str, Any]) -> str:
    rows = []
    for tier in status["tiers"]:
        capacity = tier["capacity_bytes"]
        fill = 100.0 * tier["used_bytes"] / capacity if capacity else 0.0
        hits, misses = tier.get("hits"), tier.get("misses")
        requests = (hits or 0) + (misses or 0)
        rows.append(
            [
                tier["tier"],
                str(tier["blocks"]),
                human_bytes(tier["used_bytes"]),
                human_bytes(tier["payload_bytes"]),
                human_bytes(capacity),
                f"{fill:.1f}%",
                str(tier["pinned_blocks"]),
                _number(hits),
                _number(misses),
                f"{100.0 * hits / requests:.1f}%" if hits is not None and requests else "-",
                str(tier["evictions"]),
            ]
        )
    headers = ["tier", "blocks", "used", "payload", "capacity", "fill", "pinned", "hits", "misses", "hit rate",
               "evictions"]
    return text_table(headers, rows)


def _disk_io_lines(disk_io: dict[str, Any]) -> list[str]:
    lines = [
        f"read {human_bytes(disk_io['read_bytes'] or 0)}, written {human_bytes(disk_io['written_bytes'] or 0)}; "
        f"write backlog {_number(disk_io['write_backlog_blocks'])} blocks; "
        f"failed blocks: {_listing(disk_io['failures'])}"
    ]
    drives = disk_io.get("drives") or {}
    if drives:
        lines.append(f"drives: {_listing(drives)}; blocks lost at start: {_number(disk_io['lost_at_start_blocks'])}")
    rows = [
        [
            entry["class"],
            str(entry["queued"]),
            str(entry["jobs"]),
            human_seconds(entry["wait_p50_s"]),
            human_seconds(entry["wait_p99_s"]),
            human_seconds(entry["run_p50_s"]),
            human_seconds(entry["run_p99_s"]),
            human_seconds(entry["run_mean_s"]),
        ]
        for entry in disk_io["classes"]
    ]
    headers = ["class", "queued", "jobs", "wait p50", "wait p99", "run p50", "run p99", "run mean"]
    return lines + text_table(headers, rows).splitlines()


def render_status(status: dict[str, Any]) -> str:
    parts = [
        f"kvd {status['version']}  instance {status['instance_id']}  up {status['uptime_s']:.0f}s  "
        f"at {status['target']}",
        "",
        _tier_table(status),
        "",
    ]
    evicted = [f"{tier['tier']}: {_listing(tier['evicted'])}" for tier in status["tiers"] if tier.get("evicted")]
    parts += _section("evicted", evicted)
    moves = status.get("moves") or []
    if moves:
        parts += _section("moved", [", ".join(f"{move['source_tier']} -> {move['target_tier']} {move['blocks']}"
                                              for move in moves)])
    if status.get("disk_io"):
        parts += ["", *_section("disk I/O", _disk_io_lines(status["disk_io"]))]
    parts.append("")
    parts += _section("leases", [f"open {status['leases']}, expired {status['leases_expired']}"])
    pins = status.get("pins")
    if pins:
        parts += _section("pins", [
            f"{pins['pinned_blocks']} blocks pinned through leases by {pins['clients']} clients; "
            f"most by one client {pins['client_max_blocks']} (cap {pins['cap_blocks']}); "
            f"refused by the cap {pins['cap_rejections']}"
        ])
    events = status.get("events")
    if events:
        parts += _section("events", [
            f"subscribers {_number(events['subscribers'])}; published {_listing(events['published'])}; "
            f"resyncs {_listing(events['resyncs'])}"
        ])
    prefetch = status.get("prefetch")
    if prefetch:
        ratio = prefetch["useful_ratio"]
        useful = f"; useful {100.0 * ratio:.1f}% (used / (used + wasted))" if ratio is not None else ""
        parts += _section("prefetch", [_listing(prefetch["samples"]) + useful])
    parts += _section("peer", [f"{peer['peer']}: over {peer['transport']}; fetched {peer['fetched_blocks']} blocks, "
                               f"fetches cut short {peer['failed_fetches']}" for peer in status.get("peers", [])])
    for tenant in status.get("tenants", []):
        usage = []
        for tier, used in tenant["used_bytes"].items():
            quota = tenant["quota_bytes"].get(tier)
            usage.append(f"{tier} {human_bytes(used)}" + (f" of {human_bytes(quota)}" if quota else ""))
        parts += _section("tenant", [f"{tenant['tenant']}: " + ", ".join(usage)
                                     + f"; quota refusals {_listing(tenant['refusals'])}"
                                     + f", evictions {_listing(tenant['evictions'])}"])
    parts.append("")
    parts.append(_namespace_table(status["namespaces"]))
    return "\n".join(parts)


def _namespace_table(namespaces: list[dict[str, Any]]) -> str:
    tenant_column = any(namespace.get("tenant") for namespace in namespaces)
    namespace_rows = []
    for namespace in namespaces:
        requests = namespace["hits"] + namespace["misses"]
        hit_rate = f"{100.0 * namespace['hits'] / requests:.1f}%" if requests else "-"
        namespace_rows.append(
            [
                namespace["namespace_id"][:16],
                *([namespace.get("tenant") or "-"] if tenant_column else []),
                namespace["model_id"],
                str(namespace["blocks"]),
                human_bytes(namespace["block_bytes"]),
                str(namespace["hits"]),
                str(namespace["misses"]),
                hit_rate,
            ]
        )
    if not namespace_rows:
        return "no namespaces registered"
    headers = ["namespace", *(["tenant"] if tenant_column else []), "model", "blocks", "block size", "hits",
               "misses", "hit rate"]
    return text_table(headers, namespace_rows)
