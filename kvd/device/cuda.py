"""The CUDA device: the device interface (kvd.device.api) on cuda-python's runtime and driver bindings.

Why cuda-python and not a C/CUDA extension of kvd's own: every call here is
per batch or per layer (one cudaMemcpyBatchAsync for a layer's block list,
one cuStreamWriteValue64 per layer), so a Python call's few microseconds do
not matter, and the bindings load libcuda at run time, so this module
imports on machines without a driver and fails there with a precise
NoDevice. The GPU-initiated I/O ring, where the GPU itself works per block,
is native code (native/), not this.

- Memory: cudaMalloc; IPC: cudaIpcGetMemHandle / cudaIpcOpenMemHandle
  (lazy peer access), opened once per handle per process, counted.
- Streams: non-blocking; `copy_blocks` is one cudaMemcpyBatchAsync (stream
  order for the sources); host memory takes part once registered
  (`register_host`, cudaHostRegister portable and mapped: with unified
  addressing its device pointer is its host address).
- Flag words: cuStreamWriteValue64 and cuStreamWaitValue64 (GEQ).
- Events: cudaEventDisableTiming; a timed wait polls cudaEventQuery.

This module has never run on a GPU: none of kvd's build, test or CI
machines has one (see `make gpu-check`). Without a driver every runtime call
returns cudaErrorInsufficientDriver (35), and on a host whose driver sees
no GPU cudaErrorNoDevice (100); both are NoDevice here.
"""

from __future__ import annotations

import os
import threading
import time
import uuid as uuid_module

from kvd.device.api import (Device, DeviceError, Event, IpcHandle, Memory, NoDevice, Stream, copy_addresses,
                            flag_address)

NO_DEVICE_ERRORS = (35, 100)  # cudaErrorInsufficientDriver, cudaErrorNoDevice
_NOT_READY = 600  # cudaErrorNotReady
_POLL_MAX_S = 0.001


def _bindings():
    try:
        from cuda.bindings import driver, runtime
    except ImportError as error:
        raise NoDevice(f"cuda-bindings is not installed ({error})") from None
    return runtime, driver


def _check(result, what: str):
    """The values after a cuda-python call's error code; DeviceError (or NoDevice) when it failed."""
    error, *values = result if isinstance(result, tuple) else (result,)
    number = int(error)
    if number:
        kind = NoDevice if number in NO_DEVICE_ERRORS else DeviceError
        raise kind(f"{what} failed: {getattr(error, 'name', error)} ({number})", number)
    return values[0] if len(values) == 1 else tuple(values)


class CudaEvent(Event):
    def __init__(self, device: CudaDevice, stream) -> None:
        rt = device.runtime
        self.device = device
        self.handle = _check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")
        _check(rt.cudaEventRecord(self.handle, stream), "cudaEventRecord")

    def query(self) -> bool:
        error = self.device.runtime.cudaEventQuery(self.handle)[0]
        if int(error) == _NOT_READY:
            return False
        _check((error,), "cudaEventQuery")
        return True

    def synchronize(self, timeout_s: float | None = None) -> None:
        if timeout_s is None:
            _check(self.device.runtime.cudaEventSynchronize(self.handle), "cudaEventSynchronize")
            return
        deadline, pause = time.monotonic() + timeout_s, 1e-5
        while not self.query():
            if time.monotonic() > deadline:
                raise DeviceError(f"the stream did not reach this event within {timeout_s} s")
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def __del__(self) -> None:
        try:
            self.device.runtime.cudaEventDestroy(self.handle)
        except Exception:
            pass


class CudaStream(Stream):
    def __init__(self, device: CudaDevice) -> None:
        rt = device.runtime
        self.device = device
        device.make_current()
        self.handle = _check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
        self._driver_stream = device.driver.CUstream(int(self.handle))
        attributes = rt.cudaMemcpyAttributes()
        attributes.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        self._attributes = [attributes]

    def copy_blocks(self, dst: Memory, dst_offsets, src: Memory, src_offsets, nbytes: int) -> None:
        addresses = copy_addresses(dst, dst_offsets, src, src_offsets, nbytes)
        if addresses is None:
            return
        targets, sources = (array.tolist() for array in addresses)
        self.device.make_current()
        count = len(targets)
        _check(self.device.runtime.cudaMemcpyBatchAsync(targets, sources, [nbytes] * count, count,
                                                        self._attributes, [0], 1, self.handle),
               "cudaMemcpyBatchAsync")

    def write_flag(self, flags: Memory, index: int, value: int) -> None:
        address = flag_address(flags, index)
        _check(self.device.driver.cuStreamWriteValue64(self._driver_stream, address, value, 0), "cuStreamWriteValue64")

    def wait_flag(self, flags: Memory, index: int, value: int) -> None:
        driver = self.device.driver
        geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        _check(driver.cuStreamWaitValue64(self._driver_stream, flag_address(flags, index), value, geq),
               "cuStreamWaitValue64")

    def record(self) -> CudaEvent:
        self.device.make_current()
        return CudaEvent(self.device, self.handle)

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise DeviceError("an event of another kind of device")
        _check(self.device.runtime.cudaStreamWaitEvent(self.handle, event.handle, 0), "cudaStreamWaitEvent")

    def close(self) -> None:
        if self.handle is not None:
            rt = self.device.runtime
            _check(rt.cudaStreamSynchronize(self.handle), "cudaStreamSynchronize")
            _check(rt.cudaStreamDestroy(self.handle), "cudaStreamDestroy")
            self.handle = None


class CudaDevice(Device):
    kind = "cuda"

    def __init__(self, index: int = 0) -> None:
        self.runtime, self.driver = _bindings()
        count = _check(self.runtime.cudaGetDeviceCount(), "cudaGetDeviceCount")
        if not 0 <= index < count:
            raise NoDevice(f"CUDA device {index} of {count}")
        self.index = index
        self.make_current()
        try:
            _check(self.driver.cuInit(0), "cuInit")
        except RuntimeError as error:  # the bindings found no libcuda
            raise NoDevice(f"the CUDA driver library is not loadable: {error}") from None
        properties = _check(self.runtime.cudaGetDeviceProperties(index), "cudaGetDeviceProperties")
        self.uuid = str(uuid_module.UUID(bytes=bytes(properties.uuid.bytes)))
        self._allocations: set[int] = set()
        self._registered: set[int] = set()
        self._opened: dict[bytes, list] = {}  # handle bytes -> [base address, references]
        self._lock = threading.Lock()

    def make_current(self) -> None:
        """The runtime's device is per thread: every entry point sets it."""
        _check(self.runtime.cudaSetDevice(self.index), "cudaSetDevice")

    def alloc(self, nbytes: int) -> Memory:
        if nbytes <= 0:
            raise DeviceError(f"cannot allocate {nbytes} bytes")
        self.make_current()
        address = int(_check(self.runtime.cudaMalloc(nbytes), "cudaMalloc"))
        self._allocations.add(address)
        return Memory(address, nbytes, self.uuid, token="alloc")

    def free(self, memory: Memory) -> None:
        if memory.address not in self._allocations:
            raise DeviceError(f"no allocation of this device at {memory.address:#x}")
        self.make_current()
        _check(self.runtime.cudaFree(memory.address), "cudaFree")
        self._allocations.discard(memory.address)

    def register_host(self, address: int, nbytes: int) -> Memory:
        rt = self.runtime
        self.make_current()
        _check(rt.cudaHostRegister(address, nbytes, rt.cudaHostRegisterPortable | rt.cudaHostRegisterMapped),
               "cudaHostRegister")
        self._registered.add(address)
        return Memory(address, nbytes, self.uuid, token="host")

    def unregister_host(self, memory: Memory) -> None:
        if memory.address not in self._registered:
            raise DeviceError(f"no host registration at {memory.address:#x}")
        _check(self.runtime.cudaHostUnregister(memory.address), "cudaHostUnregister")
        self._registered.discard(memory.address)

    def wrap(self, address: int, nbytes: int) -> Memory:
        """A range of an allocation this process's framework made (a torch tensor): its export is the
        allocation's IPC handle with the range's offset in it (cuMemGetAddressRange finds the base)."""
        self.make_current()
        base, size = _check(self.driver.cuMemGetAddressRange(address), "cuMemGetAddressRange")
        base, size = int(base), int(size)
        if not base <= address or address + nbytes > base + size:
            raise DeviceError(f"[{address:#x}, +{nbytes}) is not inside one allocation")
        return Memory(address, nbytes, self.uuid, token=("wrapped", base))

    def export(self, memory: Memory, offset: int = 0, nbytes: int | None = None) -> IpcHandle:
        if isinstance(memory.token, tuple) and memory.token[0] == "wrapped":
            base = memory.token[1]
            handle = _check(self.runtime.cudaIpcGetMemHandle(base), "cudaIpcGetMemHandle")
            nbytes = memory.nbytes - offset if nbytes is None else nbytes
            return IpcHandle(self.kind, self.uuid, bytes(handle.reserved), memory.address - base + offset, nbytes)
        if memory.address not in self._allocations:
            raise DeviceError("only memory this process allocated can be exported")
        nbytes = memory.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or nbytes <= 0 or offset + nbytes > memory.nbytes:
            raise DeviceError(f"[{offset}, {offset + nbytes}) is outside the {memory.nbytes}-byte allocation")
        self.make_current()
        handle = _check(self.runtime.cudaIpcGetMemHandle(memory.address), "cudaIpcGetMemHandle")
        return IpcHandle(self.kind, self.uuid, bytes(handle.reserved), offset, nbytes)

    def open(self, handle: IpcHandle) -> Memory:
        self.check_handle(handle)
        with self._lock:
            entry = self._opened.get(handle.handle)
            if entry is None:
                raw = self.runtime.cudaIpcMemHandle_t()
                raw.reserved = handle.handle
                self.make_current()
                base = int(_check(self.runtime.cudaIpcOpenMemHandle(raw, self.runtime.cudaIpcMemLazyEnablePeerAccess),
                                  "cudaIpcOpenMemHandle"))
                entry = self._opened[handle.handle] = [base, 0]
            entry[1] += 1
        return Memory(entry[0] + handle.offset, handle.nbytes, self.uuid, token=handle.handle)

    def close(self, memory: Memory) -> None:
        if isinstance(memory.token, tuple) and memory.token[0] == "vmm":
            self._close_vmm(memory.token)
            return
        with self._lock:
            entry = self._opened.get(memory.token) if isinstance(memory.token, bytes) else None
            if entry is None:
                raise DeviceError("this memory was not opened from an IPC handle")
            entry[1] -= 1
            if entry[1]:
                return
            del self._opened[memory.token]
        self.make_current()
        _check(self.runtime.cudaIpcCloseMemHandle(entry[0]), "cudaIpcCloseMemHandle")

    def export_fd(self, memory: Memory) -> int:
        raise DeviceError("memory from cudaMalloc has no file descriptor export: an engine with a VMM pool "
                          "(cuMemCreate, PyTorch's expandable segments) exports it with cuMemExportToShareableHandle")

    def import_fd(self, fd: int, offset: int, nbytes: int) -> Memory:
        """A VMM allocation exported as a POSIX file descriptor: imported, mapped at a reserved range
        rounded up to the allocation granularity, and made readable and writable by this device."""
        drv = self.driver
        try:
            self.make_current()
            handle = _check(drv.cuMemImportFromShareableHandle(
                fd, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
                "cuMemImportFromShareableHandle")
        finally:
            os.close(fd)  # the driver holds its own reference now
        properties = _check(drv.cuMemGetAllocationPropertiesFromHandle(handle), "cuMemGetAllocationPropertiesFromHandle")
        granularity = _check(drv.cuMemGetAllocationGranularity(
            properties, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity")
        size = -(-(offset + nbytes) // granularity) * granularity
        address = int(_check(drv.cuMemAddressReserve(size, 0, 0, 0), "cuMemAddressReserve"))
        _check(drv.cuMemMap(address, size, 0, handle, 0), "cuMemMap")
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check(drv.cuMemSetAccess(address, size, [access], 1), "cuMemSetAccess")
        return Memory(address + offset, nbytes, self.uuid, token=("vmm", address, size, handle))

    def _close_vmm(self, token) -> None:
        _, address, size, handle = token
        drv = self.driver
        self.make_current()
        _check(drv.cuMemUnmap(address, size), "cuMemUnmap")
        _check(drv.cuMemAddressFree(address, size), "cuMemAddressFree")
        _check(drv.cuMemRelease(handle), "cuMemRelease")

    def stream(self) -> CudaStream:
        return CudaStream(self)
