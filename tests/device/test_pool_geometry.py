"""An engine's KV tensors registered as a pool by their strides (kvd.connectors.vllm.device_worker):
vLLM's logical [2, num_blocks, block, heads, head_dim] may be laid out K/V-first (FlashAttention) or
blocks-first (a [num_blocks, 2, ...] tensor viewed through a permutation, as its stride orders allow),
and a [num_blocks, ...] pool may have padded pages. A save through the geometry read from the strides
must put exactly K then V of each block's layer into the arena, whichever the layout."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvd.connectors.vllm.device_worker import _geometry
from kvd.connectors.vllm.layout import paged_layout
from kvd.device.cpu import CpuDevice
from kvd.device.transfer import PoolLayout, save_layers

BLOCKS, TOKENS, HEADS, DIM = 6, 4, 2, 8


def _k_v_first() -> torch.Tensor:
    return torch.randn(2, BLOCKS, TOKENS, HEADS, DIM)


def _blocks_first() -> torch.Tensor:
    return torch.randn(BLOCKS, 2, TOKENS, HEADS, DIM).transpose(0, 1)  # logical [2, blocks, ...]


def _padded_pages() -> torch.Tensor:
    return torch.randn(BLOCKS, 2 * TOKENS * HEADS * DIM + 16)[:, :2 * TOKENS * HEADS * DIM]


def _expected_layer(tensor: torch.Tensor, block: int) -> np.ndarray:
    if tensor.shape[0] == 2:
        return torch.cat([tensor[0, block].reshape(-1), tensor[1, block].reshape(-1)]).numpy()
    return tensor[block].reshape(-1).numpy()


@pytest.mark.parametrize("make", [_k_v_first, _blocks_first, _padded_pages])
def test_a_save_through_the_strides_geometry_copies_k_then_v_of_each_block(make):
    device = CpuDevice(0)
    tensors = {f"layer.{i}": make() for i in range(2)}
    layout = paged_layout(tensors, BLOCKS)
    geometry = [_geometry(tensor, layout) for tensor in tensors.values()]
    page_stride, v_offset, _ = geometry[0]
    memories = tuple(device.wrap(t.data_ptr(), extent) for t, (_, _, extent) in zip(tensors.values(), geometry))
    pool = PoolLayout(memories, layout.layer_bytes, BLOCKS, page_stride, v_offset)
    arena = np.zeros(BLOCKS * 2 * layout.layer_bytes, dtype=np.uint8)
    arena_memory = device.wrap(arena.ctypes.data, arena.nbytes)
    flags = np.zeros(4, dtype=np.uint64)
    flag_memory = device.wrap(flags.ctypes.data, flags.nbytes)
    block_ids = [4, 0, 5]
    slots = np.arange(len(block_ids), dtype=np.uint64) * np.uint64(2 * layout.layer_bytes)
    stream = device.stream()
    save_layers(stream, pool, block_ids, arena_memory, slots, flag_memory, flag_memory, 1, 0, written=lambda _: None)
    stream.synchronize(timeout_s=20)
    stream.close()
    rows = arena.view(np.float32).reshape(len(arena) // (2 * layout.layer_bytes), 2, -1)
    for slot, block in enumerate(block_ids):
        for layer, tensor in enumerate(tensors.values()):
            np.testing.assert_array_equal(rows[slot, layer], _expected_layer(tensor, block))
