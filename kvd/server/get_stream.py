"""What a streamed Get tells its client as its disk reads land.

GetLayers and GetBlocks run the same Get (kvd.server.service plans it,
kvd.planes.disk reads it); they differ only in the progress their
messages carry. GetLayers reads each block in extents of whole layers and
says how many leading layers of every block are in the arena, for an engine
that starts on layer 0 early. GetBlocks reads each block whole, as a plain
Get does, and says how many leading blocks are in the arena, for a client
that copies blocks out while the rest are read.

Either way `matched` only shrinks: a block found corrupt is cut, with every
block after it, and nothing before it is taken back.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd.invariants import check
from kvd.server import convert


class LayerSteps:
    """GetLayers: progress is a layer index; disk_plane.start_get(on_layer=...)."""

    callback = "on_layer"

    def __init__(self, num_layers: int, matched: int, load_positions: Sequence[int], first_wait: int) -> None:
        self.num_layers = num_layers

    def first(self, matched: int, pending: bool, **fields):
        """`fields`: the first message's lease, offsets and tiers (and its cut, when it is the last too)."""
        return convert.get_layers_response(matched, 0 if pending else self.num_layers, **fields)

    def step(self, layer: int, servable: int):
        return convert.get_layers_response(servable, layer + 1)

    def last(self, matched: int, cut: int):
        return convert.get_layers_response(matched, self.num_layers, cut=cut)


class BlockSteps:
    """GetBlocks: progress is how many of the Get's loads (in block order) are done;
    disk_plane.start_get(on_blocks=...)."""

    callback = "on_blocks"

    def __init__(self, num_layers: int, matched: int, load_positions: Sequence[int], first_wait: int) -> None:
        """load_positions: where in the matched blocks the Get's own loads are; first_wait:
        the first block another read is loading (`matched` if none)."""
        check(all(a < b for a, b in zip(load_positions, load_positions[1:])),
              "a GetBlocks' loads are not in block order")
        self.load_positions = list(load_positions)
        self.matched = matched
        # Blocks before the first one being read are in host memory already.
        self.ready = min([first_wait, matched, *self.load_positions[:1]])

    def first(self, matched: int, pending: bool, **fields):
        check(pending or self.ready == matched, "a GetBlocks with nothing to read has {} of {} blocks ready",
              self.ready, matched)
        return convert.get_blocks_response(matched, self.ready, **fields)

    def step(self, done: int, servable: int):
        ready = self.load_positions[done] if done < len(self.load_positions) else self.matched
        self.ready = max(self.ready, min(ready, servable))
        check(self.ready <= servable, "GetBlocks reports {} blocks ready of {} servable", self.ready, servable)
        return convert.get_blocks_response(servable, self.ready)

    def last(self, matched: int, cut: int):
        return convert.get_blocks_response(matched, matched, cut=cut)
