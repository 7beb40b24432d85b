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

from collections.abc import Sequence

from kvd.client._wire import Namespace
from kvd.device import Device, Memory
from kvd.device.cpu import CpuDevice, read_flag, store_flag
from kvd.v1 import kvd_pb2

# kvd stores FAILED | done_value in its flag word when a transfer failed (kvd.server.device_plane).
FAILED = 1 << 63


class DevicePool:
    def __init__(self, client, namespace: Namespace, device: Device, layers: Sequence[Memory], num_blocks: int,
                 flag_words: int = 64, lease_ms: int = 0, host: CpuDevice | None = None) -> None:
        self.client = client
        self.namespace = namespace
        self.host = host if host is not None else (device if isinstance(device, CpuDevice) else CpuDevice())
        self.flags = self.host.alloc(flag_words * 8)
        handles = [device.export(memory).to_bytes() for memory in layers]
        try:
            response = client.register_pool(namespace, handles, num_blocks, self.host.export(self.flags).to_bytes(),
                                             lease_ms)
        except BaseException:
            self.host.free(self.flags)
            raise
        self.pool_id = response.pool_id
        self.lease_deadline_ms = response.lease_deadline_ms

    def flag(self, index: int) -> int:
        return read_flag(self.flags, index)

    def mark(self, index: int, value: int) -> None:
        store_flag(self.flags, index, value)

    def save(self, keys: Sequence[bytes], pages: Sequence[int], engine_flag: int, kvd_flag: int, base: int,
             parent_key: bytes = b"") -> kvd_pb2.SaveLayersResponse:
        return self.client.save_layers(self.namespace, self.pool_id, keys, pages, engine_flag, kvd_flag, base,
                                       parent_key)

    def load(self, keys: Sequence[bytes], pages: Sequence[int], kvd_flag: int, base: int,
             parent_key: bytes = b"") -> kvd_pb2.LoadLayersResponse:
        return self.client.load_layers(self.namespace, self.pool_id, keys, pages, kvd_flag, base, parent_key)

    def close(self) -> None:
        """Unregister (kvd drains the pool's transfers first), then free the flag words."""
        try:
            self.client.unregister_pool(self.pool_id)
        finally:
            self.host.free(self.flags)
