"""The I/O ring with its real producer: the kernels `make cuda` builds into a fatbin, launched on a GPU,
publish a layer's reads and wait for them while kvd's proxy reads real files into device memory, and a
wait that cannot succeed (a bad checksum, nobody serving the ring) ends FAILED or TIMEOUT in its record
without hanging the stream. On a machine without a GPU (every kvd machine so far) the fatbin is still
built and checked, and the producer refuses the CPU device precisely; under `make gpu-check` these run."""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

import numpy as np
import pytest
from crc32c import crc32c

from kvd._native import IO_RING_WAITS
from kvd.device import DeviceError, Memory, NoDevice
from kvd.device.cuda import CudaDevice
from kvd.device.cuda_ring import GpuRingProducer, LayerPlan, plan_reads
from kvd.device.io_ring import RingMemory, WaitState, start_proxy
from tests.device.fake_cuda import SUCCESS, FakeCuda
from tests.device.staging import Staging

FATBIN_MAGIC = bytes.fromhex("50ed55ba")
LAYERS, READS_PER_LAYER, READ_BYTES = 4, 64, 64 << 10
TIMEOUT_S = 30


def _fatbin() -> str:
    path = os.environ.get("KVD_IO_RING_FATBIN")
    if not path:
        pytest.fail("KVD_IO_RING_FATBIN is not set: `make test` builds the fatbin (make cuda) and sets it")
    return path


def test_the_kernels_are_built_into_a_fatbin_for_sm80_and_sm90():
    data = Path(_fatbin()).read_bytes()
    assert data[:4] == FATBIN_MAGIC
    assert b"kvd_io_ring_submit_layer" in data and b"kvd_io_ring_wait_layer" in data


@pytest.mark.parametrize("scenario", ["restore", "failures"])
def test_the_gpu_producer_restores_real_files_and_its_waits_never_hang_the_stream(device, tmp_path, scenario):
    if device.kind != "cuda":
        with pytest.raises(NoDevice, match="CUDA device"):
            GpuRingProducer(device, _fatbin())
        return
    (_restore_on_gpu if scenario == "restore" else _failures_on_gpu)(device, tmp_path)


def _blocks(tmp_path, nbytes: int = 8 << 20):
    data = os.urandom(nbytes)
    path = tmp_path / "blocks"
    path.write_bytes(data)
    return data, os.open(path, os.O_RDONLY | os.O_DIRECT)


def _restore_on_gpu(device, tmp_path) -> None:
    count = LAYERS * READS_PER_LAYER
    data, fd = _blocks(tmp_path, 2 * count * READ_BYTES)
    offsets = np.random.default_rng(3).choice(len(data) // READ_BYTES, count, replace=False) * READ_BYTES
    target = device.alloc(count * READ_BYTES)
    stream = device.stream()
    staging = Staging(device, count * READ_BYTES)
    ring = RingMemory(64, LAYERS)
    proxy = start_proxy(device, ring, [fd], [target], staging_bytes=8 << 20)
    producer = GpuRingProducer(device, _fatbin())
    try:
        mapped = producer.map_ring(ring)
        plans = [_plan(device, stream, data, offsets, target, layer, proxy) for layer in range(LAYERS)]
        waits = []
        for layer, plan in enumerate(plans):
            producer.submit_layer(stream, mapped, plan, layer, timeout_s=TIMEOUT_S)
            waits.append(producer.wait_layer(stream, mapped, layer, READS_PER_LAYER, timeout_s=TIMEOUT_S))
        stream.synchronize(timeout_s=2 * TIMEOUT_S)
        assert [(w.result().state, w.result().done) for w in waits] == [(WaitState.OK, READS_PER_LAYER)] * LAYERS
        landed = staging.get(stream, target, 0, count * READ_BYTES)
        for i, offset in enumerate(offsets):
            assert landed[i * READ_BYTES:(i + 1) * READ_BYTES].tobytes() == data[offset:offset + READ_BYTES], i
        assert all(ring.failed(layer) == 0 for layer in range(LAYERS))
    finally:
        proxy.stop()
        producer.close()
        os.close(fd)


def _failures_on_gpu(device, tmp_path) -> None:
    """Layer 0: one read with a wrong checksum (FAILED as soon as the proxy fails it); layer 1: more reads
    than the ring holds with the proxy stopped (abandoned at the submit's deadline: FAILED); layer 2: a
    wait for a read nobody publishes (TIMEOUT). The stream reaches its end every time."""
    data, fd = _blocks(tmp_path)
    offsets = np.arange(8) * READ_BYTES
    target = device.alloc(8 * READ_BYTES)
    stream = device.stream()
    ring = RingMemory(4, 3)
    proxy = start_proxy(device, ring, [fd], [target], staging_bytes=8 << 20)
    producer = GpuRingProducer(device, _fatbin())
    try:
        mapped = producer.map_ring(ring)
        bad = _plan_of(device, stream, data, offsets[:2], target, proxy, wrong_checksums=1)
        producer.submit_layer(stream, mapped, bad, 0, timeout_s=TIMEOUT_S)
        failed = producer.wait_layer(stream, mapped, 0, 2, timeout_s=TIMEOUT_S)
        stream.synchronize(timeout_s=2 * TIMEOUT_S)
        assert failed.result().state is WaitState.FAILED and failed.result().failed == 1
        assert ring.settle(0, 2, timeout_s=TIMEOUT_S).ok
        proxy.stop()
        producer.submit_layer(stream, mapped, _plan_of(device, stream, data, offsets, target), 1, timeout_s=0.2)
        abandoned = producer.wait_layer(stream, mapped, 1, 8, timeout_s=TIMEOUT_S)
        late = producer.wait_layer(stream, mapped, 2, 1, timeout_s=0.2)
        stream.synchronize(timeout_s=TIMEOUT_S)
        assert (abandoned.result().state, ring.abandoned(1)) == (WaitState.FAILED, 4)
        assert late.result().state is WaitState.TIMEOUT and late.result().waited_ns >= 200_000_000
    finally:
        proxy.stop()
        producer.close()
        os.close(fd)


def _plan(device, stream, data: bytes, offsets, target, layer: int, proxy) -> LayerPlan:
    """One layer's reads in device memory, granted by the proxy (read i of the layer is read
    layer * READS_PER_LAYER + i overall, tagged so, landing at that index of `target`)."""
    reads = np.arange(layer * READS_PER_LAYER, (layer + 1) * READS_PER_LAYER)
    columns = (np.zeros(READS_PER_LAYER), offsets[reads], np.full(READS_PER_LAYER, READ_BYTES),
               target.address + reads * READ_BYTES, [crc32c(data[o:o + READ_BYTES]) for o in offsets[reads]])
    return _granted(proxy, layer, int(reads[0]), LayerPlan.upload(device, stream, *columns, first_tag=int(reads[0])),
                    columns)


def _plan_of(device, stream, data: bytes, offsets, target, proxy=None, wrong_checksums: int = 0) -> LayerPlan:
    """Reads of `offsets` into consecutive places of `target` for layer 0, granted by `proxy` if given;
    the first `wrong_checksums` carry a checksum that does not match (and are granted with it: the
    proxy reads them, and their bytes fail the check)."""
    checksums = [crc32c(data[o:o + READ_BYTES]) ^ (n < wrong_checksums) for n, o in enumerate(offsets)]
    places = target.address + np.arange(len(offsets), dtype=np.uint64) * READ_BYTES
    columns = (np.zeros(len(offsets)), offsets, np.full(len(offsets), READ_BYTES), places, checksums)
    plan = LayerPlan.upload(device, stream, *columns)
    return plan if proxy is None else _granted(proxy, 0, 0, plan, columns)


def _granted(proxy, layer: int, first_tag: int, plan: LayerPlan, columns) -> LayerPlan:
    reads = plan_reads(layer, first_tag, *columns)
    proxy.grant(reads, 1 + reads[:, 6])
    return plan


class KernelFakeCuda(FakeCuda):
    """FakeCuda with the module and launch calls the producer makes; a launch records its kernel's
    name, grid, block and 64-bit parameters (read back through the pointers it was given)."""

    PARAMETERS = {b"kvd_io_ring_submit_layer": 10, b"kvd_io_ring_wait_layer": 6}

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[tuple[bytes, int, int, tuple[int, ...]]] = []

    def _driver(self):
        driver = super()._driver()
        driver.cuModuleLoad = lambda path: (SUCCESS, *self._call("cuModuleLoad", "module"))
        driver.cuModuleGetFunction = lambda module, name: (SUCCESS, *self._call("cuModuleGetFunction", name))
        driver.cuModuleUnload = lambda module: (SUCCESS, *self._call("cuModuleUnload"))
        driver.cuLaunchKernel = self._launch
        return driver

    def _launch(self, function, grid, _gy, _gz, block, _by, _bz, _shared, _stream, parameters, _extra):
        self._call("cuLaunchKernel")
        pointers = (ctypes.c_uint64 * self.PARAMETERS[function]).from_address(parameters)
        values = tuple(ctypes.c_uint64.from_address(pointer).value for pointer in pointers)
        self.launches.append((function, grid, block, values))
        return (SUCCESS,)


def test_the_producer_launches_bounded_kernels_and_reads_each_wait_from_its_record(monkeypatch):
    """On a stand-in for cuda-bindings, from threads that never made the device current: the submit
    kernel gets its timeout in nanoseconds, the wait kernel the ring's next wait record (armed PENDING);
    what the kernel would write there (here: the same C wait, run on the host) is what result() says.
    A record is not handed out again while its wait is pending."""
    fake = KernelFakeCuda()
    fake.install(monkeypatch)
    device = CudaDevice(0)
    ring = RingMemory(8, 2)
    producer, stream = GpuRingProducer(device, "io_ring_kernel.fatbin"), device.stream()
    plan = LayerPlan(*(Memory(0x1000 * (n + 1), 8 * 300, device.uuid) for n in range(5)), count=300, first_tag=40)
    waits = []

    def launch() -> None:
        fake.current.device = None  # a thread that has never touched CUDA
        mapped = producer.map_ring(ring)
        producer.submit_layer(stream, mapped, plan, 1, timeout_s=0.25)
        waits.extend(producer.wait_layer(stream, mapped, layer, 3, timeout_s=2, failed_before=layer)
                     for layer in (1, 0))
    thread = threading.Thread(target=launch)
    thread.start()
    thread.join()
    mapped = producer._mapped[0]
    assert mapped.address == ctypes.addressof(ctypes.c_char.from_buffer(ring.buffer)) + (1 << 56)
    submit, first_wait, _ = fake.launches
    assert submit == (b"kvd_io_ring_submit_layer", 2, 256, (mapped.address, 0x1000, 0x2000, 0x3000, 0x4000, 0x5000,
                                                           1, 300, 250_000_000, 40))
    record = mapped.address + RingMemory.record_offset(0)
    assert first_wait == (b"kvd_io_ring_wait_layer", 1, 1, (mapped.address, 1, 3, 1, 2_000_000_000, record))
    assert [(w.slot, w.result().state) for w in waits] == [(0, WaitState.PENDING), (1, WaitState.PENDING)]
    assert ring.wait(1, 3, failed_before=1, timeout_s=0, slot=0).state is WaitState.TIMEOUT  # the kernel's part
    assert waits[0].result().state is WaitState.TIMEOUT and waits[1].result().state is WaitState.PENDING
    mapped.next_slot = 1
    with pytest.raises(DeviceError, match=f"all {IO_RING_WAITS} wait records of the ring are pending"):
        producer.wait_layer(stream, mapped, 0, 3, timeout_s=1)
    fake.current.device = None
    producer.close()
    assert fake.registered == {} and ("cuModuleUnload", ()) in fake.calls
    ring.close()
