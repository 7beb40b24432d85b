"""Blocks in place in the daemon's arena, under a lease: a Get's (read-only) and a Put's (to fill).

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

The other way round, `Client.reserve` gives a Put's slots to fill in place
(a download from the GPU straight into the arena), then `commit`:

    with client.reserve(ns, keys) as slots:
        for i in range(slots.start, slots.stop):   # the run of keys this call writes
            download(into=slots.block(i))
        slots.commit(durable=True)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kvd.client import _ops, _writes
from kvd.client._wire import ArenaMapping, Namespace, as_rows, blocks_to_output, copy_rows, output_rows, reserved_run
from kvd.errors import FailedPrecondition
from kvd.v1 import kvd_pb2


def _block_view(namespace: Namespace, rows: np.ndarray, slot: int) -> np.ndarray:
    """The block in arena row `slot` as a (*block_shape) array of the namespace dtype (a view)."""
    return rows[slot, :namespace.block_bytes].view(namespace.numpy_dtype).reshape(namespace.spec.block_shape)


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
        view = _block_view(self.namespace, self._rows, self._slots[index])
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


class ReservedBlocks:
    """A Reserve's slots for `keys`, filled by the caller: keys[start:stop] are this call's to
    write (the statuses say why the others are not: already stored, another writer, no slot)."""

    def __init__(self, run: Callable, session, namespace: Namespace, keys, parent_key: bytes,
                 response: kvd_pb2.ReserveResponse) -> None:
        self._run = run
        self._session = session
        self.namespace = namespace
        self.keys = list(keys)
        self.parent_key = parent_key
        self._response = response
        self.statuses = tuple(response.statuses)
        self.start, self.stop = reserved_run(self.statuses)
        arena: ArenaMapping = session.arena
        self._slots = arena.slot_indices(response.offsets[self.start:self.stop], namespace.block_bytes)
        self._rows = arena.rows(arena.stride(namespace.block_bytes))
        self._arena = arena
        self._done = False

    def _check(self) -> None:
        if self._done:
            raise FailedPrecondition("these slots were committed or released already")

    def block(self, index: int) -> np.ndarray:
        """The slot for keys[index] (start <= index < stop) as a writable (*block_shape) array."""
        self._check()
        if not self.start <= index < self.stop:
            raise IndexError(f"keys[{index}] is not in the reserved run [{self.start}, {self.stop})")
        return _block_view(self.namespace, self._rows, self._slots[index - self.start])

    def fill(self, blocks) -> None:
        """Copy blocks (one per key, as put takes them) of the reserved run into its slots."""
        self._check()
        rows = as_rows(self.namespace, blocks, len(self.keys))
        if self.start < self.stop:
            self._arena.scatter(rows[self.start:self.stop], self._response.offsets[self.start:self.stop])

    def commit(self, durable: bool = False) -> int:
        """Store the reserved run as filled; how many blocks that wrote. durable: as put(durable=True),
        return once every key is durable on disk, else NotDurableError (the slots are then gone)."""
        op, finish = self._commit_steps(durable)
        return finish(None if op is None else self._run(op))

    def release(self) -> None:
        """Give the slots back unwritten (once; nothing after a commit)."""
        op = self._release_op()
        if op is not None:
            self._run(op)

    def _commit_steps(self, durable: bool) -> tuple[_ops.Op | None, Callable[[object], int]]:
        """The commit's call (None: nothing to send) and what makes its answer commit's result."""
        self._check()
        self._done = True
        if durable:
            def written(answer) -> int:
                count, statuses = answer
                _writes.check_all_stored(statuses)
                return count

            return _writes.commit_durable(self._session, self.namespace, self.keys, self.parent_key, self._response,
                                          self.start, self.stop), written
        count = self.stop - self.start
        if count == 0:
            return None, lambda answer: 0
        return _writes.commit(self._session, self.namespace, self._response.lease_id, kvd_pb2.ACK_HOST), \
            lambda answer: count

    def _release_op(self) -> _ops.Op | None:
        if self._done:
            return None
        self._done = True
        return _ops.release(self._session, [self._response.lease_id]) if self._response.lease_id else None

    def __enter__(self) -> ReservedBlocks:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


class _AsyncHeld:
    """`async with` for the AsyncClient's holds (its release is awaited); a plain `with` is refused,
    since its exit could never await the release."""

    def __enter__(self):
        raise TypeError(f"{type(self).__name__} is held with `async with` (its release is awaited)")

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.release()


class AsyncPinnedBlocks(_AsyncHeld, PinnedBlocks):
    """PinnedBlocks of kvd.client.AsyncClient: `async with`, and `await release()`."""

    async def release(self) -> None:
        if not self._released:
            self._released = True
            if self.lease_id:
                await self._release([self.lease_id])


class AsyncReservedBlocks(_AsyncHeld, ReservedBlocks):
    """ReservedBlocks of kvd.client.AsyncClient: `async with`, and `await commit()` / `await release()`."""

    async def commit(self, durable: bool = False) -> int:
        op, finish = self._commit_steps(durable)
        return finish(None if op is None else await self._run(op))

    async def release(self) -> None:
        op = self._release_op()
        if op is not None:
            await self._run(op)
