"""The worker half on kvd's device plane (transfer = "daemon"): kvd moves the bytes itself.

The engine's KV tensors are registered once with kvd as a pool
(RegisterPool): on a GPU host their CUDA IPC handles, on a CPU host a
descriptor of the engine's own memory passed over the arena socket
(kvd.device.cpu). From then on the connector makes no copies of its own:

- a save is one SaveLayers per request, started with the step; kvd copies
  layer l of its pages as soon as the engine's flag word says layer l is
  written, which `save_layer` stores after each attention layer, from the
  engine's own stream (cuStreamWriteValue64 behind the layer's kernels on a
  GPU), so the mark never runs ahead of the writes it stands for. A request
  that also loads in this step is saved only once its load has landed (a
  failed load must not leave computed-on-garbage blocks in kvd), after the
  forward pass;
- a load is one LoadLayers per request into its pages, each with a flag
  word of its own that kvd advances per layer; `wait_layer` waits on it
  before the layer's attention (the worker thread polls it; on a GPU the
  engine's stream could wait with cuStreamWaitValue64 instead);
- `finish_step` waits for the saves (the pages may be reused after it) and
  reports blocks that did not arrive, which vLLM recomputes.

Flag word values only grow: every transfer takes a fresh base from one
counter, and a word is handed to the next load only once kvd is done with
it. kvd marks a failed transfer's word FAILED | done, so no wait hangs.

Each load also has a cancel word (LoadLayersRequest.cancel_flag). A load
past its budget (LoadOrder.budget_s: computing its blocks is sooner now),
or one whose layer did not land within load_timeout_s, is cancelled: the
worker stores the load's base there and waits until kvd says it is done
with the pages (FAILED, after the copies it had issued landed; or every
layer, if they all landed meanwhile) before it hands them back to vLLM to
recompute, so kvd never writes a page vLLM has given to other work.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field

import grpc
import torch

from kvd.arena_protocol import socket_path_for_target
from kvd.client.device import FAILED, DevicePool
from kvd.client.ring_loads import RingReads
from kvd.connectors.vllm.layout import PagedLayout, UnsupportedLayout
from kvd.connectors.vllm.logs import log
from kvd.connectors.vllm.metadata import KvdConnectorMetadata, LoadOrder, SaveOrder
from kvd.connectors.vllm.transfer import Unavailable, registering
from kvd.connectors.vllm.worker import WorkerSide
from kvd.device import open_device
from kvd.errors import KvdError

ENGINE_WORD, SAVE_WORD = 0, 1  # the engine's "layer written" word; kvd's word for saves (nobody waits on it)
FIRST_LOAD_WORD = 2
_POLL_MAX_S = 0.001
REGISTER_RETRY_S = 5.0  # a daemon without a device plane (or down) is asked again this often, not every step


@dataclass(slots=True)
class _DeviceLoad:
    order: LoadOrder
    word: int
    base: int
    answer: concurrent.futures.Future
    matched: int = 0
    # Why kvd served fewer blocks than were asked for (kvd.v1.GetCut).
    cut: int = 0
    error: str | None = None
    settled: bool = False  # kvd is done with the word (every layer flagged, or FAILED)
    stream: None = None  # (WorkerSide._report's layer stream: none here)
    pool: DevicePool | None = None  # the pool its word lives in (its flag memory lives as long as this)
    ring: RingReads | None = None  # with io_ring: the blocks only on disk, read through the pool's ring
    ring_layer: int = -1  # the last layer whose ring reads were waited for
    answered: bool = False
    cancel_word: int = -1  # the word this worker stores `base` into to cancel the load
    deadline: float | None = None  # (monotonic) past it the load is cut: computing is sooner


@dataclass
class _DeviceStep:
    loads: list[_DeviceLoad] = field(default_factory=list)
    saves: list[tuple[SaveOrder, concurrent.futures.Future]] = field(default_factory=list)
    deferred: list[SaveOrder] = field(default_factory=list)  # requests that also load: saved after the forward
    save_base: int = 0


class DeviceWorkerSide(WorkerSide):
    def __init__(self, config, layout, namespace, shard: int, tensors: list[torch.Tensor]) -> None:
        super().__init__(config, layout, namespace, shard)
        self.tensors = tensors
        self.layers = len(tensors)
        self.device_pool: DevicePool | None = None
        self.device = None  # the kvd device the tensors are on, once registered
        self._retry_at = 0.0  # a failed registration is not tried again before this (monotonic seconds)
        self._next_base = 1
        self._free_words = self._load_words()
        self._device_step = _DeviceStep()
        # Saves wait for the engine's layers for a whole forward pass: threads of their own, so
        # loads (whose layers the forward waits for) never queue behind them.
        self._saving = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="kvd-save")

    # ---- the pool
    def _register(self) -> DevicePool | None:
        """The engine's tensors as a kvd pool; None (logged) when kvd cannot take them now."""
        if self.device_pool is not None:
            return self.device_pool
        if time.monotonic() < self._retry_at:
            return None
        first = self.tensors[0]
        try:
            device = self.device or (open_device("cuda", first.device.index or 0) if first.is_cuda
                                     else open_device("cpu"))
            geometry = [_geometry(tensor, self.layout) for tensor in self.tensors]
            if len({(stride, v_offset) for stride, v_offset, _ in geometry}) != 1:
                raise UnsupportedLayout(f"the layers' strides differ: {geometry}")
            page_stride, v_offset, _ = geometry[0]
            memories = [device.wrap(t.data_ptr(), extent) for t, (_, _, extent) in zip(self.tensors, geometry)]
            self.device_pool = registering(self.link.client, self.namespace, lambda: DevicePool(
                self.link.client, self.namespace, device, memories, self.layout.num_blocks,
                flag_words=self.config.flag_words, arena_socket=socket_path_for_target(self.config.target),
                token=self.config.token, page_stride=page_stride, v_offset=v_offset, io_ring=self.config.io_ring))
            self.device = device
        except (grpc.RpcError, KvdError, OSError, Unavailable, UnsupportedLayout) as error:  # (DeviceError too)
            why = f"{error.code().name}: {error.details()}" if isinstance(error, grpc.RpcError) else error
            log.warning("kvd: the KV pool could not be registered with kvd's device plane (%s); "
                        "no loads or saves for %.0f s, then it is tried again", why, REGISTER_RETRY_S)
            self._retry_at = time.monotonic() + REGISTER_RETRY_S
            return None
        self._free_words = self._load_words()
        self._next_base = 1
        return self.device_pool

    def _load_words(self) -> list[int]:
        return list(range(FIRST_LOAD_WORD, self.config.flag_words))

    def _engine_stream(self):
        """The stream the engine's forward runs on: torch's current one on a GPU."""
        first = self.tensors[0]
        handle = torch.cuda.current_stream(first.device).cuda_stream if first.is_cuda else None
        return self.device.engine_stream(handle)

    def _base(self) -> int:
        base, self._next_base = self._next_base, self._next_base + self.layers
        return base

    def _pool_lost(self, error: BaseException) -> None:
        """A transfer the daemon does not know the pool for (it restarted, or the lease ran out)."""
        if isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.NOT_FOUND and self.device_pool is not None:
            # Registered again at the next step, its words afresh. The old pool's flag memory is freed
            # when the last load or save holding it is done (DevicePool's finalizer).
            self.device_pool = None

    # ---- step start
    def start(self, metadata: KvdConnectorMetadata) -> None:
        step = _DeviceStep()
        self._device_step = step
        pool = self._register()
        loading = {order.req_id for order in metadata.loads}
        for order in metadata.loads:
            if pool is None:
                self._report(_positions(order), _failed(order, "no pool"))
                continue
            load = self._load(pool, order)
            if order.asynchronous:
                self._pool.submit(self._finish_async, load)
            else:
                step.loads.append(load)
        if pool is None or not metadata.saves:
            return
        step.save_base = self._base()
        for order in metadata.saves:
            if order.req_id in loading:
                step.deferred.append(order)
            else:
                step.saves.append((order, self._saving.submit(self._save, pool, order, step.save_base)))

    def _load(self, pool: DevicePool, order: LoadOrder) -> _DeviceLoad:
        with self._lock:
            words = [self._free_words.pop(), self._free_words.pop()] if len(self._free_words) >= 2 else []
        if not words:
            return _failed(order, "every flag word is in use")
        word, cancel = words
        base = self._base()
        pool.mark(word, 0)  # kvd is done with both: the last transfers on them settled
        pool.mark(cancel, 0)
        keys = order.keys[self.shard]
        parent = keys[order.first - 1] if order.first else b""
        pages = order.block_ids[0]  # one KV cache group: the pool is registered for one
        chain = keys[order.first:order.first + len(pages)]
        answer = self._pool.submit(pool.load, chain, pages[:len(chain)], word, base, parent, cancel)
        deadline = None if order.budget_s is None else time.monotonic() + order.budget_s
        return _DeviceLoad(order, word, base, answer, pool=pool, cancel_word=cancel, deadline=deadline)

    def _save(self, pool: DevicePool, order: SaveOrder, base: int):
        keys = order.keys[self.shard]
        return pool.save(keys, order.block_ids[0][:len(keys)], ENGINE_WORD, SAVE_WORD, base,
                         offload_distance=order.distance)

    # ---- per layer
    def save_layer(self, layer_name: str) -> None:
        layer = self.layer_of.get(layer_name)
        step = self._device_step
        if layer is not None and step.saves and self.device_pool is not None:
            # Behind the layer's kernels on the engine's stream: a mark from the host could land
            # while they still write the pages, and kvd would copy (and commit) what is not there yet.
            self.device_pool.mark_on(self._engine_stream(), ENGINE_WORD, step.save_base + layer + 1)

    def wait_layer(self, layer_name: str) -> None:
        layer = self.layer_of.get(layer_name)
        if layer is None or not self._device_step.loads:
            return
        started = time.perf_counter()
        for load in self._device_step.loads:
            if load.error is None:
                self._wait(load, load.base + layer + 1)
        self.counters.add(load_wait_s=time.perf_counter() - started)

    def _wait(self, load: _DeviceLoad, value: int) -> None:
        """Until kvd's word for `load` reaches `value`; load.error says why not. A load past its
        budget, or load_timeout_s, is cancelled (_late)."""
        deadline = time.monotonic() + self.config.load_timeout_s
        cut_at = load.deadline if load.deadline is not None and load.deadline < deadline else None
        layer = value - load.base - 1
        if not self._answered(load, cut_at or deadline) and \
                not self._late(load, layer, cut_at is not None, "LoadLayers did not answer in time"):
            return
        if load.ring is not None:
            cut_at = None  # (blocks read through the ring are not cancelled: waited for in full)
        pause = 1e-6
        while True:
            current = self._flag(load)
            if current & FAILED:
                load.error, load.settled = "kvd could not copy the blocks", True
                return
            if current >= value:
                load.settled = current >= load.base + self.layers
                if load.ring is not None:
                    self._wait_ring(load, value - load.base - 1, deadline)
                return
            now = time.monotonic()
            over_budget = cut_at is not None and now > cut_at
            if (over_budget or now > deadline) and \
                    not self._late(load, layer, over_budget, "a layer did not land in time"):
                return
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)

    def _late(self, load: _DeviceLoad, layer: int, over_budget: bool, why: str) -> bool:
        """A load past its budget (cut) or load_timeout_s (`why`), cancelled (_stop); whether it landed
        in full after all, and is kept."""
        if load.error is not None:
            return False
        if not over_budget:
            return self._stop(load, why)
        why = (f"cut: layer {layer} had not landed within the load's budget of {load.order.budget_s:.3f} s, "
               "past which computing the blocks is sooner")
        if self._stop(load, why):
            return True
        if load.settled:
            self.counters.add(cut_loads=1)
        return False

    def _flag(self, load: _DeviceLoad) -> int:
        # A pool the daemon lost will never be written again (and a new one has other words).
        return load.pool.flag(load.word) if load.pool is self.device_pool else FAILED

    def _stop(self, load: _DeviceLoad, why: str) -> bool:
        """Cancel the load and wait until kvd is done with its pages; whether every layer landed
        after all. Otherwise load.error is `why`, and load.settled whether kvd let the pages go."""
        load.pool.mark(load.cancel_word, load.base)
        until = time.monotonic() + self.config.load_timeout_s
        pause = 1e-6
        while self._answered(load, until):
            current = self._flag(load)
            if current & FAILED or current >= load.base + self.layers:
                load.settled = True
                if not current & FAILED:
                    return True
                break
            if time.monotonic() > until:
                break
            time.sleep(pause)
            pause = min(pause * 2, _POLL_MAX_S)
        load.error = load.error or why  # (LoadLayers' own failure, if it failed meanwhile)
        if not load.settled:
            log.error("kvd: a cancelled load into request %s's pages did not end within %.0f s; its pages may "
                      "still be written", load.order.req_id, self.config.load_timeout_s)
        return False

    def _answered(self, load: _DeviceLoad, until: float) -> bool:
        """LoadLayers' answer taken in (once; its ring reads published) by `until` (monotonic): whether
        there is one. One that failed sets load.error; one not there yet does not."""
        if load.answered:
            return True
        if load.error is not None:
            return False
        try:
            response = load.answer.result(timeout=max(0.0, until - time.monotonic()))
        except concurrent.futures.TimeoutError:
            return False
        except (grpc.RpcError, KvdError, Unavailable, OSError) as error:
            self._pool_lost(error)
            load.error, load.settled = f"LoadLayers failed: {error}", True
            return False
        load.matched, load.cut, load.answered = response.matched, response.cut, True
        try:
            load.ring = load.pool.ring_reads(response)
            if load.ring is not None:
                load.ring.publish(timeout_s=self.config.load_timeout_s)  # every layer's reads, at once
        except (ValueError, OSError) as error:
            load.error = f"the ring's reads could not be published: {error}"
        return load.error is None

    def _wait_ring(self, load: _DeviceLoad, last_layer: int, deadline: float) -> None:
        """Layers up to `last_layer` of the blocks read through the pool's ring, waited for in turn;
        a layer that fails or times out fails the load, once no read of it is in flight any more
        (its pages are then given back to vLLM, which recomputes them)."""
        reads = load.ring
        while load.error is None and load.ring_layer < last_layer:
            layer = load.ring_layer + 1
            result = reads.wait(layer, timeout_s=max(0.0, deadline - time.monotonic()))
            if result.ok:
                load.ring_layer = layer
                continue
            load.error = f"the ring's reads of layer {layer} ended {result.state.name}"
            if not reads.settle(timeout_s=self.config.load_timeout_s):
                log.error("kvd: ring reads into request %s's pages still run after %.0f s; its pages may "
                          "still be written", load.order.req_id, self.config.load_timeout_s)

    # ---- step end
    def finish_step(self) -> None:
        step, self._device_step = self._device_step, _DeviceStep()
        failed = self._end_device_loads(step.loads)
        if self.device_pool is not None and (step.saves or step.deferred):
            # Every layer is written once the forward's work is done: marked behind it, on its stream.
            self.device_pool.mark_on(self._engine_stream(), ENGINE_WORD, step.save_base + self.layers)
            for order in step.deferred:
                if order.req_id not in failed:
                    step.saves.append((order, self._saving.submit(self._save, self.device_pool, order, step.save_base)))
        for order, saving in step.saves:
            try:
                self._count_saved(saving.result().stored)
            except (grpc.RpcError, KvdError, Unavailable, OSError) as error:
                self._pool_lost(error)
                self.counters.add(save_errors=1)
                # (formatted now: a log record keeping the error would keep its frames and the lost pool)
                log.warning("kvd: saving %s failed: %s", order.req_id, str(error))

    def _end_device_loads(self, loads: list[_DeviceLoad]) -> set[str]:
        failed: set[str] = set()
        for load in loads:
            if load.error is None:
                self._wait(load, load.base + self.layers)  # layers vLLM did not wait for (none usually)
            lost = _positions(load.order, 0 if load.error else load.matched)
            self._settle(load)
            if lost:
                failed.add(load.order.req_id)
                self._report(lost, load)
            self._count_load(load.order, len(lost))
        return failed

    def _settle(self, load: _DeviceLoad) -> None:
        """Give the load's words back once kvd is done with them; words kvd may still use are retired."""
        if load.word < 0:
            return
        if load.settled:
            with self._lock:
                for word in (load.word, load.cancel_word):
                    if word not in self._free_words:  # (the pool may have been registered again meanwhile)
                        self._free_words.append(word)
        else:
            log.warning("kvd: flag words %d and %d retired (their load never settled); %d left", load.word,
                        load.cancel_word, len(self._free_words))

    # ---- asynchronous loads (prefixes that come from disk)
    def _finish_async(self, load: _DeviceLoad) -> None:
        self.counters.add(async_loads=1)
        try:
            self._end_device_loads([load])
        except Exception as error:  # noqa: BLE001 - a failed load is recomputed, never a crash
            load.error = repr(error)
            self._report(_positions(load.order), load)
        finally:
            with self._lock:
                self._received.add(load.order.req_id)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._saving.shutdown(wait=True)
        if self.device_pool is not None:
            try:
                self.device_pool.close()
            except (grpc.RpcError, KvdError, OSError) as error:
                log.warning("kvd: unregistering the KV pool failed (its lease ends it): %s", error)
        self.link.close()


def _failed(order: LoadOrder, why: str) -> _DeviceLoad:
    answer: concurrent.futures.Future = concurrent.futures.Future()
    answer.set_exception(Unavailable(why))
    return _DeviceLoad(order, -1, 0, answer, error=why)


def _positions(order: LoadOrder, first: int = 0) -> list[int]:
    """The positions of a load from `first` on (what _report takes)."""
    return list(range(first, len(order.block_ids[0])))


def _geometry(tensor: torch.Tensor, layout: PagedLayout) -> tuple[int, int, int]:
    """(page stride, V offset, bytes spanned) of one layer's tensor, from its strides: [num_blocks, ...]
    has pages stride(0) apart; [2, num_blocks, ...] (K and V apart) has them stride(1) apart and V
    stride(0) after K, whichever of the two axes is outermost in memory."""
    size = tensor.element_size()
    extent = (sum((length - 1) * stride for length, stride in zip(tensor.shape, tensor.stride())) + 1) * size
    if len(layout.parts[0]) == 2:
        return tensor.stride(1) * size, tensor.stride(0) * size, extent
    return tensor.stride(0) * size, 0, extent
