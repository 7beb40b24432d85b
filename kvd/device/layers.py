"""Per-layer completion: a layer's blocks in one batched copy, then its flag word.

A save gathers layer l's blocks out of an engine's pool and a load scatters
them into it, one `copy_blocks` per layer; after each, the stream stores
`base + l + 1` in one flag word, so whoever waits on that word (the engine's
stream with cuStreamWaitValue64, or a CPU thread) may use layers 0..l as
soon as it reads a value past `base + l`. Values only grow, so one word
serves every transfer of a request in turn (`base` moves on by the layer
count each time) and a waiter never mistakes an old transfer for a new one.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd.device.api import DeviceError, Memory, Stream


def copy_layers(stream: Stream, dst: Memory, dst_offsets: Sequence, src: Memory, src_offsets: Sequence,
                layer_bytes: int, flags: Memory, flag_index: int, base: int) -> int:
    """Issue one batched copy per layer (offsets: one array per layer) and the flag store after
    each; returns the flag value that means every layer has landed."""
    if len(dst_offsets) != len(src_offsets):
        raise DeviceError(f"{len(dst_offsets)} layers of destinations for {len(src_offsets)} of sources")
    for layer, (targets, sources) in enumerate(zip(dst_offsets, src_offsets)):
        stream.copy_blocks(dst, targets, src, sources, layer_bytes)
        stream.write_flag(flags, flag_index, base + layer + 1)
    return base + len(dst_offsets)
