"""What the simulator knows must hold, checked after every `verify_every`th step and after the last.

The engine's own verify() first; then what the simulator expects of it
(`Expected`: the leases it opened and the hit counters it moved, kept
beside the engine as the requests go), that every live block handle is
held by someone (a lease, a write in flight, a durable wait, a Get's own
pins, a read in flight), and the one property that matters for the
bytes: may lose, never lie. Every servable copy of a block, in every
tier, holds that block's fake bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvd.core.block import BlockState
from kvd.invariants import check

if TYPE_CHECKING:
    from kvd.sim.simulator import Simulator


class Expected:
    """What the engine must agree with, as the simulator's requests and clock have moved it."""

    def __init__(self, tenants: int) -> None:
        # Open lease id -> its deadline (ms).
        self.leases: dict[int, int] = {}
        # Per tenant: lookup hits, lookup misses, Get hits, Get misses.
        self.counters = [[0, 0, 0, 0] for _ in range(tenants)]

    def leases_due(self, now_ms: int) -> list[int]:
        return [lease_id for lease_id, deadline_ms in self.leases.items() if deadline_ms <= now_ms]


def check_invariants(sim: Simulator) -> None:
    """The engine's own checks, then what the simulator knows it must hold."""
    engine, world = sim.engine, sim.world
    engine.verify()
    check(engine.leaked_handles == 0, "{} block handles leaked", engine.leaked_handles)
    live = {lease.lease_id for lease in engine.leases}
    check(live == set(world.expected.leases), "open leases {} but expected {}", sorted(live),
          sorted(world.expected.leases))
    held = _held_handles(sim)
    check(held == engine.live_handles, "{} live handles, {} held by leases and writes", engine.live_handles, held)
    check({block.key for block in engine.loading} == set(sim.drives.loading), "blocks loading disagree with the reads")
    for tenant, namespace_id in enumerate(world.namespace_ids):
        state = engine.namespace(namespace_id)
        counters = [state.lookup_hits, state.lookup_misses, state.get_hits, state.get_misses]
        check(counters == world.expected.counters[tenant], "hit counters {} of tenant {} drifted", counters, tenant)
        _check_contents(sim, state.index)
    mover, starved = world.mover, sim.clients.starved
    check(mover is None or mover.starved_gets == len(starved),
          "{} Gets counted as starved, {} waiting", mover.starved_gets if mover else 0, len(starved))
    stats = world.stats
    check(stats.host_hit_blocks + stats.middle_hit_blocks + stats.disk_hit_blocks + stats.miss_blocks
          == stats.prompt_blocks, "hits in each tier + misses is not every prompt block")


def _held_handles(sim: Simulator) -> int:
    """The block handles someone holds: every reference is held by a lease, a write in flight,
    a durable wait, a Get between its plan and its answer, or a read in flight."""
    drives = sim.drives
    held = sum(
        not handle.released
        for lease in sim.engine.leases
        for handle in (*lease.handles, lease.parent_handle)
        if handle is not None
    )
    held += sum(not write.handle.released for batch in drives.batches.values() for write in batch.round.writes)
    held += sum(not pin.released for flow in sim.durable.flows for pin in flow.durable_pins)
    held += sum(not pin.released for flow in sim.clients.unsettled for pin in flow.life.plan.pins)
    # ... and by every disk read in flight (its own pin on the block it reads in).
    held += sum(not load.handle.released for reads in (drives.prefetch_reads, drives.get_reads)
                for read in reads.values() for load in read.loads)
    return held


def _check_contents(sim: Simulator, index) -> None:
    """May lose, never lie: every servable copy holds its own block's bytes."""
    engine, contents = sim.engine, sim.world.contents
    for block in index:
        if block.state != BlockState.SEALED:
            continue
        for tier, slot in engine.tiers.copies(block):
            if tier is engine.host:
                check(block in engine.loading or contents.host.get(slot) == block.key,
                      "host slot of {!r} holds another block", block)
            else:
                check(contents.lower[tier].get(slot) == block.key, "{} slot of {!r} holds another block",
                      tier.name, block)


def check_quiet(sim: Simulator) -> None:
    """After the last event: no request still waits for anything."""
    check(sim.drives.nothing_in_flight() and not sim.clients.starved and not sim.durable.flows,
          "requests still waiting after the last event")


def check_released(sim: Simulator) -> None:
    """Past every deadline: all leases gone, nothing pinned, nothing leaked."""
    engine = sim.engine
    check(not sim.world.expected.leases and engine.live_handles == 0 and engine.pinned_blocks == 0,
          "blocks still pinned after every lease expired")
