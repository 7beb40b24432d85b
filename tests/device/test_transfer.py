"""kvd-driven saves and loads, layer by layer, between an engine's pool and the arena (every device that opens)."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.device import DeviceError, Memory
from kvd.device.transfer import ABSENT, PoolLayout, load_layers, save_layers
from tests.device.staging import Staging

LAYERS, PAGES, PAGE = 4, 32, 2048


def engine_pool(device):
    layers = tuple(device.alloc(PAGES * PAGE) for _ in range(LAYERS))
    return PoolLayout(layers, PAGE, PAGES)


def pattern(layer: int, page: int) -> np.ndarray:
    return np.full(PAGE, (layer * 37 + page * 11 + 1) % 256, dtype=np.uint8)


def test_a_save_waits_for_each_layer_and_a_load_puts_every_page_back(device):
    layout = engine_pool(device)
    arena = device.alloc(16 * LAYERS * PAGE)
    engine_flags, kvd_flags = device.alloc(4096), device.alloc(4096)  # each side writes its own
    engine, kvd = device.stream(), device.stream()
    staging = Staging(device, PAGES * PAGE)
    for flags in (engine_flags, kvd_flags):
        staging.put(engine, flags, 0, np.zeros(4096, np.uint8))
    block_ids = [3, 17, 5, 30]
    slots = np.array([9, 0, 12, 4], dtype=np.uint64) * (LAYERS * PAGE)
    done = save_layers(kvd, layout, block_ids, arena, slots, engine_flags, kvd_flags, 0, base=0)
    assert done == LAYERS
    # The engine writes its layers one at a time; the save follows, never ahead of it.
    for layer in range(LAYERS):
        staging.put(engine, layout.layers[layer], 0, np.concatenate([pattern(layer, p) for p in range(PAGES)]))
        # Not yet written: the save has not gone past the layers before it.
        assert staging.get(engine, kvd_flags, 0, 8).view(np.uint64)[0] <= layer
        engine.write_flag(engine_flags, 0, layer + 1)
    kvd.synchronize(timeout_s=20)
    assert staging.get(engine, kvd_flags, 0, 8).view(np.uint64)[0] == LAYERS
    for slot, block in zip(slots.tolist(), block_ids):
        got = staging.get(engine, arena, slot, LAYERS * PAGE).reshape(LAYERS, PAGE)
        assert all(np.array_equal(got[layer], pattern(layer, block)) for layer in range(LAYERS))
    # Load into other pages of the pool (as for another request), flags going on from LAYERS.
    targets = [0, 1, 2, 31]
    assert load_layers(kvd, layout, [(arena, targets, slots)], kvd_flags, 1, base=LAYERS) == 2 * LAYERS
    engine.wait_flag(kvd_flags, 1, 2 * LAYERS)
    for layer in range(LAYERS):
        pages = staging.get(engine, layout.layers[layer], 0, PAGES * PAGE).reshape(PAGES, PAGE)
        for target, source in zip(targets, block_ids):
            assert np.array_equal(pages[target], pattern(layer, source))
    engine.close()
    kvd.close()


def test_a_save_and_a_load_split_layers_between_two_places_by_layer_offsets(device):
    """The device tier's shape: a second place holds some layers of each block at arbitrary
    offsets (ABSENT elsewhere); a load takes those layers from it and the rest from the arena."""
    layout = engine_pool(device)
    arena, tier = device.alloc(4 * LAYERS * PAGE), device.alloc(8 * PAGE)
    flags = device.alloc(4096)
    stream, staging = device.stream(), Staging(device, PAGES * PAGE)
    staging.put(stream, flags, 0, np.zeros(4096, np.uint8))
    for layer in range(LAYERS):
        staging.put(stream, layout.layers[layer], 0, np.concatenate([pattern(layer, p) for p in range(PAGES)]))
    source, slots = [7, 9], np.array([0, 2], dtype=np.int64) * (LAYERS * PAGE)
    # Block 7 keeps layers 0 and 2 in the tier (pages 5 and 1), block 9 keeps layer 3 only (page 6).
    in_tier = np.full((2, LAYERS), ABSENT, dtype=np.int64)
    in_tier[0, [0, 2]] = [5 * PAGE, 1 * PAGE]
    in_tier[1, 3] = 6 * PAGE
    save_layers(stream, layout, source, arena, slots, flags, flags, 0, 0, written=lambda layer: None,
                also=[(tier, source, in_tier)])
    stream.synchronize(timeout_s=20)
    assert np.array_equal(staging.get(stream, tier, 1 * PAGE, PAGE), pattern(2, 7))
    assert np.array_equal(staging.get(stream, tier, 6 * PAGE, PAGE), pattern(3, 9))
    # Mark the tier's copies, then load: the tier's layers come from it, the others from the arena.
    for offset in (5, 1, 6):
        staging.put(stream, tier, offset * PAGE, np.full(PAGE, 0xEE, np.uint8))
    from_arena = np.where(in_tier == ABSENT, slots[:, None] + np.arange(LAYERS) * PAGE, ABSENT)
    targets = [20, 21]
    load_layers(stream, layout, [(arena, targets, from_arena), (tier, targets, in_tier)], flags, 1, 0)
    stream.synchronize(timeout_s=20)
    for layer in range(LAYERS):
        pages = staging.get(stream, layout.layers[layer], 0, PAGES * PAGE).reshape(PAGES, PAGE)
        for row, (target, block) in enumerate(zip(targets, source)):
            expected = np.full(PAGE, 0xEE, np.uint8) if in_tier[row, layer] != ABSENT else pattern(layer, block)
            assert np.array_equal(pages[target], expected), (layer, block)
    stream.close()


def test_layouts_and_block_ids_are_checked_before_anything_is_issued(device):
    memory = device.alloc(PAGES * PAGE)
    with pytest.raises(DeviceError, match="less than"):
        PoolLayout((memory,), PAGE, PAGES + 1)
    with pytest.raises(DeviceError, match="a pool of 0 layers"):
        PoolLayout((), PAGE, PAGES)
    layout = PoolLayout((memory,), PAGE, PAGES)
    stream = device.stream()
    with pytest.raises(DeviceError, match="engine block ids"):
        load_layers(stream, layout, [(memory, [PAGES], [0])], memory, 0, 0)
    with pytest.raises(DeviceError, match="engine blocks for"):
        load_layers(stream, layout, [(memory, [0, 1], [0])], memory, 0, 0)
    stream.synchronize(timeout_s=10)
    stream.close()
    assert isinstance(layout.layers[0], Memory)
    device.free(memory)
