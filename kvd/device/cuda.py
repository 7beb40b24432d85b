"""The CUDA device: the device interface (kvd.device.api) on cuda-python's runtime and driver bindings.

Why cuda-python and not a C/CUDA extension of kvd's own: every call here is
per batch or per layer (one cudaMemcpyBatchAsync for a layer's block list,
one cuStreamWriteValue64 per layer), so a Python call's few microseconds do
not matter, and the bindings load libcuda at run time, so this module
imports on machines without a driver and fails there with a precise
NoDevice. The GPU-initiated I/O ring, where the GPU itself works per block,
is native code (native/), not this.

- Memory: cudaMalloc; IPC: cudaIpcGetMemHandle / cudaIpcOpenMemHandle
  (lazy peer access), opened once per handle per process, counted; an
  opened range is checked against the allocation it lies in
  (cuMemGetAddressRange), so a handle whose offset or size overstates it is
  refused instead of faulting the whole context later.
- Streams: non-blocking; `copy_blocks` hands the address arrays to native
  code (kvd._native.cuda_copy_batch: cuMemcpyBatchAsync where the driver has
  it, 12.8 or later, else cuMemcpyAsync in a C loop), so no Python object is
  made per address. Host memory takes part once registered
  (`register_host`: cudaHostRegister portable and mapped, addressed by
  cudaHostGetDevicePointer). An engine's own stream (torch's) is used
  through `engine_stream(handle)` and never destroyed.
- Flag words: cuStreamWriteValue64 and cuStreamWaitValue64 (GEQ), which
  need the device's 64-bit stream memory operations
  (CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS): checked at open.
- Events: cudaEventDisableTiming; a timed wait polls cudaEventQuery.
- The runtime's current device is per thread: every call makes this
  device current first, whichever thread it comes from.

Drivers: cuda-bindings 12.9 runs on drivers of CUDA 12 and 13, 13.x only on
13 (R580) and later (`pip install kvd[cuda]` gets 12.9). A driver older than
the bindings is reported as DriverTooOld, naming both versions.

This module has never run on a GPU: none of kvd's build, test or CI
machines has one (see `make gpu-check` and tools/device_check.sh). Without
a driver every runtime call returns cudaErrorInsufficientDriver (35), and
on a host whose driver sees no GPU cudaErrorNoDevice (100); both are
NoDevice here.
"""

from __future__ import annotations

import importlib.metadata
import os
import threading
import time
import uuid as uuid_module

import numpy as np

from kvd.device.api import (Device, DeviceError, Event, IpcHandle, Memory, NoDevice, Stream, copy_addresses,
                            flag_address)

_INSUFFICIENT_DRIVER = 35  # cudaErrorInsufficientDriver: no driver, or one older than the runtime
NO_DEVICE_ERRORS = (_INSUFFICIENT_DRIVER, 100)  # and cudaErrorNoDevice
_NOT_READY = 600  # cudaErrorNotReady
_POLL_MAX_S = 0.001
_MEM_OPS_64 = 122  # CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS


class DriverTooOld(NoDevice):
    """The CUDA driver is older than the CUDA version the installed cuda-bindings need."""


def _bindings():
    """cuda-bindings' runtime and driver modules, and its version."""
    try:
        from cuda import bindings
        from cuda.bindings import driver, runtime
    except ImportError as error:
        raise NoDevice(f"cuda-bindings is not installed ({error}): pip install 'kvd[cuda]'") from None
    version = getattr(bindings, "__version__", None) or importlib.metadata.version("cuda-bindings")
    return runtime, driver, version


def _version_text(version: int) -> str:
    return f"{version // 1000}.{version % 1000 // 10}"


def check_driver(driver_version: int, bindings_version: str) -> None:
    """NoDevice without a driver, DriverTooOld where it is older than the bindings' CUDA major."""
    if driver_version < 0:
        raise NoDevice("no CUDA driver: libcuda.so.1 does not load on this host", _INSUFFICIENT_DRIVER)
    major = int(bindings_version.split(".")[0])
    if driver_version < major * 1000:
        raise DriverTooOld(f"the CUDA driver supports CUDA {_version_text(driver_version)}, and cuda-bindings "
                           f"{bindings_version} needs a CUDA {major} driver: install cuda-bindings 12.9 "
                           "(pip install 'kvd[cuda]'), which runs on CUDA 12 and 13 drivers, or a newer driver",
                           _INSUFFICIENT_DRIVER)


def _driver_version() -> int:
    from kvd._native import cuda_driver_version

    return cuda_driver_version()


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
        device.make_current()
        self.handle = _check(rt.cudaEventCreateWithFlags(rt.cudaEventDisableTiming), "cudaEventCreateWithFlags")
        _check(rt.cudaEventRecord(self.handle, stream), "cudaEventRecord")

    def query(self) -> bool:
        self.device.make_current()
        error = self.device.runtime.cudaEventQuery(self.handle)[0]
        if int(error) == _NOT_READY:
            return False
        _check((error,), "cudaEventQuery")
        return True

    def synchronize(self, timeout_s: float | None = None) -> None:
        if timeout_s is None:
            self.device.make_current()
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
    """A stream kvd created (`handle` None), or one of the engine's framework that kvd only uses."""

    def __init__(self, device: CudaDevice, handle: int | None = None) -> None:
        rt = device.runtime
        self.device = device
        self.owned = handle is None
        device.make_current()
        if self.owned:
            handle = _check(rt.cudaStreamCreateWithFlags(rt.cudaStreamNonBlocking), "cudaStreamCreateWithFlags")
        self.handle = handle
        self._driver_stream = device.driver.CUstream(int(handle))

    def copy_blocks(self, dst: Memory, dst_offsets, src: Memory, src_offsets, nbytes: int) -> None:
        from kvd._native import cuda_copy_batch

        addresses = copy_addresses(dst, dst_offsets, src, src_offsets, nbytes)
        if addresses is None:
            return
        targets, sources = (np.ascontiguousarray(array, dtype=np.uint64) for array in addresses)
        self.device.make_current()
        result, _ = cuda_copy_batch(int(self.handle), targets, sources, nbytes)
        if result:
            raise DeviceError(f"a batched copy of {len(targets)} x {nbytes} bytes failed: CUresult {result}", result)

    def write_flag(self, flags: Memory, index: int, value: int) -> None:
        address = flag_address(flags, index)
        self.device.require_memory_ops()
        self.device.make_current()
        _check(self.device.driver.cuStreamWriteValue64(self._driver_stream, address, value, 0), "cuStreamWriteValue64")

    def wait_flag(self, flags: Memory, index: int, value: int) -> None:
        driver = self.device.driver
        geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
        self.device.require_memory_ops()
        self.device.make_current()
        _check(driver.cuStreamWaitValue64(self._driver_stream, flag_address(flags, index), value, geq),
               "cuStreamWaitValue64")

    def record(self) -> CudaEvent:
        return CudaEvent(self.device, self.handle)

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise DeviceError("an event of another kind of device")
        self.device.make_current()
        _check(self.device.runtime.cudaStreamWaitEvent(self.handle, event.handle, 0), "cudaStreamWaitEvent")

    def close(self) -> None:
        """Finish what was issued; destroy the stream if kvd created it (never the engine's)."""
        if self.handle is not None:
            rt = self.device.runtime
            self.device.make_current()
            _check(rt.cudaStreamSynchronize(self.handle), "cudaStreamSynchronize")
            if self.owned:
                _check(rt.cudaStreamDestroy(self.handle), "cudaStreamDestroy")
            self.handle = None


class CudaDevice(Device):
    kind = "cuda"

    def __init__(self, index: int = 0) -> None:
        self.runtime, self.driver, version = _bindings()
        check_driver(_driver_version(), version)
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
        handle = _check(self.driver.cuDeviceGet(index), "cuDeviceGet")
        self.memory_ops_64 = bool(_check(self.driver.cuDeviceGetAttribute(
            self.driver.CUdevice_attribute(_MEM_OPS_64), handle), "cuDeviceGetAttribute"))
        self._allocations: set[int] = set()
        self._registered: dict[int, int] = {}  # device address of a host registration -> host address
        self._opened: dict[bytes, list] = {}  # handle bytes -> [base address, references]
        self._lock = threading.Lock()

    def make_current(self) -> None:
        """The runtime's device is per thread: every entry point sets it."""
        _check(self.runtime.cudaSetDevice(self.index), "cudaSetDevice")

    def require_memory_ops(self) -> None:
        if not self.memory_ops_64:
            raise DeviceError(f"CUDA device {self.index} ({self.uuid}) has no 64-bit stream memory operations "
                              "(CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS is 0), which kvd's flag words need")

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
        """Pinned and mapped; the Memory is at the address the device uses for it."""
        rt = self.runtime
        self.make_current()
        _check(rt.cudaHostRegister(address, nbytes, rt.cudaHostRegisterPortable | rt.cudaHostRegisterMapped),
               "cudaHostRegister")
        try:
            device_address = int(_check(rt.cudaHostGetDevicePointer(address, 0), "cudaHostGetDevicePointer"))
        except DeviceError:
            _check(rt.cudaHostUnregister(address), "cudaHostUnregister")
            raise
        self._registered[device_address] = address
        return Memory(device_address, nbytes, self.uuid, token="host")

    def unregister_host(self, memory: Memory) -> None:
        address = self._registered.pop(memory.address, None)
        if address is None:
            raise DeviceError(f"no host registration at {memory.address:#x}")
        self.make_current()
        _check(self.runtime.cudaHostUnregister(address), "cudaHostUnregister")

    def _allocation_of(self, address: int) -> tuple[int, int]:
        """(base, size) of the allocation `address` lies in (cuMemGetAddressRange)."""
        base, size = _check(self.driver.cuMemGetAddressRange(address), "cuMemGetAddressRange")
        return int(base), int(size)

    def wrap(self, address: int, nbytes: int) -> Memory:
        """A range of an allocation this process's framework made (a torch tensor): its export is the
        allocation's IPC handle with the range's offset in it (cuMemGetAddressRange finds the base)."""
        self.make_current()
        base, size = self._allocation_of(address)
        if not base <= address or address + nbytes > base + size:
            raise DeviceError(f"[{address:#x}, +{nbytes}) is not inside one allocation")
        return Memory(address, nbytes, self.uuid, token=("wrapped", base))

    def export(self, memory: Memory, offset: int = 0, nbytes: int | None = None) -> IpcHandle:
        if isinstance(memory.token, tuple) and memory.token[0] == "wrapped":
            base = memory.token[1]
            self.make_current()
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
        try:
            self._check_range(entry[0], handle)
        except DeviceError:
            self.close(Memory(entry[0], 1, self.uuid, token=handle.handle))
            raise
        return Memory(entry[0] + handle.offset, handle.nbytes, self.uuid, token=handle.handle)

    def _check_range(self, base: int, handle: IpcHandle) -> None:
        """The handle's [offset, offset + nbytes) must lie inside the allocation it opened: a copy past
        it would fault this process's whole CUDA context, every engine's pool with it."""
        self.make_current()
        start, size = self._allocation_of(base)
        if handle.offset + handle.nbytes > start + size - base:
            raise DeviceError(f"the IPC handle names [{handle.offset}, {handle.offset + handle.nbytes}) of an "
                              f"allocation of {start + size - base} bytes")

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

    def engine_stream(self, handle: int | None = None) -> CudaStream:
        if handle is None:
            raise DeviceError("a CUDA engine's stream is its framework's: pass its handle "
                              "(torch.cuda.current_stream().cuda_stream)")
        return CudaStream(self, handle)
