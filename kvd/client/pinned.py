"""A Get's blocks left in place: read-only views of the daemon's arena under a lease.

`Client.get_numpy` copies the blocks out of the arena into the caller's
array. An engine that moves them on by itself (an upload to the GPU from
the pinned arena, a copy into its own paged cache) does not need that copy:
`Client.get_pinned` answers with the blocks where the daemon put them, and
the lease keeps the slots from being reused until `release()` (or the end
of a `with` block), or until the lease expires (the client's `lease_ms`,
else the daemon's default). This is the same hand-over vLLM's connector
makes internally; a restore from disk then costs the reads and nothing else.

    with client.get_pinned(ns, keys) as held:
        for i in range(held.matched):
            upload(held.block(i))          # (num_layers, 2, ...) view, read-only
        # or: held.copy_to(out)            # one gather, as get_numpy does

The views stay mapped after release, but what they show is then no longer
this block: never read them after release.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvd.client._wire import ArenaMapping, Namespace, blocks_to_output, copy_rows, output_rows
from kvd.errors import FailedPrecondition


class PinnedBlocks:
    def __init__(self, namespace: Namespace, arena: ArenaMapping, matched: int, offsets, lease_id: int,
                 release: Callable[[list[int]], None]) -> None:
        self.namespace = namespace
        self.matched = matched
        self.offsets = tuple(offsets[:matched])  # where each block is, in bytes from the arena's start
        self.lease_id = lease_id
        self._release = release
        self._released = False
        self._slots = arena.slot_indices(self.offsets, namespace.block_bytes)
        self._rows = arena.rows(arena.stride(namespace.block_bytes))

    def _check(self) -> None:
        if self._released:
            raise FailedPrecondition("these blocks were released; their slots may hold other blocks now")

    def block(self, index: int) -> np.ndarray:
        """Block `index` (0 <= index < matched) as a read-only (*block_shape) array in the arena."""
        self._check()
        if not 0 <= index < self.matched:
            raise IndexError(f"block {index} of {self.matched} pinned")
        row = self._rows[self._slots[index], :self.namespace.block_bytes]
        view = row.view(self.namespace.numpy_dtype).reshape(self.namespace.spec.block_shape)
        view.flags.writeable = False  # a write here would change what the daemon serves
        return view

    def copy_to(self, out: np.ndarray | None = None) -> np.ndarray:
        """The blocks copied out, as get_numpy returns them (into `out` if given)."""
        self._check()
        rows = output_rows(self.namespace, self.matched, out)
        copy_rows(self._rows, self._slots, rows, 0, self.namespace.block_bytes)
        return blocks_to_output(self.namespace, rows, self.matched)

    def release(self) -> None:
        """Give the slots back (once; later calls do nothing)."""
        if not self._released:
            self._released = True
            if self.lease_id:
                self._release([self.lease_id])

    def __enter__(self) -> PinnedBlocks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()
