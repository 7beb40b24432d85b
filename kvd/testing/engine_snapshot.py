"""A comparable picture of an Engine's whole state, for tests.

A rejected call must leave the engine exactly as it was: tests take a
snapshot before the call and compare it with one taken after.
"""

from __future__ import annotations

import dataclasses

from kvd.core.engine import Engine


def snapshot(engine: Engine) -> dict:
    """Everything a rejected call must leave untouched."""
    host = engine.host
    disk = engine.disk
    return {
        "indexes": {
            state.namespace_id: {
                key: (
                    block.state,
                    block.ref_count,
                    block.child_count(),
                    tuple((tier.tier_id, slot, engine.tiers.resident_children(block, tier))
                          for tier, slot in engine.tiers.copies(block)),
                    block.parent and block.parent.key,
                )
                for key, block in state.index.nodes.items()
            }
            for state in engine.namespaces()
        },
        "policy": [block.key for block in host.policy.order()],
        "free": list(host.pool.free_slots),
        "owners": [owner and owner.key for owner in host.pool.owners],
        "used": host.pool.used_bytes,
        "counters": dataclasses.astuple(host.counters),
        "disk": None
        if disk is None
        else (
            list(disk.pool.free_slots),
            sorted(disk.pool.quarantine),
            sorted(disk.pool.incoming),
            list(disk.pool.removals),
            disk.pool.used_bytes,
            dataclasses.astuple(disk.counters),
        ),
        "write_queue": [block.key for block in engine.write_queue],
        "handles": (engine.live_handles, engine.pinned_blocks, engine.leaked_handles),
        # A rejected call announces nothing either.
        "events": (list(engine.events.published_events), engine.events.open_key_count),
        "leases": {
            lease.lease_id: (
                lease.kind,
                lease.client_id,
                lease.deadline_ms,
                [(h.key, h.released, h.writable) for h in lease.handles],
                lease.parent_handle and lease.parent_handle.key,
                lease.pinned,
            )
            for lease in engine.leases
        },
        # Pins charged per client (the table's verify() ties them to the leases).
        "pins": (engine.leases.pinned_total, {lease.client_id: engine.leases.pins_of(lease.client_id)
                                              for lease in engine.leases}),
    }
