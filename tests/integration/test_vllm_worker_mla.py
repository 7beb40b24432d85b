"""The vLLM connector's worker with an MLA model's cache, against a real daemon.

Multi-head latent attention (DeepSeek-style) caches one latent per token,
[num_blocks, 1, block_size, latent width] per layer on vLLM's CPU backend
([num_blocks, block_size, width] on GPUs), from which the engine derives K
and V. kvd stores it under a namespace with kv_order LATENT: one plane per
layer, so a block is num_layers x block_size x width, half what K and V of
one head of that width would be. The worker's copies must be bit-exact and
a client must read the blocks back in that shape.
"""

from __future__ import annotations

import numpy as np
import torch

from kvd.client import Client
from kvd.connectors.vllm.config import ConnectorConfig
from kvd.connectors.vllm.layout import paged_layout
from kvd.connectors.vllm.metadata import KvdConnectorMetadata, LoadOrder, SaveOrder
from kvd.connectors.vllm.transfer import local_namespace
from kvd.connectors.vllm.worker import WorkerSide
from kvd.core.keys import DType, KvOrder, NamespaceSpec, chain_keys
from tests.integration.test_vllm_worker import step

LAYERS, BLOCK, WIDTH, BLOCKS = 3, 16, 576, 10  # DeepSeek-V2's latent: 512 + 64 rope dims
SPEC = NamespaceSpec(model_id="vllm-mla-test", model_revision="cpu-mla", num_layers=LAYERS, num_kv_heads=1,
                     head_dim=WIDTH, block_tokens=BLOCK, kv_dtype=DType.FLOAT16, kv_order=KvOrder.LATENT)


def latent_caches(seed: int | None) -> dict[str, torch.Tensor]:
    shape = (BLOCKS, 1, BLOCK, WIDTH)
    if seed is None:
        return {f"model.layers.{layer}.self_attn.attn": torch.zeros(shape, dtype=torch.float16) for layer in range(LAYERS)}
    generator = torch.Generator().manual_seed(seed)
    return {f"model.layers.{layer}.self_attn.attn": torch.randn(shape, generator=generator).half()
            for layer in range(LAYERS)}


def worker_for(daemon, caches: dict[str, torch.Tensor]) -> WorkerSide:
    layout = paged_layout(caches, BLOCKS)
    assert layout.layer_bytes == SPEC.layer_bytes == BLOCK * WIDTH * 2  # one plane, not K and V
    return WorkerSide(ConnectorConfig(target=daemon.unix_target, load_timeout_s=10.0), layout, local_namespace(SPEC),
                      shard=0)


def test_latent_blocks_save_and_load_bit_exact_and_read_back_in_their_shape(daemon):
    saved, loaded = [2, 5, 7], [1, 8, 3]
    keys = chain_keys(SPEC, list(range(4, 4 + len(saved) * BLOCK)))
    engine_a = latent_caches(seed=5)
    saver = worker_for(daemon, engine_a)
    try:
        step(saver, engine_a, KvdConnectorMetadata(saves=[SaveOrder("a", [keys], [saved])]))
        assert saver.counters.saved_blocks == len(saved) and saver.counters.save_errors == 0
    finally:
        saver.close()

    engine_b = latent_caches(seed=None)
    loader = worker_for(daemon, engine_b)
    try:
        step(loader, engine_b, KvdConnectorMetadata(loads=[LoadOrder("b", [keys], 0, [loaded], False)]))
        assert loader.load_errors() == set() and loader.counters.loaded_blocks == len(saved)
    finally:
        loader.close()
    for name in engine_a:
        assert torch.equal(engine_b[name][loaded], engine_a[name][saved])
        untouched = [block for block in range(BLOCKS) if block not in loaded]
        assert not engine_b[name][untouched].any()

    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        blocks = client.get_numpy(namespace, keys)
        assert blocks.shape == (len(saved), LAYERS, 1, BLOCK, 1, WIDTH)
        for layer, name in enumerate(engine_a):
            expected = engine_a[name][saved].reshape(len(saved), BLOCK, WIDTH).numpy()
            assert np.array_equal(blocks[:, layer, 0, :, 0, :].view(np.int16), expected.view(np.int16))
