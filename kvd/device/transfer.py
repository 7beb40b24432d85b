"""kvd-driven saves and loads between an engine's paged KV pool and kvd's arena, layer by layer.

An engine registers its pool as one Memory per layer (`PoolLayout`): layer
l holds `num_blocks` pages of `page_bytes` each, page b at b * page_bytes.
kvd's arena holds a block in one slot, its layers back to back, so layer l
of the block in slot s is at s + l * page_bytes.

- A save (`save_layers`): for each layer, kvd's stream waits until the
  engine's flag word says the layer is written (value past `base + l`),
  gathers that layer's pages into their slots in one batched copy, and
  stores `base + l + 1` in kvd's own flag word, so the engine knows when it
  may overwrite the pages.
- A load (`load_layers`): for each layer, one batched copy scatters the
  slots' layer into the engine's pages, then kvd's flag word gets
  `base + l + 1`; the engine's stream waits on it (cuStreamWaitValue64)
  before attention of layer l, so layer l is used as soon as it has landed.

The offsets are computed once per request with numpy, the copies are one
call per layer: nothing loops over blocks x layers in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvd.device.api import DeviceError, Memory, Stream


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """An engine's paged KV pool as registered: one Memory per layer, pages of page_bytes."""

    layers: tuple[Memory, ...]
    page_bytes: int
    num_blocks: int

    def __post_init__(self) -> None:
        if not self.layers or self.page_bytes <= 0 or self.num_blocks <= 0:
            raise DeviceError(f"a pool of {len(self.layers)} layers, {self.num_blocks} pages of {self.page_bytes} B")
        for layer, memory in enumerate(self.layers):
            if memory.nbytes < self.num_blocks * self.page_bytes:
                raise DeviceError(f"layer {layer} holds {memory.nbytes} bytes, less than {self.num_blocks} pages "
                                  f"of {self.page_bytes}")


def _offsets(layout: PoolLayout, block_ids, slot_offsets) -> tuple[np.ndarray, np.ndarray]:
    block_ids = np.asarray(block_ids, dtype=np.int64)
    slot_offsets = np.asarray(slot_offsets, dtype=np.uint64)
    if len(block_ids) != len(slot_offsets):
        raise DeviceError(f"{len(block_ids)} engine blocks for {len(slot_offsets)} slots")
    if len(block_ids) and (block_ids.min() < 0 or block_ids.max() >= layout.num_blocks):
        raise DeviceError(f"engine block ids must be in [0, {layout.num_blocks})")
    return block_ids.astype(np.uint64) * np.uint64(layout.page_bytes), slot_offsets


def save_layers(stream: Stream, layout: PoolLayout, block_ids, arena: Memory, slot_offsets,
                engine_flags: Memory, kvd_flags: Memory, flag_index: int, base: int,
                written: Callable[[int], None] | None = None, engine_flag_index: int | None = None,
                also: Sequence[tuple[Memory, object, object]] = ()) -> int:
    """Gather each layer's pages into the slots once the engine says it is written; returns the
    kvd flag value that means the whole save is in the arena.

    The engine's word is flags[engine_flag_index] (default: flag_index). `written`, when given,
    is called before each layer's copy is issued and returns once that layer is written (it
    raises to stop the save): the host watches the engine's word instead of the stream, so a
    stream is never left waiting on an engine that stopped. `also`: more (memory, block_ids,
    slot_offsets) places each layer is copied to before its flag (the device tier)."""
    places = [(arena, *_offsets(layout, block_ids, slot_offsets))]
    places += [(memory, *_offsets(layout, ids, offsets)) for memory, ids, offsets in also]
    engine_index = flag_index if engine_flag_index is None else engine_flag_index
    for layer, pool in enumerate(layout.layers):
        if written is not None:
            written(layer)
        else:
            stream.wait_flag(engine_flags, engine_index, base + layer + 1)
        for memory, pages, slots in places:
            stream.copy_blocks(memory, slots + np.uint64(layer * layout.page_bytes), pool, pages, layout.page_bytes)
        stream.write_flag(kvd_flags, flag_index, base + layer + 1)
    return base + len(layout.layers)


def load_layers(stream: Stream, layout: PoolLayout, block_ids, arena: Memory, slot_offsets,
                kvd_flags: Memory, flag_index: int, base: int,
                also: Sequence[tuple[Memory, object, object]] = ()) -> int:
    """Scatter each layer from the slots into the engine's pages, flagging each layer as it lands;
    returns the flag value that means every layer has. `also`: more (memory, block_ids,
    slot_offsets) sources, copied in the same layer before its flag (the device tier)."""
    places = [(arena, *_offsets(layout, block_ids, slot_offsets))]
    places += [(memory, *_offsets(layout, ids, offsets)) for memory, ids, offsets in also]
    for layer, pool in enumerate(layout.layers):
        for memory, pages, slots in places:
            stream.copy_blocks(pool, pages, memory, slots + np.uint64(layer * layout.page_bytes), layout.page_bytes)
        stream.write_flag(kvd_flags, flag_index, base + layer + 1)
    return base + len(layout.layers)
