"""The I/O ring with its real producer: the kernels `make cuda` builds into a fatbin, launched on a GPU,
publish a layer's reads and wait for them while kvd's proxy reads real files into device memory.
On a machine without a GPU (every kvd machine so far) the fatbin is still built and checked, and the
producer refuses the CPU device precisely; under `make gpu-check` the restore runs."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from crc32c import crc32c

from kvd.device import NoDevice
from kvd.device.cuda_ring import GpuRingProducer, LayerPlan
from kvd.device.io_ring import RingMemory, start_proxy
from tests.device.staging import Staging

FATBIN_MAGIC = bytes.fromhex("50ed55ba")
LAYERS, READS_PER_LAYER, READ_BYTES = 4, 64, 64 << 10


def _fatbin() -> str:
    path = os.environ.get("KVD_IO_RING_FATBIN")
    if not path:
        pytest.fail("KVD_IO_RING_FATBIN is not set: `make test` builds the fatbin (make cuda) and sets it")
    return path


def test_the_kernels_are_built_into_a_fatbin_for_sm80_and_sm90():
    data = Path(_fatbin()).read_bytes()
    assert data[:4] == FATBIN_MAGIC
    assert b"kvd_io_ring_submit_layer" in data and b"kvd_io_ring_wait_layer" in data


def test_the_gpu_producer_restores_real_files_into_device_memory(device, tmp_path):
    if device.kind != "cuda":
        with pytest.raises(NoDevice, match="CUDA device"):
            GpuRingProducer(device, _fatbin())
        return
    _restore_on_gpu(device, tmp_path)


def _restore_on_gpu(device, tmp_path) -> None:
    data = os.urandom(8 << 20)
    path = tmp_path / "blocks"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    count = LAYERS * READS_PER_LAYER
    offsets = np.random.default_rng(3).choice(len(data) // READ_BYTES, count, replace=False) * READ_BYTES
    target = device.alloc(count * READ_BYTES)
    stream = device.stream()
    staging = Staging(device, count * READ_BYTES)
    ring = RingMemory(str(tmp_path / "ring"), 64, LAYERS)
    proxy = start_proxy(device, ring, [fd], [target], staging_bytes=8 << 20)
    producer = GpuRingProducer(device, _fatbin())
    try:
        on_gpu = producer.map_ring(ring)
        plans = [_plan(device, stream, data, offsets, target, layer) for layer in range(LAYERS)]
        for layer, plan in enumerate(plans):
            producer.submit_layer(stream, on_gpu, plan, layer)
            producer.wait_layer(stream, on_gpu, layer, READS_PER_LAYER)
        stream.synchronize(timeout_s=60)
        landed = staging.get(stream, target, 0, count * READ_BYTES)
        for i, offset in enumerate(offsets):
            assert landed[i * READ_BYTES:(i + 1) * READ_BYTES].tobytes() == data[offset:offset + READ_BYTES], i
        assert all(ring.failed(layer) == 0 for layer in range(LAYERS))
    finally:
        proxy.stop()
        producer.close()
        os.close(fd)


def _plan(device, stream, data: bytes, offsets, target, layer: int) -> LayerPlan:
    """One layer's reads in device memory (read i of the layer is read layer * READS_PER_LAYER + i
    overall, landing at that index of `target`)."""
    reads = np.arange(layer * READS_PER_LAYER, (layer + 1) * READS_PER_LAYER)
    return LayerPlan.upload(device, stream, np.zeros(READS_PER_LAYER), offsets[reads],
                            np.full(READS_PER_LAYER, READ_BYTES), target.address + reads * READ_BYTES,
                            [crc32c(data[o:o + READ_BYTES]) for o in offsets[reads]])
