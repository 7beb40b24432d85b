"""The engine's side of the device plane: a paged KV pool registered with kvd, and its flag words.

    pool = DevicePool(client, namespace, device, layer_memories, num_blocks)
    base = pool.flag(ENGINE)                     # values only grow: each transfer starts past the last
    ... the engine writes layer l of the pages, then pool.mark(ENGINE, base + l + 1)
    response = pool.save(keys, pages, engine_flag=ENGINE, kvd_flag=KVD, base=base)
    pool.flag(KVD) >= base + l + 1               # layer l is out of the pages: they may be reused

A GPU engine stores to its flag word from its stream (cuStreamWriteValue64 into the flag memory,
which it registers with cudaHostRegister) and waits on kvd's with cuStreamWaitValue64; the CPU
device's `mark` and `flag` are the same stores and loads from a thread.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from pathlib import Path

from kvd.arena_protocol import deposit_fds
from kvd.client._ops import resolve_token
from kvd.client._wire import Namespace
from kvd.device import Device, IpcHandle, Memory
from kvd.device.cpu import CpuDevice, read_flag, store_flag
from kvd.v1 import kvd_pb2

# kvd stores FAILED | done_value in its flag word when a transfer failed (kvd.server.device_plane).
FAILED = 1 << 63


class DevicePool:
    def __init__(self, client, namespace: Namespace, device: Device, layers: Sequence[Memory], num_blocks: int,
                 flag_words: int = 64, lease_ms: int = 0, host: CpuDevice | None = None,
                 arena_socket: Path | None = None, token: str | None = None, page_stride: int = 0,
                 v_offset: int = 0) -> None:
        """`arena_socket`: pass the memory to the daemon as file descriptors over its arena socket
        (needed where the daemon cannot reach this process by pid, as from another container, and
        for CUDA VMM pools); None: IPC handles by pid inside the RPC. `page_stride`, `v_offset`: for
        pools that keep K and V apart (kvd.device.transfer.PoolLayout)."""
        self.client = client
        self.namespace = namespace
        self.host = host if host is not None else (device if isinstance(device, CpuDevice) else CpuDevice())
        self.flags = self.host.alloc(flag_words * 8)
        try:
            if arena_socket is None:
                handles = [device.export(memory).to_bytes() for memory in layers]
                flags = self.host.export(self.flags).to_bytes()
            else:
                handles, flags = self._deposit(arena_socket, resolve_token(token), device, layers)
            response = client.register_pool(namespace, handles, num_blocks, flags, lease_ms, page_stride, v_offset)
        except BaseException:
            self.host.free(self.flags)
            raise
        self.pool_id = response.pool_id
        self.lease_deadline_ms = response.lease_deadline_ms
        # The flag words outlive `close` only as long as someone holds the pool: a pool the daemon
        # forgot (it restarted) is simply dropped, and its words are freed once the last user is done.
        self._free_flags = weakref.finalize(self, self.host.free, self.flags)

    def _deposit(self, path: Path, token: str | None, device: Device,
                 layers: Sequence[Memory]) -> tuple[list[bytes], bytes]:
        fds = [device.export_fd(memory) for memory in layers] + [self.host.export_fd(self.flags)]
        try:
            ticket = deposit_fds(path, token, fds)
        finally:
            for fd in fds:
                os.close(fd)
        handles = [IpcHandle(device.kind, device.uuid, f"deposit:{ticket}:{i}".encode(), device.fd_offset(memory),
                             memory.nbytes).to_bytes()
                   for i, memory in enumerate(layers)]
        flags = IpcHandle(self.host.kind, self.host.uuid, f"deposit:{ticket}:{len(layers)}".encode(), 0,
                          self.flags.nbytes).to_bytes()
        return handles, flags

    def flag(self, index: int) -> int:
        return read_flag(self.flags, index)

    def mark(self, index: int, value: int) -> None:
        store_flag(self.flags, index, value)

    def save(self, keys: Sequence[bytes], pages: Sequence[int], engine_flag: int, kvd_flag: int, base: int,
             parent_key: bytes = b"", offload_distance: int = -1) -> kvd_pb2.SaveLayersResponse:
        return self.client.save_layers(self.namespace, self.pool_id, keys, pages, engine_flag, kvd_flag, base,
                                       parent_key, offload_distance)

    def load(self, keys: Sequence[bytes], pages: Sequence[int], kvd_flag: int, base: int,
             parent_key: bytes = b"") -> kvd_pb2.LoadLayersResponse:
        return self.client.load_layers(self.namespace, self.pool_id, keys, pages, kvd_flag, base, parent_key)

    def close(self) -> None:
        """Unregister (kvd drains the pool's transfers first), then free the flag words."""
        try:
            self.client.unregister_pool(self.pool_id)
        finally:
            self._free_flags()
