"""The CPU device: the device interface (kvd.device.api) on host memory and threads.

- Memory is a memfd file mapped into this process: `alloc` creates one per
  allocation, and its IPC handle is the owner's pid and descriptor, which
  another process of the same host opens through /proc (as CUDA's
  cudaIpcOpenMemHandle maps another process's allocation). `open` maps a
  handle once per process and counts references.
- A stream is one worker thread running its operations in order; `copy_blocks`
  is one native call per batch (kvd._native.copy_chunks, the GIL released).
- An engine's own work (`engine_stream`) is the calling thread itself: a CPU
  engine's "kernels" have finished when its call returns.
- Asynchronous mode (`CpuDevice(delay_s=...)`, or KVD_CPU_DEVICE_DELAY_MS in
  the environment, which a daemon started by a test inherits): every
  operation of every stream, the engine's included, lands `delay_s` after it
  was issued, in stream order, as a GPU's kernels and copies land after the
  host call returns. Code that reads memory a stream has not finished
  writing, or marks a flag from the host ahead of the work it stands for,
  then fails in CI as it would on a GPU.
- Flag words are 64-bit integers in such memory. A store is an aligned 8-byte
  write, a wait polls it (backing off to 1 ms), the same protocol a GPU
  stream follows with cuStreamWriteValue64 / cuStreamWaitValue64.
- An engine whose pool is ordinary memory of its own (a CPU engine's
  tensors) shares it as process memory: `wrap` names the range,
  and `export_fd` passes a descriptor of the engine's /proc/self/mem, opened
  by the engine itself, so it grants exactly what the engine could do to
  its own memory. The daemon's copies to and from such memory are one
  native pread/pwrite loop per batch on that descriptor
  (kvd._native.copy_file_chunks), the stand-in for a GPU's copies into an
  IPC-mapped pool.
- The device UUID is derived from the host's boot id and the device index, so
  two processes on one host agree on it and another host's handle is refused.
"""

from __future__ import annotations

import ctypes
import itertools
import mmap
import os
import queue
import re
import threading
import time
import uuid as uuid_module
from pathlib import Path

import numpy as np

from kvd.device.api import Device, DeviceError, Event, IpcHandle, Memory, Stream, copy_addresses, flag_address

try:
    from kvd._native import copy_chunks as _native_copy
    from kvd._native import copy_file_chunks as _native_file_copy
except ImportError:  # not built: one memmove (or pread/pwrite) per block
    _native_copy = _native_file_copy = None

_POLL_MAX_S = 0.001
DELAY_ENV = "KVD_CPU_DEVICE_DELAY_MS"
_MEMFD_PREFIX = "/memfd:kvd-cpu-device-"
_PROCESS_MEMORY = re.compile(r"/proc/[0-9]+/mem")
HOST_MEMORY_ALREADY_REGISTERED = 712  # cudaErrorHostMemoryAlreadyRegistered
_PROCESS = "process"  # Memory.token of a range of this process's own memory, shared by descriptor
_ids = itertools.count(1)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return "no-boot-id"


def copy_chunks(dst: np.ndarray, src: np.ndarray, nbytes: int) -> None:
    """memmove of nbytes from each src address to the dst address beside it."""
    if _native_copy is not None:
        _native_copy(dst, src, nbytes)
        return
    for target, source in zip(dst.tolist(), src.tolist()):
        ctypes.memmove(target, source, nbytes)


def copy_file_chunks(fd: int, file_offsets: np.ndarray, addresses: np.ndarray, nbytes: int, write: bool) -> None:
    """pwrite (write) or pread of nbytes between each local address and the file offset beside it."""
    if _native_file_copy is not None:
        _native_file_copy(fd, file_offsets, addresses, nbytes, write)
        return
    for offset, address in zip(file_offsets.tolist(), addresses.tolist()):
        view = (ctypes.c_char * nbytes).from_address(address)
        moved = os.pwrite(fd, view, offset) if write else os.preadv(fd, [view], offset)
        if moved != nbytes:
            raise OSError(5, "short transfer")


class _ProcessMemory:
    """Another process's memory, through a descriptor of its /proc/<pid>/mem that it opened."""

    owned = False

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.references = 1

    def close(self) -> None:
        os.close(self.fd)


class _Mapping:
    """One mapped memfd: the mmap, its address, and who holds it."""

    def __init__(self, fd: int, nbytes: int, owned: bool) -> None:
        self.fd, self.nbytes, self.owned = fd, nbytes, owned
        self.map = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.references = 1

    def close(self) -> None:
        self.map.close()
        os.close(self.fd)


class CpuEvent(Event):
    def __init__(self, stream: CpuStream) -> None:
        self._stream = stream
        self._done = threading.Event()

    def _complete(self) -> None:
        self._done.set()

    def query(self) -> bool:
        done = self._done.is_set()
        if done:
            self._stream.raise_error()
        return done

    def synchronize(self, timeout_s: float | None = None) -> None:
        if not self._done.wait(timeout_s):
            raise DeviceError(f"the stream did not reach this event within {timeout_s} s")
        self._stream.raise_error()


class CpuStream(Stream):
    def __init__(self, device: CpuDevice) -> None:
        self.device = device
        self.delay_s = device.delay_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvd-cpu-stream-{next(_ids)}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            due, operation = self._queue.get()
            if operation is None:
                return
            pause = due - time.monotonic()
            if pause > 0:  # asynchronous mode: it lands this long after it was issued
                time.sleep(pause)
            if isinstance(operation, CpuEvent):
                operation._complete()  # even after an error: its synchronize then raises it
            elif self._error is None:  # after one, the rest is skipped (sticky, as on a GPU)
                try:
                    operation()
                except BaseException as error:
                    self._error = error

    def raise_error(self) -> None:
        if self._error is not None:
            raise DeviceError(f"an operation on this stream failed: {self._error}") from self._error

    def _issue(self, operation) -> None:
        if self._closed:
            raise DeviceError("the stream is closed")
        self._queue.put((time.monotonic() + self.delay_s, operation))

    def copy_blocks(self, dst: Memory, dst_offsets, src: Memory, src_offsets, nbytes: int) -> None:
        dst_process, src_process = self.device.process_fd(dst), self.device.process_fd(src)
        if dst_process >= 0 and src_process >= 0:
            raise DeviceError("a copy between two processes' memory: one side must be this process's")
        addresses = copy_addresses(dst, dst_offsets, src, src_offsets, nbytes)
        if addresses is None:
            return
        targets, sources = addresses
        if dst_process >= 0:
            self._issue(lambda: copy_file_chunks(dst_process, targets, sources, nbytes, write=True))
        elif src_process >= 0:
            self._issue(lambda: copy_file_chunks(src_process, sources, targets, nbytes, write=False))
        else:
            self._issue(lambda: copy_chunks(targets, sources, nbytes))

    def write_flag(self, flags: Memory, index: int, value: int) -> None:
        word = _flag_word(flags, index)
        self._issue(lambda: setattr(word, "value", value))

    def wait_flag(self, flags: Memory, index: int, value: int) -> None:
        word = _flag_word(flags, index)
        self._issue(lambda: _wait_word(word, value, lambda: self._closed))

    def record(self) -> CpuEvent:
        event = CpuEvent(self)
        self._issue(event)
        return event

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CpuEvent):
            raise DeviceError("an event of another kind of device")
        self._issue(lambda: event.synchronize())

    def close(self) -> None:
        if not self._closed:
            self._queue.put((0.0, None))
            self._closed = True
            self._thread.join()


class _DoneEvent(Event):
    """The event of work that ran in the caller's thread: complete when recorded."""

    def query(self) -> bool:
        return True

    def synchronize(self, timeout_s: float | None = None) -> None:
        return None


class InlineStream(Stream):
    """A synchronous CPU engine's stream: each operation runs in the calling thread, now."""

    def copy_blocks(self, dst: Memory, dst_offsets, src: Memory, src_offsets, nbytes: int) -> None:
        addresses = copy_addresses(dst, dst_offsets, src, src_offsets, nbytes)
        if addresses is not None:
            copy_chunks(*addresses, nbytes)

    def write_flag(self, flags: Memory, index: int, value: int) -> None:
        store_flag(flags, index, value)

    def wait_flag(self, flags: Memory, index: int, value: int) -> None:
        _wait_word(_flag_word(flags, index), value, lambda: False)

    def record(self) -> Event:
        return _DoneEvent()

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def close(self) -> None:
        return None


def _wait_word(word: ctypes.c_uint64, value: int, closed) -> None:
    """Poll a flag word until it reaches `value` (backing off to 1 ms); DeviceError once `closed()`."""
    pause = 1e-6
    while word.value < value:
        if closed():
            raise DeviceError("the stream closed while it waited on a flag")
        time.sleep(pause)
        pause = min(pause * 2, _POLL_MAX_S)


def _flag_word(flags: Memory, index: int) -> ctypes.c_uint64:
    return ctypes.c_uint64.from_address(flag_address(flags, index))


def read_flag(flags: Memory, index: int) -> int:
    """A flag word in host memory, as a CPU thread sees it now (an aligned 8-byte load)."""
    return _flag_word(flags, index).value


def store_flag(flags: Memory, index: int, value: int) -> None:
    """Store to a flag word in host memory from this thread (an aligned 8-byte store)."""
    _flag_word(flags, index).value = value


def _delay_from_environment() -> float:
    text = os.environ.get(DELAY_ENV, "")
    try:
        delay_ms = float(text or 0)
    except ValueError:
        raise DeviceError(f"{DELAY_ENV}={text!r}: a delay in milliseconds") from None
    if delay_ms < 0:
        raise DeviceError(f"{DELAY_ENV}={text!r}: a delay in milliseconds, not negative")
    return delay_ms / 1000.0


class CpuDevice(Device):
    kind = "cpu"

    def __init__(self, index: int = 0, delay_s: float | None = None) -> None:
        """`delay_s`: asynchronous mode, every stream operation lands this long after it is issued
        (None: KVD_CPU_DEVICE_DELAY_MS from the environment, 0 when unset)."""
        if index < 0:
            raise DeviceError(f"device index {index}")
        self.delay_s = _delay_from_environment() if delay_s is None else delay_s
        if self.delay_s < 0:
            raise DeviceError(f"a stream delay of {self.delay_s} s")
        self._engine_streams = threading.local()
        self.index = index
        self.uuid = str(uuid_module.uuid5(uuid_module.NAMESPACE_OID, f"kvd-cpu-device/{_boot_id()}/{index}"))
        self._allocations: dict[int, _Mapping] = {}
        self._opened: dict[tuple[int, int], _Mapping] = {}
        self._registered: dict[int, int] = {}  # address -> bytes
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> Memory:
        if nbytes <= 0:
            raise DeviceError(f"cannot allocate {nbytes} bytes")
        fd = os.memfd_create(f"kvd-cpu-device-{self.index}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mapping = _Mapping(fd, nbytes, owned=True)
        except OSError as error:
            os.close(fd)
            raise DeviceError(f"cannot allocate {nbytes} bytes: {error.strerror}", error.errno) from None
        with self._lock:
            self._allocations[mapping.address] = mapping
        return Memory(mapping.address, nbytes, self.uuid, token=mapping)

    def free(self, memory: Memory) -> None:
        with self._lock:
            mapping = self._allocations.pop(memory.address, None)
        if mapping is None:
            raise DeviceError(f"no allocation of this device at {memory.address:#x}")
        mapping.close()

    def register_host(self, address: int, nbytes: int) -> Memory:
        """Host memory is this device's memory already; registering only records the range. A range
        that overlaps one still registered is refused, as cudaHostRegister refuses it (error 712): a
        registration left behind by memory freed without unregistering shows here, not first on a GPU."""
        if address <= 0 or nbytes <= 0:
            raise DeviceError(f"cannot register {nbytes} bytes at {address:#x}")
        with self._lock:
            for start, length in self._registered.items():
                if start < address + nbytes and address < start + length:
                    raise DeviceError(f"host memory [{address:#x}, +{nbytes}) overlaps a registration still "
                                      f"held at [{start:#x}, +{length})", HOST_MEMORY_ALREADY_REGISTERED)
            self._registered[address] = nbytes
        return Memory(address, nbytes, self.uuid, token="host")

    def unregister_host(self, memory: Memory) -> None:
        with self._lock:
            if self._registered.pop(memory.address, None) is None:
                raise DeviceError(f"no host registration at {memory.address:#x}")

    def wrap(self, address: int, nbytes: int) -> Memory:
        """A range of this process's own memory (a CPU engine's KV tensors) to share by descriptor
        (`export_fd`): the daemon reads and writes it through this process's /proc/self/mem."""
        if address <= 0 or nbytes <= 0:
            raise DeviceError(f"cannot share {nbytes} bytes at {address:#x}")
        return Memory(address, nbytes, self.uuid, token=_PROCESS)

    def fd_offset(self, memory: Memory) -> int:
        return memory.address if memory.token == _PROCESS else 0

    def export(self, memory: Memory, offset: int = 0, nbytes: int | None = None) -> IpcHandle:
        if memory.token == _PROCESS:
            raise DeviceError("process memory is shared as a descriptor (export_fd, over the arena socket)")
        mapping = self._allocations.get(memory.address)
        if mapping is None:
            raise DeviceError("only memory this process allocated can be exported")
        nbytes = mapping.nbytes - offset if nbytes is None else nbytes
        if offset < 0 or nbytes <= 0 or offset + nbytes > mapping.nbytes:
            raise DeviceError(f"[{offset}, {offset + nbytes}) is outside the {mapping.nbytes}-byte allocation")
        handle = f"{os.getpid()}:{mapping.fd}:{mapping.nbytes}".encode()
        return IpcHandle(self.kind, self.uuid, handle, offset, nbytes)

    def open(self, handle: IpcHandle) -> Memory:
        self.check_handle(handle)
        try:
            pid, fd, size = (int(part) for part in handle.handle.decode().split(":"))
        except ValueError:
            raise DeviceError(f"not a CPU device IPC handle: {handle.handle!r}") from None
        if handle.offset + handle.nbytes > size:
            raise DeviceError(f"[{handle.offset}, {handle.offset + handle.nbytes}) is outside {size} bytes")
        with self._lock:
            mapping = self._opened.get((pid, fd))
            if mapping is None:
                mapping = self._opened[(pid, fd)] = self._map_other(pid, fd, size)
            else:
                mapping.references += 1
        return Memory(mapping.address + handle.offset, handle.nbytes, self.uuid, token=(pid, fd))

    @staticmethod
    def _map_other(pid: int, fd: int, size: int) -> _Mapping:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            # Only this device's memory: never any other file a process has open.
            if not os.readlink(path).startswith(_MEMFD_PREFIX):
                raise DeviceError(f"process {pid}'s descriptor {fd} is not CPU device memory")
            own = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as error:
            raise DeviceError(f"cannot open process {pid}'s memory {fd}: {error.strerror}", error.errno) from None
        if os.fstat(own).st_size != size:
            os.close(own)
            raise DeviceError(f"process {pid}'s descriptor {fd} is not the {size}-byte allocation it was")
        return _Mapping(own, size, owned=False)

    def export_fd(self, memory: Memory) -> int:
        if memory.token == _PROCESS:
            try:
                return os.open("/proc/self/mem", os.O_RDWR | os.O_CLOEXEC)
            except OSError as error:
                raise DeviceError(f"cannot open this process's memory: {error.strerror}", error.errno) from None
        mapping = self._allocations.get(memory.address)
        if mapping is None:
            raise DeviceError("only memory this process allocated can be exported")
        return os.dup(mapping.fd)

    def import_fd(self, fd: int, offset: int, nbytes: int) -> Memory:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError as error:
            os.close(fd)
            raise DeviceError(f"cannot use the descriptor: {error.strerror}", error.errno) from None
        if _PROCESS_MEMORY.fullmatch(target):
            return self._import_process(fd, target, offset, nbytes)
        try:
            if not target.startswith(_MEMFD_PREFIX):
                raise DeviceError("the descriptor is not CPU device memory")
            stat = os.fstat(fd)
        except OSError as error:
            os.close(fd)
            raise DeviceError(f"cannot use the descriptor: {error.strerror}", error.errno) from None
        except DeviceError:
            os.close(fd)
            raise
        if offset < 0 or nbytes <= 0 or offset + nbytes > stat.st_size:
            os.close(fd)
            raise DeviceError(f"[{offset}, {offset + nbytes}) is outside the {stat.st_size}-byte allocation")
        key = ("inode", stat.st_dev, stat.st_ino)
        mapping = self._share(key, fd, lambda: _Mapping(fd, stat.st_size, owned=False))
        return Memory(mapping.address + offset, nbytes, self.uuid, token=key)

    def _share(self, key: tuple, fd: int, make):
        """What is open under `key` with one more reference (then `fd` is closed), or make() it there."""
        with self._lock:
            opened = self._opened.get(key)
            if opened is not None:
                opened.references += 1
                os.close(fd)
                return opened
            try:
                opened = self._opened[key] = make()
            except OSError as error:
                os.close(fd)
                raise DeviceError(f"cannot map the descriptor: {error.strerror}", error.errno) from None
            return opened

    def _import_process(self, fd: int, target: str, offset: int, nbytes: int) -> Memory:
        """Another process's [offset, offset + nbytes) through its /proc/<pid>/mem (`fd`, taken over)."""
        probe = ctypes.create_string_buffer(1)
        try:
            if target == f"/proc/{os.getpid()}/mem":
                raise DeviceError("the descriptor is this process's own memory, not an engine's")
            if offset <= 0 or nbytes <= 0:
                raise DeviceError(f"[{offset:#x}, +{nbytes}) is not a range of {target}")
            for address in (offset, offset + nbytes - 1):
                if os.preadv(fd, [probe], address) != 1:  # unmapped: EIO
                    raise OSError(5, "nothing mapped there")
            stat = os.fstat(fd)
        except OSError as error:
            os.close(fd)
            raise DeviceError(f"{target}: [{offset:#x}, +{nbytes}) is not readable memory: {error.strerror}",
                              error.errno) from None
        except DeviceError:
            os.close(fd)
            raise
        key = ("process", stat.st_dev, stat.st_ino)
        self._share(key, fd, lambda: _ProcessMemory(fd))
        return Memory(offset, nbytes, self.uuid, token=key)

    def process_fd(self, memory: Memory) -> int:
        """The descriptor of another process's memory `memory` lies in; -1 for memory mapped here."""
        if not isinstance(memory.token, tuple) or memory.token[0] != "process":
            return -1
        opened = self._opened.get(memory.token)
        if opened is None:
            raise DeviceError("that process's memory was closed")
        return opened.fd

    def close(self, memory: Memory) -> None:
        key = memory.token
        with self._lock:
            mapping = self._opened.get(key) if isinstance(key, tuple) else None
            if mapping is None:
                raise DeviceError("this memory was not opened from an IPC handle")
            mapping.references -= 1
            if mapping.references:
                return
            del self._opened[key]
        mapping.close()

    def stream(self) -> CpuStream:
        return CpuStream(self)

    def engine_stream(self, handle: int | None = None) -> Stream:
        """The calling thread's own work: done when its calls return (InlineStream), or in
        asynchronous mode a delayed stream of this thread's, which the thread's engine work (a
        test's model) issues to as well. `handle` is CUDA's and unused here."""
        if not self.delay_s:
            return InlineStream()
        stream = getattr(self._engine_streams, "stream", None)
        if stream is None:
            stream = self._engine_streams.stream = CpuStream(self)
        return stream
