"""What every part of one run shares (`World`), and its assembly from a `SimConfig`: the real
engine with the configured tiers and policies, the tenants' namespaces, and the daemon's own
mover (kvd.core.mover), which decides when bytes move between tiers.

The parts that drive the world (kvd.sim.clients: the requests; kvd.sim.drives: the modelled
devices; kvd.sim.durable: durable Puts) take it whole; kvd.sim.simulator composes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvd.core.engine import Engine, EngineLimits
from kvd.core.keys import NamespaceSpec
from kvd.core.mover import Mover, MoverSettings
from kvd.core.policy import DiskPolicies
from kvd.sim.config import DISK_DEFAULTS, SimConfig
from kvd.sim.events import Timeline
from kvd.sim.invariants import Expected
from kvd.sim.plane import SlotContents
from kvd.sim.results import RunStats


@dataclass(slots=True, eq=False)
class World:
    config: SimConfig
    engine: Engine
    # None without a disk tier: nothing below host memory to move bytes to.
    mover: Mover | None
    # Per tenant (the trace's tenant number): its namespace's spec and id.
    specs: list[NamespaceSpec]
    namespace_ids: list[bytes]
    timeline: Timeline
    # The fake bytes of every slot, to check what is served.
    contents: SlotContents
    stats: RunStats
    # What the engine must agree with after each step.
    expected: Expected


def build_world(config: SimConfig) -> World:
    engine = Engine(
        host_slot_count=config.host_blocks,
        host_slot_bytes=config.block_bytes,
        policy=config.policy,
        limits=EngineLimits(lease_ms_default=config.lease_ms, lease_ms_max=max(config.lease_ms, 600_000)),
        disk_slot_count=config.disk_blocks,
        disk_slot_bytes=config.block_bytes,
        disk_policies=DiskPolicies(admission_min_hits=config.admission_min_hits),
        high_watermark=config.high_watermark,
        low_watermark=config.low_watermark,
        tenant_quotas=config.tenant_quotas(),
        lower_tiers=config.middle_tier(),
    )
    specs = [config.namespace_spec(tenant) for tenant in range(config.trace.tenants)]
    namespace_ids = [engine.register_namespace(spec).namespace_id for spec in specs]
    mover = None
    if config.disk_blocks:
        for namespace_id in namespace_ids:
            engine.enable_disk(namespace_id)
        mover = Mover(engine, MoverSettings(
            write_mode=config.write_mode, batch_blocks=config.write_batch_blocks,
            chunk_blocks=0 if config.io_schedule == "fifo" else config.write_chunk_blocks,
            prefetch_max_blocks=DISK_DEFAULTS.prefetch_max_blocks,
            prefetch_chunk_blocks=DISK_DEFAULTS.prefetch_chunk_blocks))
    return World(config, engine, mover, specs, namespace_ids, Timeline(), SlotContents(engine),
                 RunStats(block_tokens=config.block_tokens), Expected(len(specs)))
