"""The vLLM connector's worker with vLLM's hybrid KV cache manager's groups, against a real daemon.

With a hybrid model (full and sliding-window attention layers) vLLM keeps a
block table per KV cache group, and the groups share the physical blocks:
here three layers, one per group, are views of one buffer, as vLLM lays
them out. kvd stores position i as one block of every layer, each layer's
bytes from its own group's engine block; a windowed group's table holds
vLLM's null block (0) where the window has left, and nothing is loaded
there or saved from there.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from kvd.client import Client
from kvd.connectors.vllm.config import ConnectorConfig
from kvd.connectors.vllm.layout import KvGroups, paged_layout
from kvd.connectors.vllm.metadata import KvdConnectorMetadata, LoadOrder, SaveOrder
from kvd.connectors.vllm.transfer import local_namespace
from kvd.connectors.vllm.worker import WorkerSide
from tests.integration.test_vllm_worker import BLOCK, HEAD_DIM, HEADS, LAYERS, SPEC, chain, step

BLOCKS = 16
# Layer 0 is full attention (group 0); layers 1 and 2 are sliding-window layers in groups of their own.
GROUPS = KvGroups(of_layer=(0, 1, 2), windowed=frozenset({1, 2}))


def shared_caches(seed: int | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One block pool that every layer views (each physical block belongs to one group at a time)."""
    shape = (BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    pool = torch.zeros(shape) if seed is None else torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return pool, {f"model.layers.{layer}.self_attn.attn": pool for layer in range(LAYERS)}


def grouped_worker(daemon, caches: dict[str, torch.Tensor]) -> WorkerSide:
    layout = dataclasses.replace(paged_layout(caches, BLOCKS), groups=GROUPS)
    return WorkerSide(ConnectorConfig(target=daemon.unix_target, load_timeout_s=10.0), layout, local_namespace(SPEC),
                      shard=0)


def test_each_layer_saves_from_and_loads_into_its_own_groups_blocks_skipping_the_null_block(daemon):
    pool_a, engine_a = shared_caches(seed=3)
    saver = grouped_worker(daemon, engine_a)
    keys = chain(4, seed=7)
    tables = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    try:
        step(saver, engine_a, KvdConnectorMetadata(saves=[SaveOrder("a", [keys], tables)]))
        assert saver.counters.saved_blocks == 4 and saver.counters.save_errors == 0
    finally:
        saver.close()

    pool_b, engine_b = shared_caches(seed=None)
    loader = grouped_worker(daemon, engine_b)
    # The windows of groups 1 and 2 have left positions 0 and 1: vLLM gave them the null block.
    loading = [[1, 2, 3, 4], [0, 0, 5, 6], [0, 0, 7, 8]]
    try:
        step(loader, engine_b, KvdConnectorMetadata(loads=[LoadOrder("b", [keys], 0, loading, False)]))
        assert loader.load_errors() == set() and loader.counters.loaded_blocks == 4
    finally:
        loader.close()
    assert torch.equal(pool_b[[1, 2, 3, 4]], pool_a[[1, 2, 3, 4]])  # layer 0: every position
    assert torch.equal(pool_b[[5, 6]], pool_a[[7, 8]])  # layer 1: positions 2 and 3 only
    assert torch.equal(pool_b[[7, 8]], pool_a[[11, 12]])  # layer 2: positions 2 and 3 only
    assert not pool_b[[0, *range(9, BLOCKS)]].any()  # the null block and the rest untouched


def test_a_save_reaching_back_past_a_window_is_given_back_whole(daemon):
    _, engine = shared_caches(seed=4)
    saver = grouped_worker(daemon, engine)
    keys = chain(3, seed=8)
    try:
        # kvd lacks position 0, which group 1's window has left: it cannot be filled.
        step(saver, engine, KvdConnectorMetadata(saves=[SaveOrder("a", [keys], [[1, 2, 3], [0, 5, 6], [7, 8, 9]])]))
        assert saver.counters.saved_blocks == 0 and saver.counters.save_errors == 0
    finally:
        saver.close()
    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        assert client.lookup(namespace, keys).matched == 0
        # Its reservation was given back: the same blocks can be stored at once.
        assert client.put(namespace, keys, np.zeros((3, *SPEC.block_shape), dtype=np.float32)) == 3


def test_a_failed_load_reports_every_groups_engine_blocks_but_the_null_block(daemon):
    _, engine = shared_caches(seed=None)
    loader = grouped_worker(daemon, engine)
    try:
        step(loader, engine, KvdConnectorMetadata(loads=[
            LoadOrder("miss", [chain(3, seed=9)], 0, [[1, 2, 3], [0, 4, 5], [0, 0, 6]], False)]))
        assert loader.load_errors() == {1, 2, 3, 4, 5, 6}
        assert loader.counters.load_errors == 3
    finally:
        loader.close()
