"""One layer of many blocks between kvd's arena and the engine's paged KV cache.

Each layer part (K or V, or the one tensor) is one copy for all the step's
blocks, never a Python loop over blocks:

- a CPU engine: one native call (kvd._native.copy_chunks, a memmove per
  block row with the GIL released) from address arrays, a single pass at
  memory speed. The worker runs these on its copy thread, so a layer's
  bytes move while the layers before it compute (kvd.connectors.vllm.worker),
  on CPUs other than the model's where the engine bound it to some;
- a GPU engine: one indexed torch copy on the calling thread's current
  stream, which orders it before the layer's attention kernels.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch

from kvd.connectors.vllm.layout import PagedLayout
from kvd.device import cpu as cpu_device


def native_copies() -> bool:
    """Whether kvd's native module is there to copy rows of a CPU engine's cache."""
    return cpu_device._native_copy is not None


def off_the_model_cores() -> None:
    """The copy thread's start: if the engine bound the model's thread to some of the CPUs (vLLM's
    CPU backend binds its OpenMP threads and leaves the others to the server), the copies go to the
    others, where they run beside the layers' compute instead of taking turns with it on the same
    cores. A thread bound to nothing keeps every CPU."""
    spare = set(range(os.cpu_count() or 0)) - os.sched_getaffinity(0)
    if spare:
        with contextlib.suppress(OSError):  # none of them is this process's (a cgroup cpuset)
            os.sched_setaffinity(0, spare)


def row_addresses(rows: torch.Tensor, index: torch.Tensor) -> np.ndarray:
    """The addresses of rows[index], for a [n, width] tensor whose rows are each contiguous
    (kvd.connectors.vllm.layout builds them so); an index outside [0, n) is refused, not copied."""
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= rows.shape[0]):
        raise IndexError(f"row index outside [0, {rows.shape[0]}): {int(index.min())}..{int(index.max())}")
    row_bytes = np.uint64(rows.stride(0) * rows.element_size())
    return np.uint64(rows.data_ptr()) + index.numpy().astype(np.uint64) * row_bytes


def copy_layer(arena: torch.Tensor, layout: PagedLayout, layer: int, slots: torch.Tensor, blocks: torch.Tensor,
               *, into_engine: bool) -> None:
    """Layer `layer` of the blocks in arena rows `slots` to or from engine blocks `blocks`."""
    offset = layer * layout.layer_bytes // arena.element_size()
    for part in layout.parts[layer]:
        width = part.shape[1]
        window = arena[:, offset:offset + width]
        if part.is_cuda or not native_copies():
            if into_engine:
                part[blocks] = window[slots].to(part.device)
            else:
                window[slots] = part[blocks].cpu()
        else:
            engine, kvd = row_addresses(part, blocks), row_addresses(window, slots)
            destination, source = (engine, kvd) if into_engine else (kvd, engine)
            cpu_device.copy_chunks(destination, source, width * part.element_size())
        offset += width
