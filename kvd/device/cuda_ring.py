"""The GPU side of the I/O ring on a real GPU: the kernels of native/gpu/io_ring_kernel.cu, loaded from
the fatbin `make cuda` builds (build/cuda/io_ring_kernel.fatbin) and launched on a stream.

    producer = GpuRingProducer(device, fatbin)         # NoDevice without a GPU
    ring_on_gpu = producer.map_ring(ring)              # the ring's host memory, mapped for the GPU
    producer.submit_layer(stream, ring_on_gpu, plan, layer)    # the GPU publishes the layer's reads
    producer.wait_layer(stream, ring_on_gpu, layer, count)     # the stream waits for their completions

`plan` holds device arrays of the layer's files, offsets, lengths, targets and crc32c values, filled
once per request. kvd's RingProxy (kvd.device.io_ring) serves the reads. Never run: none of kvd's
machines has had a GPU (make gpu-check runs it where one is).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np

from kvd.device.api import Memory, NoDevice
from kvd.device.cuda import _check
from kvd.device.io_ring import RingMemory

THREADS_PER_BLOCK = 256


@dataclass(frozen=True, slots=True)
class LayerPlan:
    """Device arrays describing one layer's reads (uint64 each, but checksums uint32)."""

    files: Memory
    offsets: Memory
    lengths: Memory
    targets: Memory
    checksums: Memory
    count: int

    @classmethod
    def upload(cls, device, stream, files, offsets, lengths, targets, checksums) -> LayerPlan:
        """A layer's reads (host arrays, one entry per read) copied into device arrays the kernel reads."""
        columns = {"files": np.asarray(files, dtype=np.uint64), "offsets": np.asarray(offsets, dtype=np.uint64),
                   "lengths": np.asarray(lengths, dtype=np.uint64), "targets": np.asarray(targets, dtype=np.uint64),
                   "checksums": np.asarray(checksums, dtype=np.uint32)}
        arrays = {}
        for name, column in columns.items():
            column = np.ascontiguousarray(column)
            arrays[name] = device.alloc(column.nbytes)
            host = device.register_host(column.ctypes.data, column.nbytes)
            stream.copy_blocks(arrays[name], [0], host, [0], column.nbytes)
            stream.synchronize()
            device.unregister_host(host)
        return cls(count=len(columns["files"]), **arrays)


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
        self._mapped: list[int] = []

    def map_ring(self, ring: RingMemory) -> int:
        """The ring's host memory registered mapped (and portable); its address as the GPU sees it."""
        rt = self.device.runtime
        address = ctypes.addressof(ctypes.c_char.from_buffer(ring.buffer))
        self.device.make_current()
        _check(rt.cudaHostRegister(address, len(ring.buffer), rt.cudaHostRegisterMapped |
                                       rt.cudaHostRegisterPortable), "cudaHostRegister")
        self._mapped.append(address)
        return int(_check(rt.cudaHostGetDevicePointer(address, 0), "cudaHostGetDevicePointer"))

    def submit_layer(self, stream, ring: int, plan: LayerPlan, layer: int) -> None:
        blocks = max(1, -(-plan.count // THREADS_PER_BLOCK))
        args = [ring, plan.files.address, plan.offsets.address, plan.lengths.address, plan.targets.address,
                plan.checksums.address, layer, plan.count]
        self._launch(self._submit, stream, blocks, THREADS_PER_BLOCK, args)

    def wait_layer(self, stream, ring: int, layer: int, until: int) -> None:
        self._launch(self._wait, stream, 1, 1, [ring, layer, until])

    def _launch(self, function, stream, blocks: int, threads: int, args: list[int]) -> None:
        values = [np.array([value], dtype=np.uint64) for value in args]  # every parameter is 64-bit
        pointers = np.array([value.ctypes.data for value in values], dtype=np.uint64)
        driver = self.device.driver
        self.device.make_current()
        _check(driver.cuLaunchKernel(function, blocks, 1, 1, threads, 1, 1, 0,
                                             driver.CUstream(int(stream.handle)), pointers.ctypes.data, 0),
               "cuLaunchKernel")

    def close(self) -> None:
        rt = self.device.runtime
        for address in self._mapped:
            _check(rt.cudaHostUnregister(address), "cudaHostUnregister")
        self._mapped.clear()
        _check(self.device.driver.cuModuleUnload(self._module), "cuModuleUnload")

