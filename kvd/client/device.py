"""The engine's side of the device plane: a paged KV pool registered with kvd, and its flag words.

    pool = DevicePool(client, namespace, device, layer_memories, num_blocks)
    base = pool.flag(ENGINE)                     # values only grow: each transfer starts past the last
    ... the engine writes layer l of the pages, then pool.mark(ENGINE, base + l + 1)
    response = pool.save(keys, pages, engine_flag=ENGINE, kvd_flag=KVD, base=base)
    pool.flag(KVD) >= base + l + 1               # layer l is out of the pages: they may be reused

An engine marks its word from the stream its own work runs on (`mark_on(stream, ...)`:
cuStreamWriteValue64 into the flag memory, which the pool registers with the engine's device), so
the mark lands behind the layer's kernels, never ahead of them; `mark` and `flag` are plain stores
and loads from a thread, for words nothing on a stream writes at the same time.

The flag memory always goes to the daemon as a descriptor over its arena socket where there is one
(never by pid through /proc, which another pid namespace or user cannot open); the layers go as
descriptors on the CPU device and as CUDA IPC handles on a GPU.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from pathlib import Path

from kvd.arena_protocol import deposit_fds, receive_arena
from kvd.client._channel import resolve_token
from kvd.client._wire import Namespace
from kvd.client.ring_loads import RingCounts, RingReads
from kvd.device import Device, IpcHandle, Memory, Stream
from kvd.device.cpu import CpuDevice, read_flag, store_flag
from kvd.device.io_ring import RingMemory
from kvd.device.transfer import FAILED as FAILED  # kvd stores FAILED | done_value when a transfer failed
from kvd.v1 import kvd_pb2


class DevicePool:
    def __init__(self, client, namespace: Namespace, device: Device, layers: Sequence[Memory], num_blocks: int,
                 flag_words: int = 64, lease_ms: int = 0, host: CpuDevice | None = None,
                 arena_socket: Path | None = None, token: str | None = None, page_stride: int = 0,
                 v_offset: int = 0, io_ring: bool = False) -> None:
        """`arena_socket`: pass the flag memory (and, on the CPU device, the layers) to the daemon as
        file descriptors over its arena socket, as it must be where the daemon cannot reach this
        process by pid (another container); None: everything by IPC handle inside the RPC.
        `page_stride`, `v_offset`: for pools whose pages are not back to back or keep K and V apart
        (kvd.device.transfer.PoolLayout). `io_ring`: disk hits come through the pool's I/O ring
        (kvd.client.ring_loads; the ring is mapped over the arena socket, which it needs)."""
        if io_ring and arena_socket is None:
            raise ValueError("io_ring: the pool's ring is handed over the daemon's arena socket; give arena_socket")
        self.client = client
        self.namespace = namespace
        self.host = host if host is not None else (device if isinstance(device, CpuDevice) else CpuDevice())
        self.flags = self.host.alloc(flag_words * 8)
        try:
            # The same words as the engine's device stores to them from its streams.
            self.flags_on_device = self.flags if device is self.host else device.register_host(self.flags.address,
                                                                                               self.flags.nbytes)
        except BaseException:
            self.host.free(self.flags)
            raise
        # The flag words outlive `close` only as long as someone holds the pool: a pool the daemon
        # forgot (it restarted) is simply dropped, and its words are freed once the last user is done.
        self._free_flags = weakref.finalize(self, _free_flags, device, self.host, self.flags, self.flags_on_device)
        try:
            handles = [device.export(memory).to_bytes() for memory in layers] if arena_socket is None or \
                device.kind != "cpu" else None
            handles, flags = self._share(arena_socket, resolve_token(token), device, layers, handles)
            response = client.register_pool(namespace, handles, num_blocks, flags, lease_ms, page_stride, v_offset,
                                            io_ring)
        except BaseException:
            self._free_flags()
            raise
        self.pool_id = response.pool_id
        self.lease_deadline_ms = response.lease_deadline_ms
        self.ring: RingCounts | None = None
        if io_ring:
            try:
                self.ring = RingCounts(_map_ring(arena_socket, resolve_token(token), response.ring_token))
            except BaseException:
                self.close()
                raise

    def _share(self, path: Path | None, token: str | None, device: Device, layers: Sequence[Memory],
               handles: list[bytes] | None) -> tuple[list[bytes], bytes]:
        """The layers' and the flags' handles for RegisterPool: what `handles` lacks (None: the layers
        too) deposited over the arena socket at `path`; everything by pid when there is no socket."""
        if path is None:
            return handles, self.host.export(self.flags).to_bytes()
        exported = [device.export_fd(memory) for memory in layers] if handles is None else []
        fds = exported + [self.host.export_fd(self.flags)]
        try:
            ticket = deposit_fds(path, token, fds)
        finally:
            for fd in fds:
                os.close(fd)
        if handles is None:
            handles = [IpcHandle(device.kind, device.uuid, f"deposit:{ticket}:{i}".encode(), device.fd_offset(memory),
                                 memory.nbytes).to_bytes() for i, memory in enumerate(layers)]
        flags = IpcHandle(self.host.kind, self.host.uuid, f"deposit:{ticket}:{len(exported)}".encode(), 0,
                          self.flags.nbytes).to_bytes()
        return handles, flags

    def flag(self, index: int) -> int:
        return read_flag(self.flags, index)

    def mark(self, index: int, value: int) -> None:
        """Store `value` now, from this thread."""
        store_flag(self.flags, index, value)

    def mark_on(self, stream: Stream, index: int, value: int) -> None:
        """Store `value` once everything issued to `stream` before it has run (the engine's stream:
        the mark then never runs ahead of the kernels that wrote the layer)."""
        stream.write_flag(self.flags_on_device, index, value)

    def save(self, keys: Sequence[bytes], pages: Sequence[int], engine_flag: int, kvd_flag: int, base: int,
             parent_key: bytes = b"", offload_distance: int = -1) -> kvd_pb2.SaveLayersResponse:
        return self.client.save_layers(self.namespace, self.pool_id, keys, pages, engine_flag, kvd_flag, base,
                                       parent_key, offload_distance)

    def load(self, keys: Sequence[bytes], pages: Sequence[int], kvd_flag: int, base: int,
             parent_key: bytes = b"", cancel_flag: int | None = None) -> kvd_pb2.LoadLayersResponse:
        return self.client.load_layers(self.namespace, self.pool_id, keys, pages, kvd_flag, base, parent_key,
                                       cancel_flag)

    def ring_reads(self, response: kvd_pb2.LoadLayersResponse) -> RingReads | None:
        """The reads a load's answer granted to the pool's ring (None: none of its blocks came from
        disk, or the pool has no ring): the engine publishes them and waits on them per layer."""
        if self.ring is None or not response.ring_blocks:
            return None
        return RingReads(self.ring, response.ring_reads, response.ring_blocks)

    def close(self) -> None:
        """Unregister (kvd drains the pool's transfers first), then free the flag words."""
        try:
            self.client.unregister_pool(self.pool_id)
        finally:
            self._free_flags()
            if getattr(self, "ring", None) is not None:
                self.ring.ring.close()
                self.ring = None


def _map_ring(arena_socket: Path, token: str | None, ring_token: str) -> RingMemory:
    """The pool's I/O ring, mapped from the memfd the arena socket hands to the pool's tenant."""
    fd, _ = receive_arena(arena_socket, token, "", ring=ring_token)
    try:
        return RingMemory.from_fd(fd)
    finally:
        os.close(fd)


def _free_flags(device: Device, host: CpuDevice, flags: Memory, flags_on_device: Memory) -> None:
    """The flag words' registration with the engine's device, then their memory."""
    try:
        if flags_on_device is not flags:
            device.unregister_host(flags_on_device)
    finally:
        host.free(flags)
