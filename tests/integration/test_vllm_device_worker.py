"""The vLLM connector's transfer = "daemon" worker against a real daemon, without vLLM: this test plays
the model, calling the worker as vLLM does (start, per layer wait_layer / save_layer, finish_step) on
torch tensors of its own memory. It checks the bytes, that each layer is waited for, the daemon
restarting under the engine (the pool is registered again), and a load of blocks kvd lacks.

The tests marked `asynchronous` run the CPU device's asynchronous mode in both processes
(KVD_CPU_DEVICE_DELAY_MS): the model's writes to a layer land on its stream later than it issues them,
as a GPU's kernels do, and so do the daemon's copies; a flag marked from the host ahead of the writes
it stands for then stores the wrong bytes, as it would on a GPU."""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest
import torch

from kvd.client import Client
from kvd.connectors.vllm.config import ConnectorConfig
from kvd.connectors.vllm.device_worker import DeviceWorkerSide
from kvd.connectors.vllm.layout import paged_layout
from kvd.connectors.vllm.metadata import KvdConnectorMetadata, LoadOrder, SaveOrder
from kvd.connectors.vllm.placement import PlacementOptions, SavePlanner
from kvd.connectors.vllm.transfer import local_namespace
from kvd.core.keys import DType, NamespaceSpec, chain_keys
from kvd.device.cpu import DELAY_ENV
from kvd.planner.distance import NONE, distance_options, offloaded_count
from kvd.planner.latency import Batch, gpu_bytes
from kvd.testing.daemon import start_daemon

SPEC = NamespaceSpec(model_id="device-worker-model", num_layers=3, num_kv_heads=2, head_dim=16, block_tokens=16,
                     kv_dtype=DType.FLOAT32)
BLOCKS = 24
CONFIG = {"host": {"capacity_bytes": 16 << 20, "slot_bytes": 64 << 10}, "device": {"kind": "cpu"}}


class Model:
    """vLLM's side: one [BLOCKS, ...] tensor per layer and the worker it drives."""

    def __init__(self, target: str, spec: NamespaceSpec = SPEC, blocks: int = BLOCKS, **options) -> None:
        self.spec = spec
        self.tensors = {f"layers.{i}.attn": torch.zeros(blocks, spec.layer_bytes // 4) for i in range(spec.num_layers)}
        layout = paged_layout(self.tensors, blocks)
        config = ConnectorConfig(target=target, transfer="daemon", load_timeout_s=10.0, **options)
        self.worker = DeviceWorkerSide(config, layout, local_namespace(spec), 0, list(self.tensors.values()))

    def step(self, metadata: KvdConnectorMetadata, compute: dict[int, np.ndarray] | None = None,
             seen: list | None = None) -> None:
        """One forward: before layer l's attention wait for its loads (recording what the pages then
        hold in `seen`), then write layer l of the computed pages and say so."""
        self.worker.start(metadata)
        staged = []  # what the stream's writes read from, kept until they have landed
        for layer, name in enumerate(self.tensors):
            self.worker.wait_layer(name)
            if seen is not None:
                seen.append(self.tensors[name].clone())
            staged.append(self._write(self.tensors[name], layer, compute or {}))
            self.worker.save_layer(name)
        self.worker.finish_step()
        if self.worker.device is not None:
            self.worker.device.engine_stream().synchronize(timeout_s=20)

    def _write(self, tensor: torch.Tensor, layer: int, compute: dict[int, np.ndarray]) -> np.ndarray | None:
        """Layer `layer` of the computed pages into `tensor`, as the engine's kernels would: on its
        stream, landing later in asynchronous mode (written at once where there is no device)."""
        device = self.worker.device
        if not compute or device is None:
            for page, block in compute.items():
                tensor[page] = torch.from_numpy(block[layer].reshape(-1))
            return None
        rows = np.ascontiguousarray(np.stack([block[layer].reshape(-1) for block in compute.values()]))
        row_bytes = rows.shape[1] * rows.itemsize
        pages = np.asarray(list(compute), dtype=np.uint64) * np.uint64(row_bytes)
        device.engine_stream().copy_blocks(device.wrap(tensor.data_ptr(), tensor.numel() * tensor.element_size()),
                                           pages, device.wrap(rows.ctypes.data, rows.nbytes),
                                           np.arange(len(rows), dtype=np.uint64) * np.uint64(row_bytes), row_bytes)
        return rows

    def page(self, page: int) -> np.ndarray:
        return np.stack([tensor[page].numpy().reshape(self.spec.block_shape[1:]) for tensor in self.tensors.values()])

    def totals(self) -> dict:
        self.worker.counters.take(self.worker.totals)
        return self.worker.totals


def data(count: int, seed: int, spec: NamespaceSpec = SPEC) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, *spec.block_shape), dtype=np.float32)


def keys_for(seed: int, count: int, spec: NamespaceSpec = SPEC) -> list[bytes]:
    return chain_keys(spec, np.arange(count * spec.block_tokens) + seed * 100_000)


@pytest.fixture(params=["synchronous", "asynchronous"])
def daemon(tmp_path, request, monkeypatch):
    env = {}
    if request.param == "asynchronous":
        # The engine's work lands 40 ms after it is issued, kvd's copies 5 ms: a layer's kernels take
        # longer than a copy, so a copy issued ahead of them finishes ahead of them, as on a GPU.
        monkeypatch.setenv(DELAY_ENV, "40")
        env = {DELAY_ENV: "5"}
    process = start_daemon(tmp_path / "kvd", CONFIG, env=env)
    yield process
    if process.alive():
        process.stop()


def test_saves_follow_the_layers_and_loads_land_before_each_layer_runs(daemon):
    model = Model(daemon.unix_target)
    blocks, keys, pages = data(4, 1), keys_for(1, 4), [5, 0, 17, 9]
    model.step(KvdConnectorMetadata(saves=[SaveOrder("a", [keys], [pages])]), compute=dict(zip(pages, blocks)))
    assert model.totals()["saved_blocks"] == 4
    with Client(daemon.unix_target) as client:
        np.testing.assert_array_equal(client.get_numpy(client.register_namespace(SPEC), keys), blocks)

    target, seen = [20, 21, 22, 23], []
    model.step(KvdConnectorMetadata(loads=[LoadOrder("b", [keys], 1, [target[1:]], False)]), seen=seen)
    for layer, tensor in enumerate(seen):  # layer l of the loaded pages was there before its attention
        for page, block in zip(target[1:], blocks[1:]):
            np.testing.assert_array_equal(tensor[page].numpy(), block[layer].reshape(-1))
    assert not model.page(target[0]).any()  # position 0 was not asked for
    totals = model.totals()
    assert totals["loaded_blocks"] == 3 and totals["load_errors"] == 0
    assert daemon.metric_samples("kvd_device_blocks_total") == {
        'kvd_device_blocks_total{op="save"}': 4.0, 'kvd_device_blocks_total{op="load"}': 3.0}
    model.worker.close()
    assert daemon.metric("kvd_device_pools") == 0


def test_a_request_that_loads_and_saves_in_one_step_stores_what_its_forward_wrote(daemon):
    """Its saves wait for its load and go after the forward (deferred): the engine's mark that every
    layer is written must land behind the forward's writes, or kvd copies pages still being written."""
    model = Model(daemon.unix_target)
    blocks, keys = data(5, 8), keys_for(8, 5)
    model.step(KvdConnectorMetadata(saves=[SaveOrder("a", [keys[:2]], [[0, 1]])]), compute={0: blocks[0], 1: blocks[1]})
    pages = [10, 11, 12, 13, 14]
    model.step(KvdConnectorMetadata(loads=[LoadOrder("b", [keys], 0, [pages[:2]], False)],
                                    saves=[SaveOrder("b", [keys], [pages])]),
               compute={page: block for page, block in zip(pages[2:], blocks[2:])})
    totals = model.totals()
    assert totals["loaded_blocks"] == 2 and totals["load_errors"] == 0 and totals["saved_blocks"] == 2 + 3  # the first two were there
    with Client(daemon.unix_target) as client:
        np.testing.assert_array_equal(client.get_numpy(client.register_namespace(SPEC), keys), blocks)
    model.worker.close()


def test_more_requests_load_in_one_step_than_a_fixed_64_flag_words_allowed(daemon):
    """Each load in flight takes a flag word of its own: 70 requests hitting the same prefix in one step
    all load (with 64 words, two of them the saves', the last 8 were refused and recomputed)."""
    requests = 70
    model = Model(daemon.unix_target, blocks=requests + 2)
    block, keys = data(1, 9), keys_for(9, 1)
    model.step(KvdConnectorMetadata(saves=[SaveOrder("a", [keys], [[0]])]), compute={0: block[0]})
    pages = range(2, 2 + requests)
    model.step(KvdConnectorMetadata(loads=[LoadOrder(f"r{page}", [keys], 0, [[page]], False) for page in pages]))
    totals = model.totals()
    assert totals["load_errors"] == 0 and totals["loaded_blocks"] == requests
    for page in pages:
        np.testing.assert_array_equal(model.page(page), block[0])
    model.worker.close()


def test_blocks_kvd_lacks_are_reported_and_the_rest_loads(daemon):
    model = Model(daemon.unix_target)
    blocks, keys = data(2, 2), keys_for(2, 4)
    model.step(KvdConnectorMetadata(saves=[SaveOrder("a", [keys[:2]], [[0, 1]])]), compute={0: blocks[0], 1: blocks[1]})
    model.step(KvdConnectorMetadata(loads=[LoadOrder("b", [keys], 0, [[10, 11, 12, 13]], False)]))
    assert model.worker.load_errors() == {12, 13}
    np.testing.assert_array_equal(model.page(10), blocks[0])
    np.testing.assert_array_equal(model.page(11), blocks[1])
    totals = model.totals()
    assert totals["loaded_blocks"] == 2 and totals["load_errors"] == 2
    model.worker.close()


def test_a_daemon_restart_costs_one_step_then_the_pool_is_registered_again(daemon, tmp_path):
    model = Model(daemon.unix_target)
    model.step(KvdConnectorMetadata(saves=[SaveOrder("a", [keys_for(3, 1)], [[0]])]), compute={0: data(1, 3)[0]})
    first_flags = model.worker.device_pool._free_flags  # the first pool's flag memory, freed once it is dropped
    daemon.stop()
    restarted = start_daemon(tmp_path / "kvd", CONFIG)
    try:
        blocks, keys = data(2, 4), keys_for(4, 2)
        for _ in range(2):  # the first save meets a daemon that never heard of the pool
            model.step(KvdConnectorMetadata(saves=[SaveOrder("b", [keys], [[3, 4]])]),
                       compute={3: blocks[0], 4: blocks[1]})
        totals = model.totals()
        assert totals["save_errors"] == 1 and totals["saved_blocks"] == 1 + 2
        gc.collect()
        assert not first_flags.alive, "the lost pool's flag memory was never freed"
        with Client(restarted.unix_target) as client:
            np.testing.assert_array_equal(client.get_numpy(client.register_namespace(SPEC), keys), blocks)
        model.worker.close()
    finally:
        restarted.stop()


def test_a_daemon_without_a_device_plane_costs_misses_and_one_registration_per_retry_interval(tmp_path, caplog):
    daemon = start_daemon(tmp_path / "off", {"host": CONFIG["host"]})  # [device] kind = "off"
    try:
        model = Model(daemon.unix_target)
        keys = keys_for(5, 2)
        for _ in range(3):
            model.step(KvdConnectorMetadata(loads=[LoadOrder("a", [keys], 0, [[1, 2]], False)],
                                            saves=[SaveOrder("b", [keys_for(6, 1)], [[7]])]), compute={7: data(1, 6)[0]})
            assert model.worker.load_errors() == {1, 2}  # reported: vLLM recomputes them
        totals = model.totals()
        assert totals["loaded_blocks"] == 0 and totals["saved_blocks"] == 0
        refused = [record for record in caplog.records if "could not be registered" in record.getMessage()]
        assert len(refused) == 1 and "no device plane" in refused[0].getMessage()  # asked once, not every step
        model.worker.close()
    finally:
        daemon.stop()


# Eight layers, so that a plan has distances to choose from (1 and 3 offload four and two layers); a
# device tier in slots of one layer page, so a plan's host layers free tier memory.
WIDE = NamespaceSpec(model_id="device-worker-planned", num_layers=8, num_kv_heads=2, head_dim=16, block_tokens=16,
                     kv_dtype=DType.FLOAT32)
PLACEMENT = PlacementOptions(budget_bytes=0, layer_s=1e-4, bandwidth_bps=25e9)


def test_planned_saves_leave_the_plans_host_layers_out_of_the_device_tier_and_load_exact(tmp_path):
    """The scheduler side's SavePlanner asks the daemon's PlanPlacement for the step's saves within a
    budget below what they take with every layer on the GPU; the worker's SaveLayers carry the
    distances; the device tier keeps only the layers the plan keeps on the GPU, and a load (from the
    tier and, for the plan's host layers, from host memory) is bit-exact."""
    config = {"host": CONFIG["host"], "device": {"kind": "cpu", "tier_bytes": 256 * WIDE.layer_bytes,
                                                 "tier_slot_bytes": WIDE.layer_bytes}}
    daemon = start_daemon(tmp_path / "kvd", config)
    try:
        sizes = (2, 3, 5)
        full = sum(sizes) * WIDE.num_layers * WIDE.layer_bytes
        options = dataclasses.replace(PLACEMENT, budget_bytes=int(full * 0.8))
        model = Model(daemon.unix_target, WIDE, placement=options)
        blocks = [data(count, 60 + index, WIDE) for index, count in enumerate(sizes)]
        keys = [keys_for(60 + index, count, WIDE) for index, count in enumerate(sizes)]
        pages = np.split(np.arange(sum(sizes)), np.cumsum(sizes)[:-1])
        saves = [SaveOrder(f"r{index}", [keys[index]], [pages[index].tolist()]) for index in range(len(sizes))]
        with Client(daemon.unix_target) as client:
            SavePlanner(client, options).place(saves, WIDE.num_layers, WIDE.layer_bytes, WIDE.block_tokens)
        distances = [order.distance for order in saves]
        assert set(distances) <= set(distance_options(WIDE.num_layers)) and any(d != NONE for d in distances)
        batch = Batch((PLACEMENT.layer_s,) * WIDE.num_layers, tuple(c * WIDE.layer_bytes for c in sizes),
                      PLACEMENT.bandwidth_bps)
        assert gpu_bytes(batch, distances) <= options.budget_bytes < gpu_bytes(batch, [NONE] * len(sizes))

        compute = {int(page): block for index in range(len(sizes)) for page, block in zip(pages[index], blocks[index])}
        model.step(KvdConnectorMetadata(saves=saves), compute=compute)
        host_layers = sum(count * offloaded_count(d, WIDE.num_layers) for count, d in zip(sizes, distances))
        assert daemon.metric("kvd_device_tier_host_layers_total") == host_layers
        assert daemon.metric("kvd_device_tier_used_slots") == sum(sizes) * WIDE.num_layers - host_layers

        target = [BLOCKS - 1 - page for page in range(sizes[2])]
        model.step(KvdConnectorMetadata(loads=[LoadOrder("again", [keys[2]], 0, [target], False)]))
        for page, block in zip(target, blocks[2]):
            np.testing.assert_array_equal(model.page(page), block)
        model.worker.close()
    finally:
        daemon.stop()


def test_without_a_plan_the_saves_keep_every_layer(tmp_path):
    """A step whose plan cannot be had (the daemon is gone) leaves every save at distance -1."""
    daemon = start_daemon(tmp_path / "kvd", CONFIG)
    target = daemon.unix_target
    daemon.stop()
    saves = [SaveOrder("a", [keys_for(70, 2, WIDE)], [[0, 1]])]
    with Client(target, timeout_s=2.0) as client:
        SavePlanner(client, dataclasses.replace(PLACEMENT, budget_bytes=1)).place(
            saves, WIDE.num_layers, WIDE.layer_bytes, WIDE.block_tokens)
    assert saves[0].distance == NONE
