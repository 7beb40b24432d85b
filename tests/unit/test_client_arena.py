"""The client's view of the arena: scatter/gather against a real arena file."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.client import _wire
from kvd.client._wire import ArenaMapping
from kvd.errors import InvalidArgument
from kvd.tiers.host import ArenaLayout, HostArena
from kvd.v1 import kvd_pb2


@pytest.fixture
def arena():
    layout = ArenaLayout(slot_bytes=1 << 20, slot_count=40)
    owner = HostArena(layout, prefault=False)
    info = kvd_pb2.ArenaInfoResponse(
        arena_bytes=layout.arena_bytes, slot_bytes=layout.slot_bytes,
        slot_count=layout.slot_count, instance_id=owner.instance_id,
    )
    mapping = ArenaMapping(info, owner.tenant_fd(""))
    yield owner, mapping
    mapping.close()
    owner.close()


@pytest.mark.parametrize("rows", [3, 30])  # 30 MiB crosses the threaded-copy threshold
def test_scatter_then_gather_round_trips(arena, rows):
    owner, mapping = arena
    assert (rows << 20 >= _wire.PARALLEL_COPY_MIN_BYTES) == (rows == 30)
    width = (1 << 20) - 4096  # blocks smaller than their slot
    data = np.random.default_rng(rows).integers(0, 256, (rows, width), dtype=np.uint8)
    slots = np.random.default_rng(1).permutation(40)[:rows]
    offsets = (slots * (1 << 20)).tolist()
    mapping.scatter(data, offsets)
    # The daemon's own mapping sees exactly these bytes in exactly those slots.
    for row, slot in enumerate(slots):
        assert owner.read(int(slot), width) == data[row].tobytes()
    out = np.zeros_like(data)
    mapping.gather(offsets, width, out)
    assert np.array_equal(out, data)


@pytest.mark.parametrize("offset", [-(1 << 20), 40 << 20, (1 << 20) + 1])
def test_bad_offsets_are_rejected_not_clamped(arena, offset):
    _, mapping = arena
    out = np.zeros((2, 16), dtype=np.uint8)
    with pytest.raises(InvalidArgument, match="arena offset"):
        mapping.gather([0, offset], 16, out)
    with pytest.raises(InvalidArgument, match="arena offset"):
        mapping.scatter(out, [0, offset])
