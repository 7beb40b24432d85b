"""kvd-driven saves and loads between an engine's paged KV pool and kvd's arena, layer by layer.

An engine registers its pool as one Memory per layer (`PoolLayout`): layer
l holds `num_blocks` pages of `page_bytes` each, page b at b * page_bytes
(or split in a K half and a V half, as vLLM keeps them).
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

ABSENT = -1  # a layer offset meaning: that layer is not in this place
# A flag word at or past this means the transfer failed (kvd stores FAILED | its done value; values
# only grow, so a waiter for any layer is released): the engine must treat the pages as not loaded.
FAILED = 1 << 63


@dataclass(frozen=True, slots=True)
class PoolLayout:
    """An engine's paged KV pool as registered: one Memory per layer, pages of page_bytes (one layer of
    one block, K then V as in kvd's block layout).

    By default a page is contiguous and page b starts at b * page_bytes. Engines that keep K and V
    apart (vLLM: a layer is [2, num_blocks, ...]) give `v_offset`: page b's K half starts at
    b * page_stride and its V half v_offset bytes after that (vLLM: page_stride = page_bytes / 2,
    v_offset = num_blocks * page_bytes / 2)."""

    layers: tuple[Memory, ...]
    page_bytes: int
    num_blocks: int
    page_stride: int = 0  # 0: page_bytes
    v_offset: int = 0     # 0: K and V of a page are contiguous

    def __post_init__(self) -> None:
        if not self.layers or self.page_bytes <= 0 or self.num_blocks <= 0:
            raise DeviceError(f"a pool of {len(self.layers)} layers, {self.num_blocks} pages of {self.page_bytes} B")
        if self.page_stride < 0 or self.v_offset < 0 or (self.v_offset and self.page_bytes % 2):
            raise DeviceError(f"page stride {self.page_stride} and V offset {self.v_offset} for pages of "
                              f"{self.page_bytes} B")
        end = self.layer_bytes_needed()
        for layer, memory in enumerate(self.layers):
            if memory.nbytes < end:
                raise DeviceError(f"layer {layer} holds {memory.nbytes} bytes, less than the {end} that "
                                  f"{self.num_blocks} pages of {self.page_bytes} B (stride {self.stride}) take")

    def layer_bytes_needed(self) -> int:
        """Bytes each layer's memory must hold: up to the end of the last page's last part."""
        return (self.num_blocks - 1) * self.stride + max(offset + nbytes for offset, _, nbytes in self.parts())

    @property
    def stride(self) -> int:
        return self.page_stride or (self.page_bytes // 2 if self.v_offset else self.page_bytes)

    def parts(self) -> list[tuple[int, int, int]]:
        """(offset from the page's start in the pool, offset in the block's layer, bytes) of each
        contiguous part of a page: the whole page, or its K half and its V half."""
        if not self.v_offset:
            return [(0, 0, self.page_bytes)]
        half = self.page_bytes // 2
        return [(0, 0, half), (self.v_offset, half, half)]


def _offsets(layout: PoolLayout, block_ids, slot_offsets) -> tuple[np.ndarray, np.ndarray]:
    """The pool's offsets of the pages, and each block's layer offsets on kvd's side: [blocks, layers],
    ABSENT where that layer is not there. 1-D slot_offsets are slots holding every layer back to back."""
    block_ids = np.asarray(block_ids, dtype=np.int64)
    slot_offsets = np.asarray(slot_offsets, dtype=np.int64)
    if len(block_ids) != len(slot_offsets):
        raise DeviceError(f"{len(block_ids)} engine blocks for {len(slot_offsets)} slots")
    if len(block_ids) and (block_ids.min() < 0 or block_ids.max() >= layout.num_blocks):
        raise DeviceError(f"engine block ids must be in [0, {layout.num_blocks})")
    layers = len(layout.layers)
    if slot_offsets.ndim == 1:
        slot_offsets = slot_offsets[:, None] + np.arange(layers, dtype=np.int64) * layout.page_bytes
    elif slot_offsets.shape != (len(block_ids), layers):
        raise DeviceError(f"layer offsets of shape {slot_offsets.shape} for {len(block_ids)} blocks of {layers} layers")
    return block_ids.astype(np.uint64) * np.uint64(layout.stride), slot_offsets


def _copies(layout: PoolLayout, layer: int, places) -> list[tuple[Memory, np.ndarray, np.ndarray, int]]:
    """(kvd-side memory, its offsets, the pool's offsets, bytes) of each batched copy of one layer:
    per place, the blocks whose layer is there."""
    copies = []
    for memory, pages, layer_offsets in places:
        column = layer_offsets[:, layer]
        there = column != ABSENT
        if not there.any():
            continue
        slots, pages = (column, pages) if there.all() else (column[there], pages[there])
        slots = slots.astype(np.uint64)
        for pool_part, block_part, nbytes in layout.parts():
            copies.append((memory, slots + np.uint64(block_part), pages + np.uint64(pool_part), nbytes))
    return copies


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
    layer offsets [blocks, layers], ABSENT where a layer is not copied there) places each layer
    is copied to before its flag (the device tier)."""
    places = [(arena, *_offsets(layout, block_ids, slot_offsets))]
    places += [(memory, *_offsets(layout, ids, offsets)) for memory, ids, offsets in also]
    engine_index = flag_index if engine_flag_index is None else engine_flag_index
    for layer, pool in enumerate(layout.layers):
        if written is not None:
            written(layer)
        else:
            stream.wait_flag(engine_flags, engine_index, base + layer + 1)
        for memory, slots, pages, nbytes in _copies(layout, layer, places):
            stream.copy_blocks(memory, slots, pool, pages, nbytes)
        stream.write_flag(kvd_flags, flag_index, base + layer + 1)
    return base + len(layout.layers)


def load_places(layout: PoolLayout, sources: Sequence[tuple[Memory, object, object]]) -> list:
    """A load's sources with their offsets on both sides, computed once for every layer. A source is
    (memory, block_ids, slot offsets (1-D: slots holding every layer) or layer offsets [blocks,
    layers] with ABSENT where the layer comes from another source): the arena, and the device tier."""
    return [(memory, *_offsets(layout, ids, offsets)) for memory, ids, offsets in sources]


def load_layer(stream: Stream, layout: PoolLayout, places, layer: int, kvd_flags: Memory, flag_index: int,
               base: int) -> None:
    """Scatter one layer into the engine's pages from its places (load_places), then flag it landed."""
    pool = layout.layers[layer]
    for memory, slots, pages, nbytes in _copies(layout, layer, places):
        stream.copy_blocks(pool, pages, memory, slots, nbytes)
    stream.write_flag(kvd_flags, flag_index, base + layer + 1)


def load_layers(stream: Stream, layout: PoolLayout, sources: Sequence[tuple[Memory, object, object]],
                kvd_flags: Memory, flag_index: int, base: int) -> int:
    """Scatter each layer into the engine's pages from its sources (see load_places), flagging each
    layer as it lands; returns the flag value that means every layer has."""
    places = load_places(layout, sources)
    for layer in range(len(layout.layers)):
        load_layer(stream, layout, places, layer, kvd_flags, flag_index, base)
    return base + len(layout.layers)
