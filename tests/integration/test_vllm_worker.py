"""The vLLM connector's worker data path against a real daemon, without vLLM.

A worker (kvd.connectors.vllm.worker) is driven through the calls vLLM
makes per step (start, per-layer save/wait, finish) on KV tensors laid out
as vLLM's CPU backend lays them out (one view per layer of one buffer);
its copies must be bit-exact, land in the right engine blocks and nowhere
else, and every way a load can fail must be reported, never served.
"""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest
import torch

from kvd.client import Client
from kvd.connectors.vllm.config import ConnectorConfig
from kvd.connectors.vllm.layout import UnsupportedLayout, paged_layout
from kvd.connectors.vllm.metadata import KvdConnectorMetadata, LoadOrder, SaveOrder
from kvd.connectors.vllm.transfer import local_namespace
from kvd.connectors.vllm.requests import prompt_keys
from kvd.connectors.vllm.worker import WorkerSide
from kvd.core.keys import DType, NamespaceSpec, chain_keys
from kvd.testing.daemon import run_daemon
from kvd.testing.slow_drive import slowed_drive
from tests.integration.disk_tier_helpers import flip_first_layer_byte

LAYERS, HEADS, BLOCK, HEAD_DIM, BLOCKS = 3, 2, 16, 32, 12
SPEC = NamespaceSpec(model_id="vllm-worker-test", model_revision="cpu-layout", num_layers=LAYERS,
                     num_kv_heads=HEADS, head_dim=HEAD_DIM, block_tokens=BLOCK, kv_dtype=DType.FLOAT32)


def kv_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """Per-layer views of one buffer, [blocks, heads, block, 2 * head_dim] (vLLM's CPU layout)."""
    shape = (LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD_DIM)
    if seed is None:
        buffer = torch.zeros(shape)
    else:
        buffer = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return {f"model.layers.{layer}.self_attn.attn": buffer[layer] for layer in range(LAYERS)}


def worker_for(daemon, caches: dict[str, torch.Tensor], target: str | None = None) -> WorkerSide:
    """A worker as the connector makes one: the namespace is registered on first use, not here."""
    config = ConnectorConfig(target=target or daemon.unix_target, load_timeout_s=10.0)
    return WorkerSide(config, paged_layout(caches, BLOCKS), local_namespace(SPEC), shard=0)


def step(worker: WorkerSide, caches: dict[str, torch.Tensor], metadata: KvdConnectorMetadata) -> None:
    """One engine step as vLLM drives it: bind, each layer (wait, compute, save), end."""
    worker.start(metadata)
    for name in caches:
        worker.wait_layer(name)
        worker.save_layer(name)
    worker.finish_step()


def chain(count: int, seed: int = 0) -> list[bytes]:
    return chain_keys(SPEC, [4 + (seed * 1000 + index) % 4000 for index in range(count * BLOCK)])


@pytest.fixture
def source(daemon):
    caches = kv_caches(seed=1)
    worker = worker_for(daemon, caches)
    yield worker, caches
    worker.close()


def test_saved_blocks_load_bit_exact_into_other_engine_blocks(daemon, source):
    saver, engine_a = source
    keys = chain(5)
    step(saver, engine_a, KvdConnectorMetadata(saves=[SaveOrder("a", [keys], [[7, 3, 9, 1, 4]])]))
    assert saver.counters.saved_blocks == 5 and saver.counters.save_errors == 0

    engine_b = kv_caches(seed=None)
    loader = worker_for(daemon, engine_b)
    try:
        step(loader, engine_b, KvdConnectorMetadata(loads=[LoadOrder("b", [keys], 1, [[2, 5, 6, 8]], False)]))
        assert loader.load_errors() == set()
        assert loader.counters.loaded_blocks == 4
    finally:
        loader.close()
    for name in engine_a:
        assert torch.equal(engine_b[name][[2, 5, 6, 8]], engine_a[name][[3, 9, 1, 4]])
        untouched = [block for block in range(BLOCKS) if block not in (2, 5, 6, 8)]
        assert not engine_b[name][untouched].any()


def test_an_asynchronous_load_is_reported_finished_with_its_blocks(daemon, source):
    saver, engine_a = source
    keys = chain(3, seed=1)
    step(saver, engine_a, KvdConnectorMetadata(saves=[SaveOrder("a", [keys], [[0, 1, 2]])]))
    engine_b = kv_caches(seed=None)
    loader = worker_for(daemon, engine_b)
    step(loader, engine_b, KvdConnectorMetadata(loads=[LoadOrder("parked", [keys], 0, [[9, 10, 11]], True)]))
    loader.close()  # waits for the load thread
    assert loader.finished() == (None, {"parked"})
    assert loader.load_errors() == set() and loader.counters.async_loads == 1
    for name in engine_a:
        assert torch.equal(engine_b[name][[9, 10, 11]], engine_a[name][[0, 1, 2]])


@pytest.mark.parametrize("asynchronous", [False, True])
def test_blocks_kvd_does_not_have_are_reported_and_left_alone(daemon, asynchronous):
    engine = kv_caches(seed=None)
    loader = worker_for(daemon, engine)
    keys = chain(4, seed=2)  # never stored
    step(loader, engine, KvdConnectorMetadata(loads=[LoadOrder("miss", [keys], 0, [[3, 4, 5, 6]], asynchronous)]))
    loader.close()
    assert loader.load_errors() == {3, 4, 5, 6}
    assert loader.counters.load_errors == 4 and loader.counters.loaded_blocks == 0
    assert loader.counters.corrupt_blocks == 0  # never stored: a miss, not damage
    assert not any(tensor.any() for tensor in engine.values())


def test_a_load_that_fails_aborts_the_same_requests_save(daemon, source):
    """The request's blocks may hold garbage: nothing of it is stored."""
    saver, engine_a = source
    keys = chain(4, seed=3)
    step(saver, engine_a, KvdConnectorMetadata(saves=[SaveOrder("a", [keys[:2]], [[0, 1]])]))
    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        client.delete(namespace, [keys[0]])  # vanishes between the Lookup and the load
        metadata = KvdConnectorMetadata(loads=[LoadOrder("r", [keys[:2]], 0, [[5, 6]], False)],
                                        saves=[SaveOrder("r", [keys], [[5, 6, 7, 8]])])
        step(saver, engine_a, metadata)
        assert saver.load_errors() == {5, 6}
        assert client.lookup(namespace, keys).matched == 0


def test_a_two_part_layout_round_trips():
    """[2, blocks, ...] per layer (K and V apart, as GPU backends have it): a block's layer is both rows."""
    buffer = torch.randn(LAYERS, 2, BLOCKS, BLOCK, HEADS, HEAD_DIM)
    layout = paged_layout({f"l{layer}": buffer[layer] for layer in range(LAYERS)}, BLOCKS)
    assert layout.description == f"[2][blocks]{[BLOCK, HEADS, HEAD_DIM]}"
    assert layout.layer_bytes == SPEC.layer_bytes and all(len(parts) == 2 for parts in layout.parts)
    assert layout.word == torch.int64  # copied as 8-byte words; rows of odd widths as bytes:
    assert paged_layout({"l0": torch.zeros(BLOCKS, 3, dtype=torch.uint8)}, BLOCKS).word == torch.uint8
    assert torch.equal(layout.parts[1][1][4].view(torch.float32), buffer[1, 1, 4].flatten())


def test_layouts_kvd_cannot_store_block_by_block_are_refused():
    with pytest.raises(UnsupportedLayout, match="no block axis"):
        paged_layout({"l0": torch.zeros(BLOCK, BLOCKS, 8)}, BLOCKS)
    with pytest.raises(UnsupportedLayout, match="not contiguous"):
        paged_layout({"l0": torch.zeros(8, BLOCKS, 4).transpose(0, 1)}, BLOCKS)
    with pytest.raises(UnsupportedLayout, match="layers differ"):
        paged_layout({"l0": torch.zeros(BLOCKS, 8), "l1": torch.zeros(BLOCKS, 16)}, BLOCKS)


def request(tokens, *, lora=None, salt=None, features=()):
    return SimpleNamespace(prompt_token_ids=tokens, lora_request=lora, cache_salt=salt, mm_features=list(features))


def test_keys_count_every_input_that_shapes_a_blocks_kv():
    tokens = list(range(4, 4 + 3 * BLOCK + 5))
    plain = prompt_keys(SPEC, request(tokens))
    assert plain == chain_keys(SPEC, tokens) and len(plain) == 3  # the partial last block has no key
    lora = SimpleNamespace(lora_name="adapter", lora_path="/a")
    other_path = SimpleNamespace(lora_name="adapter", lora_path="/b")
    image = SimpleNamespace(identifier="img-hash", mm_position=SimpleNamespace(offset=BLOCK + 3, length=4))
    variants = {
        "lora": prompt_keys(SPEC, request(tokens, lora=lora)),
        "lora path": prompt_keys(SPEC, request(tokens, lora=other_path)),
        "salt": prompt_keys(SPEC, request(tokens, salt="s")),
        "image": prompt_keys(SPEC, request(tokens, features=[image])),
    }
    for name, keys in variants.items():
        assert len(keys) == 3
    assert len({tuple(keys) for keys in [plain, *variants.values()]}) == 5
    assert all(key not in plain for key in variants["salt"])  # salted from the first block on
    assert variants["image"][0] == plain[0] and variants["image"][1] != plain[1]  # from the image's block on
    assert prompt_keys(SPEC, request(None)) == []  # prompt embeddings: not cached


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_block_that_fails_its_checksum_on_disk_ends_the_load_there(tmp_path, asynchronous):
    """Blocks 0..2 arrive bit-exact; block 3 is corrupt on disk, so it and every block after
    it are reported (vLLM recomputes them) and their engine blocks are not served garbage."""
    config = {"host": {"capacity_bytes": 16 << 20, "slot_bytes": 64 << 10},
              "disk": {"directories": [str(tmp_path / "nvme0")], "capacity_bytes": 8 << 20,
                       "segment_bytes": 4 << 20, "slot_bytes": 64 << 10, "fsync": "strict"}}
    source = kv_caches(seed=5)
    rows = torch.stack([torch.stack([source[name][block].reshape(-1) for name in source]) for block in range(6)])
    keys = chain(6, seed=4)
    with run_daemon(tmp_path / "d", config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        assert client.put(namespace, keys, rows.numpy().reshape(6, *SPEC.block_shape), durable=True) == 6
    assert flip_first_layer_byte(tmp_path, rows[3].numpy()) == 1
    engine = kv_caches(seed=None)
    with run_daemon(tmp_path / "d", config=config) as daemon:
        loader = worker_for(daemon, engine)
        order = LoadOrder("r", [keys], 0, [[6, 7, 8, 9, 10, 11]], asynchronous)
        step(loader, engine, KvdConnectorMetadata(loads=[order]))
        loader.close()
    assert loader.load_errors() == {9, 10, 11}
    # Reported as damage, not as a miss (vllm:kvd_corrupt_blocks_total).
    assert loader.counters.corrupt_blocks == 3
    for name in engine:
        assert torch.equal(engine[name][[6, 7, 8]], source[name][[0, 1, 2]])


def test_a_worker_started_before_its_daemon_stores_once_it_answers(tmp_path):
    """vLLM must start without kvd; the first step after kvd comes up registers the namespace.
    A daemon restarted without a disk tier forgets the namespace: registered again, not an error."""
    engine = kv_caches(seed=6)
    target = f"unix://{tmp_path / 'd' / 'state' / 'kvd.sock'}"
    worker = worker_for(None, engine, target=target)
    keys = chain(2, seed=6)
    try:
        step(worker, engine, KvdConnectorMetadata(saves=[SaveOrder("early", [keys], [[0, 1]])]))
        assert worker.counters.save_errors == 1 and worker.counters.saved_blocks == 0
        for attempt in range(2):  # a daemon, then a new one on the same (diskless) state
            with run_daemon(tmp_path / "d") as daemon:
                assert daemon.unix_target == target
                # gRPC redials after its backoff; wait for that, not for a guessed time.
                grpc.channel_ready_future(worker.link.client._channel).result(timeout=60)
                step(worker, engine, KvdConnectorMetadata(saves=[SaveOrder(f"late{attempt}", [keys], [[0, 1]])]))
                assert worker.counters.saved_blocks == 2 * (attempt + 1)
                with Client(daemon.unix_target) as client:
                    assert client.lookup(client.register_namespace(SPEC), keys).matched == 2
    finally:
        worker.close()


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_load_past_its_budget_is_cut_and_its_blocks_left_to_vllm(tmp_path, asynchronous):
    """The scheduler gives a load the seconds after which computing its blocks is sooner: from a
    drive throttled so that the blocks take several times that, the load is cut there (every block
    reported, nothing written into the engine, counted as cut); with time to spare it lands."""
    source = kv_caches(seed=6)
    rows = torch.stack([torch.stack([source[name][block].reshape(-1) for name in source]) for block in range(6)])
    keys = chain(6, seed=5)
    with slowed_drive(tmp_path / "nvme0", size_bytes=256 << 20) as drive:
        config = {"host": {"capacity_bytes": 16 << 20, "slot_bytes": 64 << 10},
                  "disk": {"directories": [str(drive.directory)], "capacity_bytes": 32 << 20,
                           "segment_bytes": 4 << 20, "slot_bytes": 64 << 10, "write_mode": "through"}}
        with run_daemon(tmp_path / "d", config=config) as daemon, Client(daemon.unix_target) as client:
            drive.admit(daemon.pid)
            namespace = client.register_namespace(SPEC)
            assert client.put(namespace, keys, rows.numpy().reshape(6, *SPEC.block_shape), durable=True) == 6
            assert client.demote().blocks_demoted >= 6
            drive.throttle(read_bps=64 << 10)  # 6 blocks of 24 KiB: over 2 s
            engine = kv_caches(seed=None)
            loader = worker_for(daemon, engine)
            order = LoadOrder("slow", [keys], 0, [[0, 1, 2, 3, 4, 5]], asynchronous, budget_s=0.2)
            step(loader, engine, KvdConnectorMetadata(loads=[order]))
            loader.close()
            assert loader.load_errors() == {0, 1, 2, 3, 4, 5} and loader.counters.cut_loads == 1
            assert not any(tensor.any() for tensor in engine.values())
            drive.throttle()
            loader = worker_for(daemon, engine)
            order = LoadOrder("fast", [keys], 0, [[6, 7, 8, 9, 10, 11]], asynchronous, budget_s=30.0)
            step(loader, engine, KvdConnectorMetadata(loads=[order]))
            loader.close()
            assert loader.load_errors() == set() and loader.counters.cut_loads == 0
    for name in engine:
        assert torch.equal(engine[name][6:12], source[name][0:6])
