"""The GPU side of the I/O ring on a real GPU: the kernels of native/gpu/io_ring_kernel.cu, loaded from
the fatbin `make cuda` builds (build/cuda/io_ring_kernel.fatbin) and launched on a stream.

    producer = GpuRingProducer(device, fatbin)         # NoDevice without a GPU
    mapped = producer.map_ring(ring)                   # the ring's host memory, mapped for the GPU
    producer.submit_layer(stream, mapped, plan, layer, timeout_s=1.0)   # the GPU publishes the layer's reads
    wait = producer.wait_layer(stream, mapped, layer, until, timeout_s=1.0)  # the stream waits, bounded
    ...                                                # attention for the layer, on the same stream
    result = wait.result()                             # WaitResult: PENDING until the wait kernel ended

Neither kernel hangs the stream: a submit whose reads cannot be published in time abandons them (the
wait then ends FAILED), and a wait ends TIMEOUT at its deadline. The wait kernel writes how it ended
into one of the ring's wait records, in host-mapped memory, so the host learns it from `result()`
without synchronizing the stream; an engine uses the layer when it is OK and recomputes it otherwise
(after a FAILED or TIMEOUT wait, reads of the layer may still land: `RingMemory.settle` says when they
no longer can).

`plan` holds device arrays of the layer's files, offsets, lengths, targets and crc32c values, filled
once per request. kvd's RingProxy (kvd.device.io_ring) serves the reads, and only those it granted:
`plan_reads` gives a plan's reads as Proxy.grant takes them. Run on an NVIDIA H200 by the device
check (tests/device/test_ring_gpu.py, bench/bench_gpu.py).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field

import numpy as np

from kvd.device.api import DeviceError, Memory, NoDevice
from kvd.device.cuda import _check
from kvd.device.io_ring import IO_RING_WAITS, RingMemory, WaitResult, WaitState

THREADS_PER_BLOCK = 256
PLAN_COLUMNS = (("files", np.uint64), ("offsets", np.uint64), ("lengths", np.uint64), ("targets", np.uint64),
                ("checksums", np.uint32))


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """Device arrays describing one layer's reads (uint64 each, but checksums uint32)."""

    files: Memory
    offsets: Memory
    lengths: Memory
    targets: Memory
    checksums: Memory
    count: int
    first_tag: int = 0  # read i is published under tag first_tag + i: its grant in the daemon's proxy

    @classmethod
    def upload(cls, device, stream, files, offsets, lengths, targets, checksums, first_tag: int = 0) -> LayerPlan:
        """A layer's reads (host arrays, one entry per read) copied into device arrays the kernel reads.
        The host columns are registered for the copies and stay referenced here until the stream has
        finished them (one synchronize for all five), then unregistered."""
        given = (files, offsets, lengths, targets, checksums)
        columns = [np.ascontiguousarray(values, dtype=dtype) for values, (_, dtype) in zip(given, PLAN_COLUMNS)]
        count = len(columns[0])
        if count == 0 or any(column.shape != (count,) for column in columns):
            raise ValueError(f"a layer plan needs 1 or more reads and five columns of equal length, not "
                             f"{[column.shape for column in columns]}")
        arrays, registered = [], []
        try:
            for column in columns:
                arrays.append(device.alloc(column.nbytes))
                registered.append(device.register_host(column.ctypes.data, column.nbytes))
                stream.copy_blocks(arrays[-1], [0], registered[-1], [0], column.nbytes)
            stream.synchronize()  # `columns` is alive until here: the copies read it
        except BaseException:
            for memory in arrays:
                device.free(memory)
            raise
        finally:
            for memory in registered:
                device.unregister_host(memory)
        return cls(*arrays, count=count, first_tag=first_tag)

    def free(self, device) -> None:
        for memory in (self.files, self.offsets, self.lengths, self.targets, self.checksums):
            device.free(memory)


def plan_reads(layer: int, first_tag: int, files, offsets, lengths, targets, checksums) -> np.ndarray:
    """The reads the submit kernel publishes for one layer's plan (the host columns LayerPlan.upload
    took): rows of READ_FIELDS, read i under tag first_tag + i, as a proxy must grant them before they
    can be read (Proxy.grant)."""
    count = len(offsets)
    columns = (files, offsets, lengths, targets, np.full(count, layer), checksums,
               first_tag + np.arange(count))
    return np.stack([np.asarray(column, dtype=np.uint64) for column in columns], axis=1)


@dataclass(slots=True)
class MappedRing:
    """A ring's host memory as the GPU sees it (`address`), and the wait records handed out on it."""

    memory: RingMemory
    address: int
    host_address: int
    next_slot: int = 0
    handed_out: set[int] = field(default_factory=set)

    def take_slot(self) -> int:
        """The next wait record, armed (PENDING); DeviceError when every record is still pending
        (more waits in flight than the ring has records)."""
        slot = self.next_slot
        if slot in self.handed_out and self.memory.record(slot).state is WaitState.PENDING:
            raise DeviceError(f"all {IO_RING_WAITS} wait records of the ring are pending")
        self.next_slot = (slot + 1) % IO_RING_WAITS
        self.handed_out.add(slot)
        self.memory.arm(slot)
        return slot


@dataclass(frozen=True, slots=True)
class RingWait:
    """A wait launched on a stream; how it ended is the ring's wait record `slot`."""

    ring: MappedRing
    slot: int
    layer: int
    until: int

    def result(self) -> WaitResult:
        """The record as the wait kernel left it: state PENDING while the kernel has not ended (it
        never is once the stream has passed the wait, e.g. after an event recorded behind it)."""
        return self.ring.memory.record(self.slot)


class GpuRingProducer:
    def __init__(self, device, fatbin: str) -> None:
        if getattr(device, "kind", None) != "cuda":
            raise NoDevice("the ring's kernels run on a CUDA device")
        self.device = device
        driver = device.driver
        device.make_current()
        module = _check(driver.cuModuleLoad(fatbin.encode()), f"cuModuleLoad({fatbin})")
        self._submit = _check(driver.cuModuleGetFunction(module, b"kvd_io_ring_submit_layer"),
                              "cuModuleGetFunction")
        self._wait = _check(driver.cuModuleGetFunction(module, b"kvd_io_ring_wait_layer"),
                            "cuModuleGetFunction")
        self._module = module
        self._mapped: list[MappedRing] = []

    def map_ring(self, ring: RingMemory) -> MappedRing:
        """The ring's host memory registered mapped (and portable) for the GPU."""
        rt = self.device.runtime
        address = ctypes.addressof(ctypes.c_char.from_buffer(ring.buffer))
        self.device.make_current()
        _check(rt.cudaHostRegister(address, len(ring.buffer), rt.cudaHostRegisterMapped |
                                       rt.cudaHostRegisterPortable), "cudaHostRegister")
        self.device.make_current()
        on_gpu = int(_check(rt.cudaHostGetDevicePointer(address, 0), "cudaHostGetDevicePointer"))
        mapped = MappedRing(ring, on_gpu, address)
        self._mapped.append(mapped)
        return mapped

    def submit_layer(self, stream, ring: MappedRing, plan: LayerPlan, layer: int, *, timeout_s: float) -> None:
        """The GPU publishes the layer's reads; those it cannot publish within `timeout_s` of their
        block's start (nobody drains the ring) are abandoned, and the layer's wait ends FAILED."""
        blocks = max(1, -(-plan.count // THREADS_PER_BLOCK))
        args = [ring.address, plan.files.address, plan.offsets.address, plan.lengths.address, plan.targets.address,
                plan.checksums.address, layer, plan.count, _nanoseconds(timeout_s), plan.first_tag]
        self._launch(self._submit, stream, blocks, THREADS_PER_BLOCK, args)

    def wait_layer(self, stream, ring: MappedRing, layer: int, until: int, *, timeout_s: float,
                   failed_before: int = 0) -> RingWait:
        """The stream waits until `until` reads of the layer are done (the layer's count since the ring
        was laid out), one fails past `failed_before`, or `timeout_s` passes; then it goes on either way.
        How it ended: the returned RingWait's result()."""
        slot = ring.take_slot()
        record = ring.address + RingMemory.record_offset(slot)
        self._launch(self._wait, stream, 1, 1, [ring.address, layer, until, failed_before, _nanoseconds(timeout_s),
                                                record])
        return RingWait(ring, slot, layer, until)

    def _launch(self, function, stream, blocks: int, threads: int, args: list[int]) -> None:
        values = [np.array([value], dtype=np.uint64) for value in args]  # every parameter is 64-bit
        pointers = np.array([value.ctypes.data for value in values], dtype=np.uint64)
        driver = self.device.driver
        self.device.make_current()
        _check(driver.cuLaunchKernel(function, blocks, 1, 1, threads, 1, 1, 0,
                                             driver.CUstream(int(stream.handle)), pointers.ctypes.data, 0),
               "cuLaunchKernel")  # the driver copies the parameters before it returns

    def close(self) -> None:
        rt = self.device.runtime
        for mapped in self._mapped:
            self.device.make_current()
            _check(rt.cudaHostUnregister(mapped.host_address), "cudaHostUnregister")
        self._mapped.clear()
        self.device.make_current()
        _check(self.device.driver.cuModuleUnload(self._module), "cuModuleUnload")


def _nanoseconds(timeout_s: float) -> int:
    if not 0 <= timeout_s < 2**63 / 1e9:
        raise ValueError(f"a timeout of {timeout_s} s")
    return int(timeout_s * 1e9)
