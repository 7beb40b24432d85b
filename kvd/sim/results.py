"""What one run measured (`RunStats`), as the request drivers count it and the engine's and
devices' counters total it at the end (`add_totals`), and a run's result for the report
(kvd.sim.report: tables, plots, JSON)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from kvd.core.engine import Engine
from kvd.sim.config import SimConfig
from kvd.sim.disk import DiskTraffic


@dataclass(slots=True)
class RunStats:
    """What one run measured. Blocks count a prompt's full blocks; tokens
    count every prompt token, so the uncacheable tail is a miss."""

    block_tokens: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    prompt_blocks: int = 0
    host_hit_blocks: int = 0
    middle_hit_blocks: int = 0
    disk_hit_blocks: int = 0
    miss_blocks: int = 0
    # Gets cut short: no host slot to load into, a load failed, or a lease
    # table with no room.
    get_starved: int = 0
    # ... of which cut at a block that failed its checksum (told to the client as corrupt).
    get_cut_corrupt: int = 0
    get_refused: int = 0
    lost_blocks: int = 0
    # Puts: blocks reserved, being written by another request, without room.
    put_reserved: int = 0
    put_in_flight: int = 0
    put_no_space: int = 0
    put_refused: int = 0
    clients_crashed: int = 0
    # Puts that asked for durability: acknowledged durable, refused (with
    # why), and the longest wait for an acknowledgement.
    durable_acked: int = 0
    durable_failed: int = 0
    durable_wait_max_us: int = 0
    # Blocks Deleted, and Deletes refused because a block was pinned.
    deleted_blocks: int = 0
    deletes_pinned: int = 0
    # Puts refused for their tenant's host quota (also in put_refused).
    quota_refused: int = 0
    # Blocks prefetches read, and of those a Get used or that left first.
    prefetched_blocks: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    leases_expired: int = 0
    steps: int = 0
    simulated_us: int = 0
    ttft_mean_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    host_evictions: int = 0
    host_demotions: int = 0
    disk_evictions: int = 0
    disk_written_blocks: int = 0
    disk_loaded_blocks: int = 0
    disk_read_bytes: int = 0
    disk_write_bytes: int = 0
    disk_busy_share: float = 0.0
    read_wait_mean_us: float = 0.0
    middle_evictions: int = 0
    middle_written_blocks: int = 0
    middle_loaded_blocks: int = 0

    def share(self, part: str, weight: str) -> float:
        """Share of the prompts' `weight` ("tokens" or "blocks") that was `part`
        ("host", "middle", "disk" or "miss")."""
        blocks = {"host": self.host_hit_blocks, "middle": self.middle_hit_blocks, "disk": self.disk_hit_blocks,
                  "miss": self.miss_blocks}[part]
        if weight == "blocks":
            return blocks / self.prompt_blocks if self.prompt_blocks else 0.0
        if not self.prompt_tokens:
            return 0.0
        if part == "miss":
            hit_blocks = self.host_hit_blocks + self.middle_hit_blocks + self.disk_hit_blocks
            return (self.prompt_tokens - hit_blocks * self.block_tokens) / self.prompt_tokens
        return blocks * self.block_tokens / self.prompt_tokens


@dataclass(slots=True)
class RunResult:
    config: SimConfig
    stats: RunStats

    def to_dict(self) -> dict:
        stats = asdict(self.stats)
        for weight in ("tokens", "blocks"):
            for part in ("host", "middle", "disk", "miss"):
                stats[f"{part}_share_{weight}"] = self.stats.share(part, weight)
        config = self.config
        return {
            "policy": config.policy,
            "host_blocks": config.host_blocks,
            "host_bytes": config.host_blocks * config.block_bytes,
            "disk_blocks": config.disk_blocks,
            "disk_bytes": config.disk_blocks * config.block_bytes,
            "middle_blocks": config.middle_blocks,
            "stats": stats,
        }


def add_totals(stats: RunStats, engine: Engine, disk: DiskTraffic | None, ttft_us: list[int], *, steps: int,
               simulated_us: int) -> RunStats:
    """The end of a run: its length, time to first token, and the engine's and the drive's counters."""
    stats.steps = steps
    stats.simulated_us = simulated_us
    if ttft_us:
        ttft = np.array(ttft_us, dtype=np.int64)
        stats.ttft_mean_ms = round(float(ttft.mean()) / 1000, 3)
        stats.ttft_p99_ms = round(float(np.percentile(ttft, 99)) / 1000, 3)
    stats.host_evictions = engine.host.counters.evictions
    stats.host_demotions = engine.host.counters.demotions
    if engine.disk is not None:
        stats.disk_evictions = engine.disk.counters.evictions
        stats.disk_written_blocks = engine.disk.counters.written
        stats.disk_loaded_blocks = engine.disk.counters.loaded
        stats.prefetch_used = engine.prefetch_counters.used
        stats.prefetch_wasted = engine.prefetch_counters.wasted
    for tier in engine.lower_tiers:
        if tier is not engine.disk:
            stats.middle_evictions += tier.counters.evictions
            stats.middle_written_blocks += tier.counters.written
            stats.middle_loaded_blocks += tier.counters.loaded
    if disk is not None:
        stats.disk_read_bytes = disk.read_bytes
        stats.disk_write_bytes = disk.write_bytes
        stats.disk_busy_share = round(disk.busy_us / max(1, simulated_us), 6)
        stats.read_wait_mean_us = round(disk.read_wait_us / max(1, disk.read_ops), 3)
    return stats
