"""The engine's side of a pool's I/O ring: publish the reads a LoadLayers granted, wait per layer.

    pool = DevicePool(client, namespace, device, layers, num_blocks, arena_socket=path, io_ring=True)
    response = pool.load(keys, pages, kvd_flag=KVD, base=base)
    reads = pool.ring_reads(response)      # None when no block came from disk
    reads.publish()                        # every layer's reads (or publish(layer) before each layer)
    ... before attention of layer l: pool.flag(KVD) > base + l  (blocks kvd copied from host memory)
    result = reads.wait(l, timeout_s=5)     # OK, FAILED (recompute the blocks), or TIMEOUT
    reads.settle(timeout_s=30)             # a load that ended early: before the pages are reused

On a GPU the submit and wait kernels do the same from the engine's stream (kvd.device.cuda_ring);
here the host publishes with the submit kernel's own reserve and publish (io_ring_publish) and
waits with the wait kernel's own code (RingMemory.wait). Counts on the ring are since it was laid
out, so the pool keeps, per layer, how many reads it has published and how many had failed: a
wait is for this load's count, and a failure before its publish is not its own.
"""

from __future__ import annotations

import threading

import numpy as np

from kvd.device.io_ring import READ_FIELDS, RingMemory, WaitResult

WAIT_SLOTS = 256  # the ring's wait records one pool hands out in turn (of IO_RING_WAITS)


class RingCounts:
    """Per layer: reads this engine published on the ring so far (the ring's counts are
    cumulative); shared by the pool's loads, which may run on several threads."""

    def __init__(self, ring: RingMemory) -> None:
        self.ring = ring
        self.published = np.zeros(ring.layers, dtype=np.int64)
        self._slot = 0
        self._lock = threading.Lock()

    def publish(self, rows: np.ndarray, layer: int, *, timeout_s: float) -> tuple[int, int]:
        """Publishes one layer's rows: (the layer's count once they are done, its failures before)."""
        with self._lock:
            failed_before = self.ring.failed(layer) + self.ring.abandoned(layer)
            self.ring.publish(rows, timeout_s=timeout_s)
            self.published[layer] += len(rows)
            return int(self.published[layer]), failed_before

    def slot(self) -> int:
        with self._lock:
            self._slot = (self._slot + 1) % WAIT_SLOTS
            return self._slot


class RingReads:
    """The reads one LoadLayers granted (its ring_reads, layer-major), to publish and wait on."""

    def __init__(self, counts: RingCounts, ring_reads: bytes, blocks: int) -> None:
        rows = np.frombuffer(ring_reads, dtype="<u8").reshape(-1, len(READ_FIELDS))
        layers = counts.ring.layers
        if blocks <= 0 or len(rows) != blocks * layers:
            raise ValueError(f"{len(rows)} ring reads for {blocks} blocks of {layers} layers")
        self.counts = counts
        self.rows = rows.reshape(layers, blocks, len(READ_FIELDS))
        self.blocks = blocks
        self._until: dict[int, tuple[int, int]] = {}  # layer -> (count when done, failures before)

    def publish(self, layer: int | None = None, *, timeout_s: float = 5.0) -> None:
        """Publishes one layer's reads, or every layer's not yet published."""
        layers = range(len(self.rows)) if layer is None else [layer]
        for each in layers:
            if each not in self._until:
                self._until[each] = self.counts.publish(self.rows[each], each, timeout_s=timeout_s)

    def wait(self, layer: int, *, timeout_s: float) -> WaitResult:
        """Until this load's reads of `layer` are all in the pages (OK), one failed (FAILED: the
        blocks are not loaded; recompute them), or `timeout_s` passes (TIMEOUT)."""
        self.publish(layer)
        until, failed_before = self._until[layer]
        return self.counts.ring.wait(layer, until, timeout_s=timeout_s, failed_before=failed_before,
                                     slot=self.counts.slot())

    def settle(self, *, timeout_s: float) -> bool:
        """Waits until no read of this load is in flight any more, failed or not (after a wait that
        ended early: the pages must not be reused before); whether that happened in time."""
        return all(self.counts.ring.settle(layer, until, timeout_s=timeout_s, slot=self.counts.slot()).ok
                   for layer, (until, _) in sorted(self._until.items()))
