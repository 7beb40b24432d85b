"""Disk tier queries that only tests and benchmarks need, composed of the tier's own.

`DiskTier` (kvd.tiers.disk.tier) carries what the disk plane and fsck call.
What a test or a benchmark also wants to spell shortly (one batch of
writes, a slot's record, the I/O engine's counters) is here, made of the
tier's public methods, so it runs the same write path and reads the same
records as the daemon.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd.tiers.disk.records import PutRecord
from kvd.tiers.disk.tier import DiskTier, WriteItem


def write_blocks(tier: DiskTier, namespace_id: bytes, layer_bytes: int, num_layers: int,
                 items: Sequence[WriteItem]) -> list[bool]:
    """Write one chunk of blocks (DiskTier.write_chunks, whose items these are); per-item ok."""
    done = tier.write_chunks(namespace_id, layer_bytes, num_layers, [items] if items else [])
    return done[0] if done else []


def record_of(tier: DiskTier, slot: int) -> PutRecord | None:
    """The live record of a slot, None if the slot is free."""
    return next((record for record in tier.live_records() if record.location == slot), None)


def engine_stats(tier: DiskTier) -> dict[str, int]:
    """The tier's I/O engine's counters (kvd.io), {} when it has none."""
    engine = tier.engine
    return dict(engine.stats) if engine is not None else {}


def manifest_bytes(tier: DiskTier) -> list[int]:
    """Each drive's manifest size, which compact_if_needed measures (compaction shrinks them).
    Read from the tier's own state: nothing it shows the disk plane would tell."""
    return [manifest.size_bytes for manifest in tier._state.manifests]
