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
    round_trip(owner, mapping, data, np.random.default_rng(1).permutation(40)[:rows])


def round_trip(owner: HostArena, mapping: ArenaMapping, data: np.ndarray, slots: np.ndarray) -> None:
    """Scatter data's rows into 1 MiB slots `slots`, check them from the daemon's side, gather them back."""
    width = data.shape[1]
    offsets = (slots * (1 << 20)).tolist()
    mapping.scatter(data, offsets)
    # The daemon's own mapping sees exactly these bytes in exactly those slots.
    for row, slot in enumerate(slots):
        assert owner.read(int(slot), width) == data[row].tobytes()
    out = np.zeros_like(data)
    mapping.gather(offsets, width, out)
    assert np.array_equal(out, data)


SLOT_PATTERNS = {
    "one run": list(range(5, 35)),
    "runs and gaps": [3, 4, 5, 9, 10, 0, 1, 2, 30, 31, 32, 33, 20, 39] + list(range(11, 20)),
    "descending": list(range(39, 9, -1)),
}


@pytest.mark.parametrize("pattern", SLOT_PATTERNS)
@pytest.mark.parametrize("width", [(1 << 20) - 4096, 16 << 10])  # copied as slot runs / with one np.take
def test_scatter_and_gather_of_slot_runs(arena, pattern, width):
    owner, mapping = arena
    slots = np.array(SLOT_PATTERNS[pattern])
    data = np.random.default_rng(len(slots)).integers(0, 256, (len(slots), width), dtype=np.uint8)
    round_trip(owner, mapping, data, slots)


def test_slot_runs_cover_the_range_in_maximal_runs():
    slots = np.array(SLOT_PATTERNS["runs and gaps"])
    runs = _wire.slot_runs(slots, 0, len(slots))
    assert runs[0] == (0, 3) and runs[1] == (3, 5) and runs[2] == (5, 8)
    assert [first for first, _ in runs[1:]] == [last for _, last in runs[:-1]] and runs[-1][1] == len(slots)
    for first, last in runs:
        assert np.array_equal(slots[first:last], np.arange(slots[first], slots[first] + last - first))
    assert all(slots[last] != slots[last - 1] + 1 for _, last in runs[:-1])
    assert _wire.slot_runs(slots, 4, 4) == [] and _wire.slot_runs(slots, 4, 9) == [(4, 5), (5, 8), (8, 9)]


@pytest.mark.parametrize("offset", [-(1 << 20), 40 << 20, (1 << 20) + 1])
def test_bad_offsets_are_rejected_not_clamped(arena, offset):
    _, mapping = arena
    out = np.zeros((2, 16), dtype=np.uint8)
    with pytest.raises(InvalidArgument, match="arena offset"):
        mapping.gather([0, offset], 16, out)
    with pytest.raises(InvalidArgument, match="arena offset"):
        mapping.scatter(out, [0, offset])


def mapped_kib(mapping: ArenaMapping) -> int:
    """Resident KiB of the mapping's own range, from /proc/self/smaps."""
    start = mapping.slots.ctypes.data
    lines = open("/proc/self/smaps").read().splitlines()
    for number, line in enumerate(lines):
        if line[0] in "0123456789abcdef" and int(line.split("-")[0], 16) == start:
            return next(int(row.split()[1]) for row in lines[number + 1:] if row.startswith("Rss:"))
    raise AssertionError("the mapping is not in /proc/self/smaps")


@pytest.mark.parametrize("populate", [True, False], ids=["populated", "too-large-to-populate"])
def test_the_arena_is_mapped_populated_up_to_a_size(monkeypatch, populate):
    """A client maps the daemon's (preallocated) arena with its pages in place, so its first copies take no
    page faults; past ARENA_POPULATE_MAX_BYTES it maps them on first touch instead."""
    layout = ArenaLayout(slot_bytes=1 << 20, slot_count=8)
    owner = HostArena(layout, prefault=True)
    if not populate:
        monkeypatch.setattr(_wire, "ARENA_POPULATE_MAX_BYTES", layout.arena_bytes - 1)
    info = kvd_pb2.ArenaInfoResponse(arena_bytes=layout.arena_bytes, slot_bytes=layout.slot_bytes,
                                     slot_count=layout.slot_count, instance_id=owner.instance_id)
    mapping = ArenaMapping(info, owner.tenant_fd(""))
    try:
        assert mapped_kib(mapping) == (layout.arena_bytes >> 10 if populate else 0)
    finally:
        mapping.close()
        owner.close()
