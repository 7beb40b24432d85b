"""Transport-independent half of the clients: requests, responses, copies.

The sync and async clients differ only in how they call a stub; everything
they decide (what to ask for, what to copy where) is here, so both behave
identically and are tested once.

Block layout seen by callers: an array of shape (n, *spec.block_shape)
with the namespace's dtype, C-contiguous; block i is bytes
[i*block_bytes, (i+1)*block_bytes). Copies between caller arrays and the
arena are one numpy call per request (a gather or a scatter over slot rows),
never a Python loop over blocks or layers.
"""

from __future__ import annotations

import concurrent.futures
import functools
import math
import mmap
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvd import arena_protocol
from kvd.core.keys import DType, ExtraKey, NamespaceSpec, chain_keys
from kvd.errors import InvalidArgument
from kvd.v1 import kvd_pb2

RESERVED = kvd_pb2.RESERVE_STATUS_RESERVED
NUMPY_DTYPES = {
    DType.FLOAT32: np.dtype(np.float32),
    DType.FLOAT16: np.dtype(np.float16),
    # numpy has no bfloat16 / float8: those travel as raw bits.
    DType.BFLOAT16: np.dtype(np.uint16),
    DType.FLOAT8_E4M3: np.dtype(np.uint8),
    DType.FLOAT8_E5M2: np.dtype(np.uint8),
    DType.INT8: np.dtype(np.int8),
}
# Room left in a message for everything that is not payload.
MESSAGE_OVERHEAD_BYTES = 1 << 20


def new_client_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"


@dataclass(frozen=True, slots=True)
class Namespace:
    """A registered namespace as the client sees it."""

    spec: NamespaceSpec
    namespace_id: bytes
    block_bytes: int
    layer_bytes: int

    def keys(
        self,
        token_ids: Sequence[int] | np.ndarray,
        extras: Sequence[Sequence[ExtraKey]] | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """Chained keys of every full block of `token_ids`."""
        return chain_keys(self.spec, token_ids, extras, parent)

    @property
    def numpy_dtype(self) -> np.dtype:
        return NUMPY_DTYPES[DType(self.spec.kv_dtype)]


@dataclass(frozen=True, slots=True)
class LookupResult:
    matched: int
    tiers: list[int]
    # With load_times: per matched block, seconds until it and the blocks before it could be in
    # kvd's host memory (LookupResponse.load_s; NaN where kvd has not measured the tier yet).
    load_s: list[float] | None = None


@dataclass(frozen=True, slots=True)
class GetResult:
    """A Get's blocks, (matched, *block_shape), and why there are not more: a kvd.v1.GetCut value
    (GET_CUT_CORRUPT: the next block failed its checksum and is gone; GET_CUT_NONE: not stored)."""

    blocks: np.ndarray
    cut: int = kvd_pb2.GET_CUT_NONE

    @property
    def corrupt(self) -> bool:
        return self.cut == kvd_pb2.GET_CUT_CORRUPT


@dataclass(frozen=True, slots=True)
class NodeMatch:
    """One node's share of a prefix, from ClusterLookup."""

    node: str
    # host:port the node serves kvd on.
    address: str
    matched: int
    # The node that answered (its match is exact; the others' come from the directory).
    local: bool
    # With load_times: seconds until the node could have its matched blocks in its own host memory,
    # as it prices them (then its matched is its own exact count); NaN: not asked, or not known.
    load_s: float = math.nan


@dataclass(frozen=True, slots=True)
class ClusterLookupResult:
    # Longest match first; nodes holding no leading block are left out.
    nodes: list[NodeMatch]
    # Segments the prefix was cut into, and those whose directory owner did
    # not answer in time (matches stop at the first of those).
    segments: int
    segments_unanswered: int


@dataclass(frozen=True, slots=True)
class PrefetchResult:
    """What a Prefetch found: each of the `matched` stored blocks is in exactly
    one of in_host, loading, queued and refused; `missing` keys are stored in
    no tier. `limit` (a kvd.v1.PrefetchLimit value, 0 when nothing was
    refused) says why blocks were refused. `loaded`: with wait=True, how many
    queued blocks were read and verified (the rest failed and were dropped)."""

    matched: int
    in_host: int
    loading: int
    queued: int
    refused: int
    missing: int
    limit: int
    loaded: int


def spec_message(spec: NamespaceSpec) -> kvd_pb2.NamespaceSpec:
    return kvd_pb2.NamespaceSpec(
        model_id=spec.model_id,
        model_revision=spec.model_revision,
        kv_dtype=int(spec.kv_dtype),
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        block_tokens=spec.block_tokens,
        inner_layout=int(spec.inner_layout),
        kv_order=int(spec.kv_order),
        tp_rank=spec.tp_rank,
        tp_size=spec.tp_size,
        pp_stage=spec.pp_stage,
        pp_size=spec.pp_size,
        lora_id=spec.lora_id,
        tenant_salt=spec.tenant_salt,
        hash_scheme=spec.hash_scheme,
    )


def namespace_from(spec: NamespaceSpec, response: kvd_pb2.RegisterNamespaceResponse) -> Namespace:
    if response.namespace_id != spec.namespace_id() or response.block_bytes != spec.block_bytes:
        # The daemon digests the spec itself; disagreeing means the two sides
        # run incompatible key schemas. Never store under a mismatched identity.
        raise InvalidArgument("the daemon's namespace id or block size differs from this client's")
    return Namespace(spec, response.namespace_id, response.block_bytes, response.layer_bytes)


def as_rows(namespace: Namespace, blocks: Any, count: int) -> np.ndarray:
    """View caller blocks (torch or numpy) as (count, block_bytes) uint8 rows, without copying."""
    if hasattr(blocks, "detach") and hasattr(blocks, "is_cuda"):
        blocks = _torch_to_numpy(namespace, blocks)
    array = np.asarray(blocks)
    expected_shape = (count, *namespace.spec.block_shape)
    if array.shape != expected_shape:
        raise InvalidArgument(f"blocks have shape {array.shape}; expected {expected_shape}")
    if array.dtype.itemsize != namespace.numpy_dtype.itemsize:
        raise InvalidArgument(f"blocks have dtype {array.dtype}; this namespace stores {DType(namespace.spec.kv_dtype).name}")
    if not array.flags.c_contiguous:
        raise InvalidArgument("blocks must be C-contiguous (call .contiguous() or np.ascontiguousarray)")
    return array.reshape(count, -1).view(np.uint8).reshape(count, namespace.block_bytes)


def _torch_to_numpy(namespace: Namespace, tensor: Any) -> np.ndarray:
    import torch

    from kvd.client.tensors import torch_dtype

    if tensor.device.type != "cpu":
        raise InvalidArgument("blocks must be CPU tensors (the GPU path is not in this client yet)")
    expected = torch_dtype(namespace.spec.kv_dtype)
    if tensor.dtype != expected:
        raise InvalidArgument(f"blocks have dtype {tensor.dtype}; this namespace stores {expected}")
    tensor = tensor.detach()
    if tensor.dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):
        tensor = tensor.view(torch.uint16 if tensor.element_size() == 2 else torch.uint8)
    return tensor.numpy()


# Copies of at least this many bytes are split over threads: numpy releases
# the GIL while it copies, and one core alone does not saturate memory
# bandwidth (2 MiB rows, 2 cores: gather 9.6 -> 14.7 GiB/s, scatter
# 12.3 -> 13.9 GiB/s).
PARALLEL_COPY_MIN_BYTES = 16 << 20
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))


@functools.cache
def _copy_pool() -> concurrent.futures.ThreadPoolExecutor:
    return concurrent.futures.ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="kvd-copy")


def _parallel(copy: Callable[[int, int], None], rows: int, total_bytes: int) -> None:
    """Run copy(start, stop) over [0, rows) in up to COPY_THREADS slices."""
    parts = min(COPY_THREADS, rows) if total_bytes >= PARALLEL_COPY_MIN_BYTES else 1
    if parts <= 1:
        copy(0, rows)
        return
    bounds = [rows * part // parts for part in range(parts + 1)]
    futures = [_copy_pool().submit(copy, bounds[part], bounds[part + 1]) for part in range(1, parts)]
    copy(bounds[0], bounds[1])
    for future in futures:
        future.result()


# Rows at least this wide are copied as runs of consecutive slots with
# np.copyto, which ran at twice the speed of np.take for 2 MiB rows (12.5 vs
# 6.8 GiB/s, two threads, memfd or anonymous memory alike); narrower rows
# keep one np.take, whose per-row cost is lower than a Python call's.
RUN_COPY_MIN_BYTES = 64 << 10


def slot_runs(slots: np.ndarray, start: int, stop: int) -> list[tuple[int, int]]:
    """Positions [first, last) within [start, stop) whose slots are consecutive
    (slots[first] + k == slots[first + k]): one per run, in order."""
    if stop <= start:
        return []
    breaks = np.flatnonzero(np.diff(slots[start:stop]) != 1) + 1 + start
    bounds = [start, *breaks.tolist(), stop]
    return list(zip(bounds, bounds[1:]))


# MAP_POPULATE where the platform has it (Linux), for arenas up to this size
# (larger ones would hold a connect for seconds; their pages map on first touch).
ARENA_MAP_FLAGS = getattr(mmap, "MAP_POPULATE", 0)
ARENA_POPULATE_MAX_BYTES = 16 << 30


def copy_rows(source: np.ndarray, slots: np.ndarray, out: np.ndarray, low: int, high: int) -> None:
    """out[i, low:high] = source[slots[i], low:high] for every row i, over the copy threads:
    runs of consecutive slots with np.copyto where the rows are wide, one np.take otherwise."""
    width = high - low

    def copy(start: int, stop: int) -> None:
        if width < RUN_COPY_MIN_BYTES:
            # mode="clip": with the default mode="raise" numpy buffers `out`
            # and copies twice (measured 2.3 vs 8.4 GiB/s for 2 MiB rows);
            # slot_indices already checked the range.
            np.take(source[:, low:high], slots[start:stop], axis=0, out=out[start:stop, low:high], mode="clip")
            return
        for first, last in slot_runs(slots, start, stop):
            np.copyto(out[first:last, low:high], source[slots[first]:slots[first] + last - first, low:high])

    _parallel(copy, len(slots), len(slots) * width)


class StreamedCopy:
    """A streamed Get's blocks copied out of the arena as its messages report them: by layer
    (GetLayers, both clients' get_layers) or by block (GetBlocks, get_numpy). `matched` only
    shrinks; each step is one copy over the copy threads, whatever the number of blocks."""

    def __init__(self, namespace: Namespace, arena: ArenaMapping, first: Any, out: np.ndarray | None) -> None:
        self.namespace = namespace
        self.matched = first.matched
        self.rows = output_rows(namespace, first.matched, out)
        self.slots = arena.slot_indices(first.offsets, namespace.block_bytes)
        self.source = arena.rows(arena.stride(namespace.block_bytes))
        self.copied = 0  # layers of every block, or leading blocks whole
        # Why `matched` is short (kvd.v1.GetCut), from the message that says.
        self.cut = first.cut

    def take_layers(self, message: Any) -> tuple[int, np.ndarray]:
        """(layers ready, the blocks so far) after a GetLayers message."""
        self.matched = min(self.matched, message.matched)
        self.cut = message.cut or self.cut
        if self.copied < message.layers_ready:
            layer_bytes = self.namespace.layer_bytes
            copy_rows(self.source, self.slots[:self.matched], self.rows[:self.matched], self.copied * layer_bytes,
                      message.layers_ready * layer_bytes)
            self.copied = message.layers_ready
        return self.copied, self.blocks()

    def take_blocks(self, message: Any) -> None:
        """Copy the blocks a GetBlocks message reports ready and not yet copied."""
        self.matched = min(self.matched, message.matched)
        self.cut = message.cut or self.cut
        ready = min(message.blocks_ready, self.matched)
        if ready > self.copied:
            copy_rows(self.source, self.slots[self.copied:ready], self.rows[self.copied:ready], 0,
                      self.namespace.block_bytes)
            self.copied = ready

    def blocks(self) -> np.ndarray:
        return blocks_to_output(self.namespace, self.rows, self.matched)


class ArenaMapping:
    """A client's mapping of the daemon's host arena (its tenant's file of it).

    The arena is pages of `slot_bytes`, each carved into slots of one size
    class; a namespace's blocks are in slots of the smallest class that
    holds them (kvd.v1.ArenaInfoResponse.class_bytes), so its offsets are
    multiples of that size and the arena is, for it, rows of that size."""

    def __init__(self, info: kvd_pb2.ArenaInfoResponse, fd: int) -> None:
        """Map the arena file `fd` (the caller still owns and closes it)."""
        if os.fstat(fd).st_size != info.arena_bytes:
            raise InvalidArgument("the arena socket passed a file that is not the daemon's arena (size differs)")
        # Populated at once (up to ARENA_POPULATE_MAX_BYTES): the first copy
        # into pages mapped on demand took 0.37-0.50 s per GiB here (a write
        # fault per 4 KiB page), against 0.11 s into populated ones, and
        # MAP_POPULATE costs 0.055 s per GiB, once, when the client connects.
        flags = ARENA_MAP_FLAGS if info.arena_bytes <= ARENA_POPULATE_MAX_BYTES else 0
        self._mmap = mmap.mmap(fd, info.arena_bytes, mmap.MAP_SHARED | flags, mmap.PROT_READ | mmap.PROT_WRITE)
        self.instance_id = info.instance_id
        self.slot_bytes = info.slot_bytes
        self.class_bytes = tuple(info.class_bytes) or (info.slot_bytes,)
        if any(size <= 0 or info.arena_bytes % size for size in self.class_bytes):
            raise InvalidArgument(f"the daemon's slot classes {self.class_bytes} do not divide its arena")
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        # Rows of the largest slot (pages), and of each class as it is asked for.
        self._rows: dict[int, np.ndarray] = {}
        self.slots = self.rows(self.slot_bytes)
        self._pinned: dict[str, tuple[Any, Any]] = {}  # device uuid -> (device, its registration)

    def pin(self, device) -> None:
        """Register the mapping with `device` (a kvd.device.Device; CUDA: cudaHostRegister) once, so
        the caller's copies between it and GPU memory are DMA from page-locked memory rather than
        staged through a bounce buffer. Undone at close. DeviceError when the device refuses (for
        CUDA, usually RLIMIT_MEMLOCK: see docs/operations.md)."""
        if device.uuid not in self._pinned:
            self._pinned[device.uuid] = (device, device.register_host(self._array.ctypes.data, len(self._array)))

    def stride(self, block_bytes: int) -> int:
        """Slot size of blocks of `block_bytes`: the smallest class that holds them."""
        fits = [size for size in self.class_bytes if size >= block_bytes]
        if not fits:
            raise InvalidArgument(f"blocks of {block_bytes} bytes fit no slot of the daemon's arena")
        return min(fits)

    def rows(self, stride: int) -> np.ndarray:
        """The arena as rows of `stride` bytes (a view; no copy)."""
        view = self._rows.get(stride)
        if view is None:
            view = self._rows[stride] = self._array.reshape(len(self._array) // stride, stride)
        return view

    @classmethod
    def receive(cls, path: Path, token: str | None, info: kvd_pb2.ArenaInfoResponse) -> ArenaMapping:
        """Ask the arena socket at `path` for the arena and map it (kvd.arena_protocol)."""
        fd, reply = arena_protocol.receive_arena(path, token, info.instance_id)
        try:
            if reply.get("arena_bytes") != info.arena_bytes or reply.get("instance_id") != info.instance_id:
                raise InvalidArgument("the arena socket describes another arena than ArenaInfo did")
            return cls(info, fd)
        finally:
            os.close(fd)

    def slot_indices(self, offsets: Sequence[int], block_bytes: int | None = None) -> np.ndarray:
        """Row numbers, in rows(stride(block_bytes)) (default: pages), of arena
        offsets, checked: a bad offset is an error, not a clamp."""
        stride = self.slot_bytes if block_bytes is None else self.stride(block_bytes)
        offsets = np.asarray(offsets, dtype=np.int64)
        slots, remainders = np.divmod(offsets, stride)
        if len(slots) and (remainders.any() or slots.min() < 0 or slots.max() >= len(self.rows(stride))):
            raise InvalidArgument("daemon returned an arena offset outside the arena or off a slot boundary")
        return slots

    def scatter(self, rows: np.ndarray, offsets: Sequence[int]) -> None:
        """Write rows[i] (one block each) into the slot at offsets[i], over the copy threads."""
        width = rows.shape[1]
        slots = self.slot_indices(offsets, width)
        target = self.rows(self.stride(width))

        def copy(start: int, stop: int) -> None:
            if width < RUN_COPY_MIN_BYTES:
                target[slots[start:stop], :width] = rows[start:stop]
                return
            for first, last in slot_runs(slots, start, stop):
                np.copyto(target[slots[first]:slots[first] + last - first, :width], rows[first:last])

        _parallel(copy, len(slots), len(slots) * width)

    def gather(self, offsets: Sequence[int], width: int, out: np.ndarray) -> None:
        """Copy the `width` bytes of the block in each slot into out's rows, over the copy threads."""
        copy_rows(self.rows(self.stride(width)), self.slot_indices(offsets, width), out, 0, width)

    def close(self) -> None:
        for device, registration in self._pinned.values():
            device.unregister_host(registration)
        self._pinned.clear()
        self.slots = None  # type: ignore[assignment]
        self._rows.clear()
        self._array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass


def reserved_run(statuses: Sequence[int]) -> tuple[int, int]:
    """[start, stop) of the RESERVED keys, which the daemon keeps contiguous."""
    positions = [index for index, status in enumerate(statuses) if status == RESERVED]
    if not positions:
        return 0, 0
    start, stop = positions[0], positions[-1] + 1
    if stop - start != len(positions):
        raise InvalidArgument("daemon returned a non-contiguous reservation")
    return start, stop


def inline_batch_blocks(namespace: Namespace, max_message_bytes: int) -> int:
    return max(1, (max_message_bytes - MESSAGE_OVERHEAD_BYTES) // (namespace.block_bytes + 64))


def blocks_to_output(namespace: Namespace, rows: np.ndarray, matched: int) -> np.ndarray:
    """Shape (matched, block_bytes) rows as (matched, *block_shape) of the namespace dtype."""
    return rows[:matched].view(namespace.numpy_dtype).reshape(matched, *namespace.spec.block_shape)


def output_rows(namespace: Namespace, count: int, out: np.ndarray | None) -> np.ndarray:
    """Rows to gather into: the caller's `out`, or a new array."""
    if out is None:
        return np.empty((count, namespace.block_bytes), dtype=np.uint8)
    return as_rows(namespace, out, out.shape[0])[:count]
