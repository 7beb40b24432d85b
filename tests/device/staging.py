"""A registered host buffer through which tests write and read any device's memory."""

from __future__ import annotations

import weakref

import numpy as np


class Staging:
    """A registered host buffer: how a test writes and reads any device's memory. Its registration is
    released when the buffer is (a registration that outlived its memory makes the device refuse any
    later registration of those addresses)."""

    def __init__(self, device, nbytes: int) -> None:
        self.host = np.zeros(nbytes, dtype=np.uint8)
        self.memory = device.register_host(self.host.ctypes.data, nbytes)
        # The finalizer holds the array too: it is freed only after its registration is gone.
        self.close = weakref.finalize(self, _release, device, self.memory, self.host)

    def put(self, stream, memory, offset: int, data: np.ndarray) -> None:
        self.host[:len(data)] = data
        stream.copy_blocks(memory, [offset], self.memory, [0], len(data))
        stream.synchronize(timeout_s=20)

    def get(self, stream, memory, offset: int, nbytes: int) -> np.ndarray:
        stream.copy_blocks(self.memory, [0], memory, [offset], nbytes)
        stream.synchronize(timeout_s=20)
        return self.host[:nbytes].copy()


def _release(device, memory, _host: np.ndarray) -> None:
    device.unregister_host(memory)
