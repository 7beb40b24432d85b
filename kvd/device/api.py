"""The device interface: memory, IPC handles, streams, batched copies, events and flag words.

kvd moves KV blocks between an engine's device pool, its own device tier
and the pinned host arena through this interface, never through a GPU API
directly. Two implementations stand behind it (kvd.device.open_device):

- `cpu` (kvd.device.cpu): "device" memory in memfd files that other
  processes map, a worker thread per stream, flag words in that memory.
  Every test of the logic above the interface runs against it in CI.
- `cuda` (kvd.device.cuda): the CUDA runtime and driver, on a GPU host.

The vocabulary is CUDA's, so the two line up call for call:

- `Memory`: a range of one device's memory (or of host memory registered
  with it), by address.
- `IpcHandle`: what another process needs to map a Memory (CUDA: a
  cudaIpcMemHandle; CPU: the memfd's owner and descriptor). It names the
  device it belongs to by UUID, and `Device.open` refuses another device's.
- `Stream`: operations run in the order they were issued and the caller
  does not wait (CUDA streams). `copy_blocks` is one batched call per list
  of blocks (cudaMemcpyBatchAsync), `write_flag` and `wait_flag` are
  stream-ordered 64-bit stores and waits on a flag word in device or
  host-mapped memory (cuStreamWriteValue64 and cuStreamWaitValue64 with
  GEQ), and `record` gives an Event that completes when everything issued
  before it has.

Errors are sticky per stream, as on a GPU: an operation that fails makes
the stream's next `synchronize` (and its events) raise DeviceError.
"""

from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from kvd.errors import KvdError

FLAG_BYTES = 8


class DeviceError(KvdError):
    """A device call failed; `error_number` is the backend's (a cudaError_t) where it has one."""

    def __init__(self, message: str, error_number: int = 0) -> None:
        super().__init__(message)
        self.error_number = error_number


class NoDevice(DeviceError):
    """No usable device: no driver, no GPU, or an index past the last one."""

    code = "FAILED_PRECONDITION"


@dataclass(frozen=True, slots=True)
class Memory:
    address: int
    nbytes: int
    device_uuid: str
    # Opaque to callers: what the implementation needs to free or close it.
    token: object = None

    def at(self, offsets) -> np.ndarray:
        """Absolute addresses of byte offsets into this memory, bounds-checked."""
        offsets = np.asarray(offsets, dtype=np.uint64)
        if len(offsets) and int(offsets.max()) >= self.nbytes:
            raise DeviceError(f"offset {int(offsets.max())} is outside {self.nbytes} bytes of memory")
        return offsets + np.uint64(self.address)


def copy_addresses(dst: Memory, dst_offsets, src: Memory, src_offsets,
                   nbytes: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Absolute (targets, sources) of a batched copy, every byte of it bounds-checked;
    None when there is nothing to copy."""
    dst_offsets = np.asarray(dst_offsets, dtype=np.uint64)
    src_offsets = np.asarray(src_offsets, dtype=np.uint64)
    if len(dst_offsets) != len(src_offsets):
        raise DeviceError(f"{len(dst_offsets)} destinations for {len(src_offsets)} sources")
    if nbytes <= 0 or not len(dst_offsets):
        return None
    last = np.uint64(nbytes - 1)
    return dst.at(dst_offsets + last) - last, src.at(src_offsets + last) - last


def flag_address(flags: Memory, index: int) -> int:
    """Address of 64-bit flag word `index`, checked to lie inside `flags`."""
    if index < 0 or (index + 1) * FLAG_BYTES > flags.nbytes:
        raise DeviceError(f"flag word {index} is outside {flags.nbytes} bytes of flags")
    return flags.address + index * FLAG_BYTES


@dataclass(frozen=True, slots=True)
class IpcHandle:
    """Everything another process needs to map a range of device memory."""

    kind: str
    device_uuid: str
    handle: bytes
    offset: int
    nbytes: int

    _HEADER = struct.Struct("<4sH36sQQH")

    def to_bytes(self) -> bytes:
        header = self._HEADER.pack(self.kind.encode()[:4], 1, self.device_uuid.encode()[:36].ljust(36, b"\0"),
                                   self.offset, self.nbytes, len(self.handle))
        return header + self.handle

    @classmethod
    def from_bytes(cls, data: bytes) -> IpcHandle:
        size = cls._HEADER.size
        if len(data) < size:
            raise DeviceError(f"an IPC handle is at least {size} bytes, got {len(data)}")
        kind, version, uuid, offset, nbytes, length = cls._HEADER.unpack_from(data)
        if version != 1 or len(data) != size + length:
            raise DeviceError(f"not an IPC handle of version 1 ({len(data)} bytes, version {version})")
        return cls(kind.rstrip(b"\0").decode(), uuid.rstrip(b"\0").decode(), data[size:], offset, nbytes)


class Event(ABC):
    @abstractmethod
    def query(self) -> bool:
        """Whether everything issued before the event has completed (raises a stream's error)."""

    @abstractmethod
    def synchronize(self, timeout_s: float | None = None) -> None:
        """Wait until it has; DeviceError on a stream error or past the timeout."""


class Stream(ABC):
    @abstractmethod
    def copy_blocks(self, dst: Memory, dst_offsets, src: Memory, src_offsets, nbytes: int) -> None:
        """Copy `nbytes` from each src offset to the matching dst offset: one batched call."""

    @abstractmethod
    def write_flag(self, flags: Memory, index: int, value: int) -> None:
        """Store `value` in the 64-bit flag word `index` once everything before it is done."""

    @abstractmethod
    def wait_flag(self, flags: Memory, index: int, value: int) -> None:
        """Hold the stream until flag word `index` is at least `value` (another stream or process writes it)."""

    @abstractmethod
    def record(self) -> Event:
        """An event that completes when everything issued so far has."""

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Hold the stream until `event` (of any stream of this device) completes."""

    def synchronize(self, timeout_s: float | None = None) -> None:
        self.record().synchronize(timeout_s)

    @abstractmethod
    def close(self) -> None:
        """Finish what was issued and release the stream."""


class Device(ABC):
    kind: str
    uuid: str

    @abstractmethod
    def alloc(self, nbytes: int) -> Memory: ...

    @abstractmethod
    def free(self, memory: Memory) -> None: ...

    @abstractmethod
    def wrap(self, address: int, nbytes: int) -> Memory:
        """Memory this process already has (an engine's KV tensor, allocated by its framework), to export:
        CUDA: the range inside its cudaMalloc allocation; CPU: the process's own memory, by descriptor."""

    @abstractmethod
    def register_host(self, address: int, nbytes: int) -> Memory:
        """Host memory (the arena) made usable by this device's copies (CUDA: cudaHostRegister)."""

    @abstractmethod
    def unregister_host(self, memory: Memory) -> None: ...

    @abstractmethod
    def export(self, memory: Memory, offset: int = 0, nbytes: int | None = None) -> IpcHandle:
        """An IPC handle for [offset, offset + nbytes) of memory this process allocated."""

    @abstractmethod
    def open(self, handle: IpcHandle) -> Memory:
        """Map another process's memory (reference-counted per handle); refuses another device's."""

    @abstractmethod
    def close(self, memory: Memory) -> None:
        """Drop one reference taken by `open` or `import_fd`; the mapping goes with the last."""

    @abstractmethod
    def export_fd(self, memory: Memory) -> int:
        """A new file descriptor for an allocation of this process, to pass over a unix socket
        (SCM_RIGHTS): where the other side cannot reach this process by pid (another pid namespace,
        a container), and for CUDA VMM allocations (cuMemExportToShareableHandle). The caller closes it."""

    def fd_offset(self, memory: Memory) -> int:
        """Where `memory` starts in the file `export_fd` gives for it (the import_fd offset)."""
        return 0

    @abstractmethod
    def import_fd(self, fd: int, offset: int, nbytes: int) -> Memory:
        """Map [offset, offset + nbytes) of an allocation passed as `fd` (which this call takes over,
        whatever happens). Reference-counted per allocation, as `open`."""

    @abstractmethod
    def stream(self) -> Stream: ...

    @abstractmethod
    def engine_stream(self, handle: int | None = None) -> Stream:
        """The stream an engine's own work on this device runs on, so that what it stores to a flag
        word lands behind that work, never ahead of it. CUDA: the framework's stream `handle`
        (torch.cuda.current_stream().cuda_stream), used and never destroyed; CPU: the calling
        thread (asynchronous mode: that thread's delayed stream)."""

    def check_handle(self, handle: IpcHandle) -> None:
        if handle.kind != self.kind:
            raise DeviceError(f"an IPC handle of a {handle.kind!r} device, and this device is {self.kind!r}")
        if handle.device_uuid != self.uuid:
            raise DeviceError(f"an IPC handle of device {handle.device_uuid}, and this device is {self.uuid}")
        if handle.nbytes <= 0 or handle.offset < 0:
            raise DeviceError(f"an IPC handle of {handle.nbytes} bytes at offset {handle.offset}")
