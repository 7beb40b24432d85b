"""The connector's side of kvd's shared-memory protocol, without copies.

The client library's put/get copy between a caller's array and the arena.
A connector copies between the engine's paged KV cache and the arena
itself, one layer at a time, so it needs the protocol's steps apart:
reserve slots (then write layers into them, then commit), and a
layer-streaming Get whose progress a model layer can wait on (then read
layers out of the pinned slots, then release). This module is those steps
on top of kvd.client.Client; it never touches the engine's tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np

from kvd.client import Client, Namespace
from kvd.client import _ops, _writes
from kvd.client._wire import reserved_run
from kvd.core.keys import NamespaceSpec
from kvd.v1 import kvd_pb2

T = TypeVar("T")


class Unavailable(Exception):
    """kvd could not do what the connector asked (daemon down, arena gone, ...)."""


def unregistered(error: BaseException) -> bool:
    """Whether a call failed because the daemon does not know the namespace
    (it restarted without a disk tier, or was down when the engine started)."""
    return (isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.NOT_FOUND
            and "is not registered" in (error.details() or ""))


def local_namespace(spec: NamespaceSpec) -> Namespace:
    """The namespace as the daemon will name it (ids are digests of the spec), without asking it."""
    return Namespace(spec, spec.namespace_id(), spec.block_bytes, spec.layer_bytes)


def registering(client: Client, namespace: Namespace, call: Callable[[], T]) -> T:
    """call(), made again once after registering the namespace if the daemon did not know it."""
    try:
        return call()
    except grpc.RpcError as error:
        if not unregistered(error):
            raise
    client.register_namespace(namespace.spec)
    return call()


@dataclass(slots=True)
class Reservation:
    """Slots reserved for keys[start:stop] of one chain, to be filled and committed."""

    lease_id: int
    start: int
    stop: int
    slots: np.ndarray  # arena slot index of each reserved key, in order


class Link:
    """One kvd client used by a connector, with the arena it requires."""

    def __init__(self, target: str, token: str | None, timeout_s: float) -> None:
        self.client = Client(target, token=token, timeout_s=timeout_s, use_shared_memory=True)

    def close(self) -> None:
        self.client.close()

    @property
    def arena(self):
        arena = self.client.session.arena
        if arena is None:
            raise Unavailable("the daemon's shared-memory arena is not mapped")
        return arena

    def connect(self) -> None:
        self.client._run(_ops.connect(self.client.session))

    def reserve(self, namespace: Namespace, keys: Sequence[bytes]) -> Reservation | None:
        """Reserve the keys of a chain from its root; None when nothing needs writing."""
        self.connect()
        response = registering(self.client, namespace,
                               lambda: self.client._run(_writes.reserve(self.client.session, namespace, keys)))
        if response is None:
            raise Unavailable("the daemon restarted and its new arena could not be mapped")
        start, stop = reserved_run(response.statuses)
        if start == stop:
            return None
        slots = self.arena.slot_indices(response.offsets[start:stop], namespace.block_bytes)
        return Reservation(response.lease_id, start, stop, slots)

    def commit(self, namespace: Namespace, lease_id: int) -> None:
        self.client._run(_writes.commit(self.client.session, namespace, lease_id, kvd_pb2.ACK_HOST))

    def release(self, lease_ids: list[int]) -> None:
        if lease_ids:
            self.client._run(_ops.release(self.client.session, lease_ids))

    def open_layers(self, namespace: Namespace, chain: Sequence[bytes], first: int,
                    on_ready: Callable[[int, int], None] | None = None) -> LayerStream:
        """Start a layer-streaming Get of chain[first:] (`chain` runs from the root).

        The first message (which blocks are served, and where) is awaited
        here, so that a daemon that restarted since the arena was mapped is
        noticed and the new arena mapped before any byte is read (and the
        namespace registered again if the new daemon does not know it).
        on_ready(before, after): told, from the stream's reader, when layers
        [before, after) landed (the timeline)."""
        session = self.client.session
        self.connect()
        for attempt in range(3):
            request = kvd_pb2.GetRequest(
                namespace_id=namespace.namespace_id,
                client_id=session.client_id,
                keys=chain[first:],
                parent_key=chain[first - 1] if first else b"",
                lease_ms=session.lease_ms,
                arena_instance_id=self.arena.instance_id,
            )
            call = self.client._stub.GetLayers(request, timeout=self.client.timeout_s, metadata=self.client._metadata)
            try:
                return LayerStream(self, call, next(call), namespace, on_ready)
            except grpc.RpcError as error:
                if attempt == 2:
                    raise
                if _ops.arena_changed(error):
                    self.client._run(_ops.remap(session))
                elif unregistered(error):
                    self.client.register_namespace(namespace.spec)
                else:
                    raise
        raise AssertionError("unreachable")


class LayerStream:
    """Progress of one layer-streaming Get, fed by a reader thread.

    `wait(layer)` blocks until that layer of every served block is in the
    arena, or the stream has failed. `matched` only shrinks (a block read
    from disk that fails its checksum ends the servable prefix there).
    """

    def __init__(self, link: Link, call, first, namespace: Namespace,
                 on_ready: Callable[[int, int], None] | None = None) -> None:
        self._link = link
        self._on_ready = on_ready
        if on_ready is not None and first.layers_ready:
            on_ready(0, first.layers_ready)
        self._call = call
        self._layers = namespace.spec.num_layers
        self._ready = first.layers_ready
        self._changed = threading.Condition()
        self.matched = first.matched
        # Why `matched` is short (kvd.v1.GetCut): GET_CUT_CORRUPT is damage, not a miss.
        self.cut = first.cut
        self.slots = link.arena.slot_indices(first.offsets, namespace.block_bytes)
        self.lease_id = first.lease_id
        self.error: str | None = None
        self.timed_out = False  # the error is a wait's timeout, not the stream's own failure
        self._closing = False
        self._ended = threading.Event()
        self._thread = threading.Thread(target=self._read, name="kvd-layers", daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self._call:
                with self._changed:
                    before = self._ready
                    self.matched = min(self.matched, message.matched)
                    self.cut = message.cut or self.cut
                    self._ready = max(self._ready, message.layers_ready)
                    self._changed.notify_all()
                if self._on_ready is not None and self._ready > before:
                    self._on_ready(before, self._ready)
            if self._ready < self._layers:
                self._fail("the stream ended before every layer landed")
        except grpc.RpcError as error:
            self._fail(f"{error.code().name}: {error.details()}")
        except Exception as error:  # noqa: BLE001 - any failure is a failed load, never a crash
            self._fail(repr(error))
        finally:
            self._ended.set()

    def wait_end(self, timeout_s: float) -> bool:
        """Until the daemon ended the stream (its last message says why `matched` is short)."""
        return self._ended.wait(timeout_s)

    def _fail(self, why: str) -> None:
        with self._changed:
            if self.error is None and not self._closing:
                self.error = why
            self._changed.notify_all()

    def wait(self, layer: int, timeout_s: float) -> bool:
        """Whether `layer` landed for the first `matched` blocks (False: failed or timed out)."""
        with self._changed:
            landed = self._changed.wait_for(lambda: self.error is not None or self._ready > layer, timeout_s)
            if not landed and self.error is None:
                self.error = f"layer {layer} did not land within {timeout_s} s"
                self.timed_out = True
            return self.error is None

    def close(self) -> None:
        """End the stream and release its lease (the pinned slots)."""
        with self._changed:
            self._closing = True  # the cancellation below is not a failure
        self._call.cancel()
        self._thread.join()
        try:
            self._link.release([self.lease_id] if self.lease_id else [])
        except grpc.RpcError:
            pass  # the lease expires on its own
