"""A stand-in for cuda-bindings' runtime and driver modules, enough to run kvd.device.cuda's own logic
on a machine without a GPU: the checks it makes around each CUDA call, not CUDA.

Every call returns (error, values...) as cuda-bindings does, and each thread must have made the device
current (cudaSetDevice) before its first call that needs it, as the real runtime requires when a
process drives more than one GPU; a call without it raises, naming the call.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

SUCCESS = 0
INVALID_VALUE = 1


class FakeCuda:
    def __init__(self, devices: int = 1, allocation_bytes: int = 1 << 20, memory_ops_64: bool = True) -> None:
        self.devices = devices
        self.allocation_bytes = allocation_bytes
        self.memory_ops_64 = memory_ops_64
        self.current = threading.local()
        self.calls: list[tuple[str, tuple]] = []
        self.opened: dict[int, int] = {}      # base -> references held by the driver
        self.allocations: set[int] = set()    # bases of this process's own allocations (a framework's)
        self.registered: dict[int, int] = {}  # host address -> bytes
        self.next_base = 0x7F00_0000_0000
        self.runtime = self._runtime()
        self.driver = self._driver()

    def _require_current(self, name: str) -> None:
        if getattr(self.current, "device", None) is None:
            raise AssertionError(f"{name} called on thread {threading.current_thread().name} with no device current")

    def _call(self, name: str, *values, needs_device: bool = True):
        self.calls.append((name, values))
        if needs_device:
            self._require_current(name)
        return values

    def _set_device(self, index: int):
        self.current.device = index
        return (SUCCESS,)

    def _ipc_open(self, raw, flags):
        self._call("cudaIpcOpenMemHandle")
        base = self.next_base
        self.next_base += self.allocation_bytes * 2
        self.opened[base] = self.opened.get(base, 0) + 1
        return (SUCCESS, base)

    def _ipc_close(self, base):
        self._call("cudaIpcCloseMemHandle")
        self.opened[base] -= 1
        return (SUCCESS,)

    def _host_register(self, address, nbytes, flags):
        self._call("cudaHostRegister")
        self.registered[address] = nbytes
        return (SUCCESS,)

    def _host_unregister(self, address):
        self._call("cudaHostUnregister")
        if address not in self.registered:
            return (INVALID_VALUE,)
        del self.registered[address]
        return (SUCCESS,)

    def _runtime(self) -> SimpleNamespace:
        def ok(name: str):
            return lambda *args: (SUCCESS, *self._call(name))

        return SimpleNamespace(
            cudaStreamNonBlocking=1, cudaEventDisableTiming=2, cudaHostRegisterPortable=1, cudaHostRegisterMapped=2,
            cudaIpcMemLazyEnablePeerAccess=1,
            cudaGetDeviceCount=lambda: (SUCCESS, self.devices),
            cudaSetDevice=self._set_device,
            cudaGetDeviceProperties=lambda index: (SUCCESS, SimpleNamespace(uuid=SimpleNamespace(
                bytes=bytes([index + 1] * 16)))),
            cudaStreamCreateWithFlags=lambda flags: (SUCCESS, *self._call("cudaStreamCreateWithFlags", 0x5000)),
            cudaStreamSynchronize=ok("cudaStreamSynchronize"),
            cudaStreamDestroy=ok("cudaStreamDestroy"),
            cudaStreamWaitEvent=ok("cudaStreamWaitEvent"),
            cudaEventCreateWithFlags=lambda flags: (SUCCESS, *self._call("cudaEventCreateWithFlags", 0x6000)),
            cudaEventRecord=ok("cudaEventRecord"),
            cudaEventQuery=ok("cudaEventQuery"),
            cudaEventSynchronize=ok("cudaEventSynchronize"),
            cudaEventDestroy=lambda handle: (SUCCESS,),
            cudaIpcMemHandle_t=lambda: SimpleNamespace(reserved=b""),
            cudaIpcGetMemHandle=lambda address: (SUCCESS, *self._call("cudaIpcGetMemHandle",
                                                                      SimpleNamespace(reserved=b"\x07" * 64))),
            cudaIpcOpenMemHandle=self._ipc_open,
            cudaIpcCloseMemHandle=self._ipc_close,
            cudaHostRegister=self._host_register,
            cudaHostUnregister=self._host_unregister,
            cudaHostGetDevicePointer=lambda address, flags: (SUCCESS, *self._call("cudaHostGetDevicePointer",
                                                                                  address + (1 << 56))),
        )

    def _driver(self) -> SimpleNamespace:
        return SimpleNamespace(
            CUstream=lambda handle: ("CUstream", handle),
            CUdevice_attribute=lambda value: value,
            CUstreamWaitValue_flags=SimpleNamespace(CU_STREAM_WAIT_VALUE_GEQ=0),
            cuInit=lambda flags: (SUCCESS,),
            cuDeviceGet=lambda index: (SUCCESS, index),
            cuDeviceGetAttribute=lambda attribute, device: (SUCCESS, int(self.memory_ops_64)),
            cuMemGetAddressRange=lambda address: (SUCCESS, *self._call(
                "cuMemGetAddressRange", self._base_of(address), self.allocation_bytes)),
            cuStreamWriteValue64=lambda stream, address, value, flags: (SUCCESS, *self._call("cuStreamWriteValue64")),
            cuStreamWaitValue64=lambda stream, address, value, flags: (SUCCESS, *self._call("cuStreamWaitValue64")),
        )

    def _base_of(self, address: int) -> int:
        for base in (*self.opened, *self.allocations):
            if base <= address < base + self.allocation_bytes:
                return base
        return address

    def install(self, monkeypatch, driver_version: int = 13000, bindings_version: str = "13.0.3") -> None:
        """Make kvd.device.cuda use this fake (pytest's monkeypatch undoes it)."""
        import kvd.device.cuda as cuda

        monkeypatch.setattr(cuda, "_bindings", lambda: (self.runtime, self.driver, bindings_version))
        monkeypatch.setattr(cuda, "_driver_version", lambda: driver_version)
