"""The worker half of the vLLM connector: bytes between the paged KV cache and kvd.

Per step (vLLM's call order): `start` opens a layer-streaming Get for each
synchronous load, hands asynchronous loads to a thread and reserves arena
slots for the step's saves; each attention layer calls `wait_layer` on
entry (that layer of the loaded blocks must be in the engine's blocks)
and `save_layer` on exit (that layer of the new full blocks goes to the
reserved slots); `finish_step` commits the saves and ends the loads.

Each copy is one call per layer part for all the step's requests together
(kvd.connectors.vllm.copies); nothing loops over blocks in Python. With a
CPU engine the copies run on the worker's copy thread: every layer's load
is queued at `start` and copied as soon as it lands, so `wait_layer` waits
only for what the earlier layers' compute did not hide, and `finish_step`
waits for the saves' copies before committing them. A load that fails
in any way (a miss, a block that failed its checksum, the daemon gone)
reports its engine block ids, so vLLM recomputes them; the saves of a
request whose load failed in the same step are aborted, since their
source blocks may hold garbage.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
import torch

from kvd.client import Namespace
from kvd.connectors.vllm.config import ConnectorConfig
from kvd.connectors.vllm.copies import copy_layer, native_copies, off_the_model_cores
from kvd.connectors.vllm.layout import PagedLayout
from kvd.connectors.vllm.logs import log
from kvd.connectors.vllm.metadata import NULL_BLOCK, KvdConnectorMetadata, LoadOrder, SaveOrder
from kvd.connectors.vllm.stats import Counters
from kvd.connectors.vllm.timeline import Timeline
from kvd.connectors.vllm.transfer import LayerStream, Link, Reservation, Unavailable
from kvd.v1 import kvd_pb2

# Why kvd served less, in a log line (kvd.v1.GetCut; NONE: evicted or deleted since the Lookup).
_CUT_REASONS = {
    kvd_pb2.GET_CUT_CORRUPT: "kvd found the first of them corrupt on disk (failed its checksum) and dropped it",
    kvd_pb2.GET_CUT_UNREADABLE: "the drive could not read the first of them; kvd dropped it",
    kvd_pb2.GET_CUT_NO_ROOM: "kvd's host memory had no free slot for them",
    kvd_pb2.GET_CUT_KEPT_BELOW: "kvd keeps them below host memory",
}


@dataclass(slots=True)
class _Load:
    order: LoadOrder
    stream: LayerStream | None
    error: str | None = None
    deadline: float | None = None  # time.monotonic() past which the load is cut (order.budget_s)

    @property
    def failed(self) -> bool:
        return self.stream is None or self.stream.error is not None or self.error is not None

    @property
    def cut(self) -> int:
        """Why kvd served fewer blocks than were asked for (kvd.v1.GetCut)."""
        return self.stream.cut if self.stream is not None else kvd_pb2.GET_CUT_NONE


@dataclass(slots=True)
class _Save:
    order: SaveOrder
    reserving: concurrent.futures.Future
    reservation: Reservation | None = None


@dataclass
class _Step:
    loads: list[_Load] = field(default_factory=list)
    saves: list[_Save] = field(default_factory=list)
    # per KV cache group, (arena slot, engine block) index pairs of this step's saves, built at layer 0
    save_index: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None
    # on the copy thread (a CPU engine): each layer's load into the engine, and the saves' copies out
    landing: list[concurrent.futures.Future] = field(default_factory=list)
    copies_out: list[concurrent.futures.Future] = field(default_factory=list)

    def drain(self) -> None:
        """Until the copy thread is done with this step (a copy's exception is raised here)."""
        for copy in (*self.landing, *self.copies_out):
            copy.result()


def _pair(slots: list[np.ndarray], blocks: list[list[int]], windowed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tensors of (arena slot, engine block) pairs; a windowed group's pairs without vLLM's null
    block (positions its window has left: nothing there to load)."""
    slot_index = torch.from_numpy(np.concatenate(slots).astype(np.int64)) if slots else torch.empty(0, dtype=torch.int64)
    block_index = torch.tensor([block for run in blocks for block in run], dtype=torch.int64)
    if windowed:
        keep = block_index != NULL_BLOCK
        slot_index, block_index = slot_index[keep], block_index[keep]
    return slot_index, block_index


class WorkerSide:
    def __init__(self, config: ConnectorConfig, layout: PagedLayout, namespace: Namespace, shard: int) -> None:
        self.config = config
        self.layout = layout
        self.namespace = namespace
        self.shard = shard
        self.layer_of = layout.index_of()
        self.groups = layout.groups.count if layout.groups is not None else 1
        self.windowed = layout.groups.windowed if layout.groups is not None else frozenset()
        self.link = Link(config.target, config.token, config.timeout_s)
        try:
            self.link.connect()
        except (grpc.RpcError, OSError) as error:  # vLLM starts anyway; kvd is dialled again at each step
            log.warning("kvd: the daemon at %s does not answer yet (%s); requests miss until it does",
                        config.target, error)
        self.counters = Counters()
        self.timeline = Timeline(config.timeline, f"worker{shard}")
        self.totals: dict[str, float] = {}  # every count since the start (tests, logs)
        self._pool = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kvd-connector")
        # A CPU engine's copies run on their own thread, overlapping the layers' compute; a GPU's are
        # queued on the engine's stream by the model's thread.
        self._copier = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvd-copy",
                                                              initializer=off_the_model_cores)
                        if not layout.parts[0][0].is_cuda and native_copies() else None)
        self._step = _Step()
        self._lock = threading.Lock()
        self._errors: set[int] = set()
        self._received: set[str] = set()
        self._pin_arena = layout.parts[0][0].is_cuda  # never run: no GPU here

    # ---- the arena as torch, rebuilt when the daemon restarted and the client remapped
    def _arena(self) -> torch.Tensor:
        """The arena's slots of this namespace's size class as rows of the layout's
        word (slot sizes are multiples of 4 KiB), page-locked for the GPU where the cache is on one."""
        arena = self.link.arena
        if self._pin_arena:
            self._pin(arena)
        return torch.from_numpy(arena.rows(arena.stride(self.namespace.block_bytes))).view(self.layout.word)

    def _pin(self, arena) -> None:
        """cudaHostRegister the arena's mapping once (again after a daemon restart remapped it), so the
        per-layer copies to and from the GPU are DMA; unpinned copies still work, staged by CUDA."""
        from kvd.device import open_device
        from kvd.device.api import DeviceError

        try:
            arena.pin(open_device("cuda", self.layout.parts[0][0].device.index or 0))
        except DeviceError as error:
            self._pin_arena = False
            log.warning("kvd: the arena could not be page-locked for the GPU (%s); copies go through "
                        "pageable memory (raise LimitMEMLOCK, see docs/operations.md)", error)

    # ---- step start
    def start(self, metadata: KvdConnectorMetadata) -> None:
        step = _Step()
        self.timeline.begin_step()
        for order in metadata.loads:
            if order.asynchronous:
                self._pool.submit(self._load_whole, order)
            else:
                step.loads.append(self._open(order))
        for order in metadata.saves:
            step.saves.append(_Save(order, self._pool.submit(self._reserve, order)))
        if step.loads and self._copier is not None:
            step.landing = [self._copier.submit(self._load_layer, step, layer) for layer in range(len(self.layout.parts))]
        self._step = step

    def _open(self, order: LoadOrder) -> _Load:
        keys = order.keys[self.shard]
        deadline = None if order.budget_s is None else time.monotonic() + order.budget_s
        try:
            with self.timeline.span("open"):
                stream = self.link.open_layers(self.namespace, keys, order.first, on_ready=self._landing)
        except (grpc.RpcError, Unavailable, OSError) as error:
            return _Load(order, None, f"could not start the load: {error}")
        return _Load(order, stream, deadline=deadline)

    def _landing(self, before: int, after: int) -> None:
        for layer in range(before, after):
            self.timeline.mark("landed", layer)

    def _landed(self, load: _Load, layer: int) -> bool:
        """Waits for the layer within load_timeout_s and the load's budget; a load past its budget
        is cut (its blocks are computed: loading them can no longer be sooner)."""
        remaining = None if load.deadline is None else max(load.deadline - time.monotonic(), 0.0)
        budgeted = remaining is not None and remaining < self.config.load_timeout_s
        if load.stream.wait(layer, remaining if budgeted else self.config.load_timeout_s):
            return True
        if budgeted and load.stream.timed_out:
            load.error = (f"cut: layer {layer} had not landed within the load's budget of "
                          f"{load.order.budget_s:.3f} s, past which computing the blocks is sooner")
            self.counters.add(cut_loads=1)
        return False

    def _reserve(self, order: SaveOrder) -> Reservation | None:
        return self.link.reserve(self.namespace, order.keys[self.shard])

    # ---- per layer
    def wait_layer(self, layer_name: str) -> None:
        layer = self.layer_of.get(layer_name)
        step = self._step
        if layer is None or not step.loads:
            return
        started = time.perf_counter()
        with self.timeline.span("wait", layer):
            if step.landing:
                step.landing[layer].result()
            else:
                self._load_layer(step, layer)
        self.counters.add(load_wait_s=time.perf_counter() - started)

    def _load_layer(self, step: _Step, layer: int) -> None:
        """Waits for the layer of each of the step's loads, then copies it into the engine."""
        group = self.layout.group_of(layer)
        slots, blocks = [], []
        for load in step.loads:
            if load.failed:
                continue
            if not self._landed(load, layer):
                continue
            matched = min(load.stream.matched, len(load.order.block_ids[group]))
            slots.append(load.stream.slots[:matched])
            blocks.append(load.order.block_ids[group][:matched])
        if slots:
            with self.timeline.span("copy_in", layer):
                self._copy(layer, *_pair(slots, blocks, group in self.windowed), into_engine=True)

    def save_layer(self, layer_name: str) -> None:
        layer = self.layer_of.get(layer_name)
        step = self._step
        if layer is None or not step.saves:
            return
        if self._copier is not None:  # the reservation is waited for there too, not on the model's thread
            step.copies_out.append(self._copier.submit(self._save_layer, step, layer))
        else:
            self._save_layer(step, layer)

    def _save_layer(self, step: _Step, layer: int) -> None:
        if step.save_index is None:
            with self.timeline.span("reserve"):
                step.save_index = self._save_index(step)
        slots, blocks = step.save_index[self.layout.group_of(layer)]
        if slots.numel():
            with self.timeline.span("save", layer):
                self._copy(layer, slots, blocks, into_engine=False)

    def _save_index(self, step: _Step) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        slots, blocks = [], [[] for _ in range(self.groups)]
        for save in step.saves:
            try:
                save.reservation = save.reserving.result()
            except (grpc.RpcError, Unavailable, OSError) as error:
                self.counters.add(save_errors=1)
                why = f"{error.code().name}: {error.details()}" if isinstance(error, grpc.RpcError) else error
                log.warning("kvd: reserving slots for %s failed (%s); its blocks are not stored", save.order.req_id, why)
                continue
            if save.reservation is not None and not self._unsaveable(save):
                reservation = save.reservation
                slots.append(reservation.slots)
                for group, ids in zip(blocks, save.order.block_ids, strict=True):
                    group.append(ids[reservation.start:reservation.stop])
        return {group: _pair(slots, ids) for group, ids in enumerate(blocks)}

    def _unsaveable(self, save: _Save) -> bool:
        """A reservation that takes in a position some windowed group no longer holds (kvd lost an
        old block the window has left) cannot be filled: it is given back, nothing of it stored."""
        reservation = save.reservation
        if not any(NULL_BLOCK in save.order.block_ids[group][reservation.start:reservation.stop]
                   for group in self.windowed):
            return False
        log.debug("kvd: %s's blocks %d-%d are not stored: the sliding window has left some of them",
                  save.order.req_id, reservation.start, reservation.stop - 1)
        self._abort(reservation.lease_id)
        save.reservation = None
        return True

    def _copy(self, layer: int, slots: torch.Tensor, blocks: torch.Tensor, *, into_engine: bool) -> None:
        """One layer of many blocks between the arena and the engine (kvd.connectors.vllm.copies)."""
        copy_layer(self._arena(), self.layout, layer, slots, blocks, into_engine=into_engine)

    # ---- step end
    def finish_step(self) -> None:
        step, self._step = self._step, _Step()
        if not (step.loads or step.saves):
            return
        with self.timeline.span("drain"):
            step.drain()
        with self.timeline.span("close"):
            failed_requests = self._end_loads(step.loads)
        with self.timeline.span("commit"):
            self._commit(step.saves, failed_requests)
        self.timeline.end_step()

    def _commit(self, saves: list[_Save], failed_requests: set[str]) -> None:
        for save in saves:
            if save.reservation is None:
                continue
            if save.order.req_id in failed_requests:
                self._abort(save.reservation.lease_id)
                continue
            try:
                self.link.commit(self.namespace, save.reservation.lease_id)
                self._count_saved(save.reservation.stop - save.reservation.start)
            except grpc.RpcError as error:
                self.counters.add(save_errors=1)
                log.warning("kvd: committing %s failed: %s", save.order.req_id, error.details())

    def _end_loads(self, loads: list[_Load]) -> set[str]:
        failed: set[str] = set()
        for load in loads:
            lost = self._lost(load)
            if lost and not load.failed:
                load.stream.wait_end(self.config.load_timeout_s)  # its last message says why
            if load.stream is not None:
                load.stream.close()
            if lost:
                failed.add(load.order.req_id)
                self._report(lost, load)
            self._count_load(load.order, len(lost))
        return failed

    def _count_load(self, order, lost: int) -> None:
        """A load is over: its blocks and tokens counted, its outcome logged (debug)."""
        tokens = self.namespace.spec.block_tokens
        loaded = len(order.block_ids[0]) - lost
        self.counters.add(loaded_blocks=loaded, loaded_tokens=loaded * tokens)
        log.debug("kvd: %s loaded %d of %d blocks (%d tokens) from kvd", order.req_id, loaded,
                  len(order.block_ids[0]), loaded * tokens)

    def _count_saved(self, blocks: int) -> None:
        self.counters.add(saved_blocks=blocks, saved_tokens=blocks * self.namespace.spec.block_tokens)

    def _lost(self, load: _Load) -> list[int]:
        """Positions of a load that did not get every layer."""
        if load.failed:
            return list(range(len(load.order.block_ids[0])))
        return list(range(load.stream.matched, len(load.order.block_ids[0])))

    def _engine_blocks(self, order: LoadOrder, positions: list[int]) -> set[int]:
        """The engine blocks, in every KV cache group, of those positions of a load (vLLM recomputes them)."""
        return {ids[position] for ids in order.block_ids for position in positions} - (
            {NULL_BLOCK} if self.windowed else set())

    def _report(self, lost: list[int], load: _Load) -> None:
        why = load.error or (load.stream.error if load.stream else None) or _CUT_REASONS.get(
            load.cut, "blocks missing from kvd")
        log.warning("kvd: %d blocks of %s could not be loaded (%s); vLLM recomputes them",
                    len(lost), load.order.req_id, why)
        self.counters.add(load_errors=len(lost), recomputed_tokens=len(lost) * self.namespace.spec.block_tokens)
        if load.error is None and load.cut == kvd_pb2.GET_CUT_CORRUPT:
            self.counters.add(corrupt_blocks=len(lost))
        with self._lock:
            self._errors.update(self._engine_blocks(load.order, lost))

    def _abort(self, lease_id: int) -> None:
        try:
            self.link.release([lease_id])
        except grpc.RpcError:
            pass  # the reservation expires on its own

    # ---- asynchronous loads (prefixes that had to come from disk)
    def _load_whole(self, order: LoadOrder) -> None:
        self.counters.add(async_loads=1)
        load = self._open(order)
        try:
            if not load.failed:
                if self._landed(load, len(self.layout.parts) - 1):
                    matched = min(load.stream.matched, len(order.block_ids[0]))
                    index = {group: _pair([load.stream.slots[:matched]], [ids[:matched]], group in self.windowed)
                             for group, ids in enumerate(order.block_ids)}
                    for layer in range(len(self.layout.parts)):
                        self._copy(layer, *index[self.layout.group_of(layer)], into_engine=True)
                    self._copies_landed()
            self._end_loads([load])
        except Exception as error:  # noqa: BLE001 - a failed load is recomputed, never a crash
            load.error = repr(error)
            self._report(list(range(len(order.block_ids[0]))), load)
        finally:
            with self._lock:
                self._received.add(order.req_id)

    def _copies_landed(self) -> None:
        """Wait until this thread's copies into the engine's pages have run. On a GPU the scatter
        (an index_put on this thread's current stream) is still queued when the call returns, and
        the request is reported received (so vLLM schedules its forward on its own stream) next."""
        first = self.layout.parts[0][0]
        if first.is_cuda:
            torch.cuda.current_stream(first.device).synchronize()

    def finished(self) -> tuple[set[str] | None, set[str] | None]:
        with self._lock:
            received, self._received = self._received, set()
        return None, received or None

    def load_errors(self) -> set[int]:
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    def close(self) -> None:
        if self._copier is not None:
            self._copier.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        self.link.close()
