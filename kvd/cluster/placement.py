"""Where a block's directory entry lives: content-defined segments, rendezvous hashing.

A chain of block keys is cut into *segments*: a key whose bytes 8..12, read
as a little-endian u32, are divisible by `segment_blocks` starts a new
segment (an *anchor*), and so does a chain's first key. Keys are SHA-256
digests, so anchors fall every `segment_blocks` keys on average, and where
they fall depends on the keys alone, never on positions: the daemon that
stores a block and the router that looks a prefix up cut the same chain at
the same places without exchanging anything.

Every key of a segment has its entry on one node, the segment's *owner*:
the live member with the highest rendezvous score for the anchor
(Thaler and Ravishankar's highest-random-weight hashing). A lookup of an
n-block prefix therefore asks at most n / segment_blocks owners, all at
once: one network round trip however long the prefix. When a member joins
or leaves, only the segments whose highest score it holds (or held) move:
1/N of them, and no other owner changes.

Replicas. A segment's entries can live on its `r` highest-scoring members
instead of one (`cluster.directory_replicas`): a holder tells all of them,
and a lookup asks one, itself where it is one of them, else one at random.
A popular family's segments are asked for by every request of that family,
so their owners are the directory's hot spots; r replicas divide that load
by r, and a segment whose owner dies is still answered by the others while
the holders re-publish. The cost is r times the entries and the update
messages. Adding or removing a member changes the replica set of about
r/N of the segments.

Scores are a 64-bit mix (SplitMix64's finalizer) of the anchor's first
8 bytes XOR a per-member seed (BLAKE2b of the member name), computed for all
members at once with numpy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvd.core.keys import KEY_BYTES

DEFAULT_SEGMENT_BLOCKS = 64
# Anchors scored at once: bounds the score matrix to _CHUNK x members x 8 bytes.
_CHUNK = 4096

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(values: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer on uint64 arrays (wrapping arithmetic)."""
    values = values ^ (values >> np.uint64(30))
    values = values * _M1
    values = values ^ (values >> np.uint64(27))
    values = values * _M2
    return values ^ (values >> np.uint64(31))


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def key_ids(keys: Sequence[bytes]) -> np.ndarray:
    """The first 8 bytes of each key as uint64 (the key's rendezvous id)."""
    packed = b"".join(key[:8] for key in keys)
    return np.frombuffer(packed, dtype="<u8").astype(np.uint64)


class Rendezvous:
    """Owners of anchors among a fixed member list (rebuild on membership change)."""

    def __init__(self, members: Sequence[str]) -> None:
        if not members:
            raise ValueError("rendezvous hashing needs at least one member")
        self.members = tuple(sorted(set(members)))
        self._seeds = np.array([_seed(name) for name in self.members], dtype=np.uint64)

    def _scores(self, anchor_ids: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            return _mix(anchor_ids[:, None] ^ self._seeds[None, :])

    def owner_indices(self, anchor_ids: np.ndarray) -> np.ndarray:
        """Index into `members` of each anchor's owner (its highest score)."""
        out = np.empty(len(anchor_ids), dtype=np.intp)
        for start in range(0, len(anchor_ids), _CHUNK):
            out[start:start + _CHUNK] = self._scores(anchor_ids[start:start + _CHUNK]).argmax(axis=1)
        return out

    def replica_indices(self, anchor_ids: np.ndarray, replicas: int) -> np.ndarray:
        """(anchors, min(replicas, members)) indices into `members`: each anchor's highest
        scores, best first (column 0 is owner_indices)."""
        r = min(replicas, len(self.members))
        if r == 1:
            return self.owner_indices(anchor_ids)[:, None]
        out = np.empty((len(anchor_ids), r), dtype=np.intp)
        for start in range(0, len(anchor_ids), _CHUNK):
            scores = self._scores(anchor_ids[start:start + _CHUNK])
            top = np.argpartition(scores, len(self.members) - r, axis=1)[:, -r:]
            order = np.argsort(np.take_along_axis(scores, top, axis=1), axis=1)[:, ::-1]
            out[start:start + _CHUNK] = np.take_along_axis(top, order, axis=1)
        return out

    def owners(self, anchors: Sequence[bytes]) -> list[str]:
        if not anchors:
            return []
        return [self.members[i] for i in self.owner_indices(key_ids(anchors))]

    def owner(self, anchor: bytes) -> str:
        return self.owners([anchor])[0]


def is_anchor(key: bytes, segment_blocks: int = DEFAULT_SEGMENT_BLOCKS) -> bool:
    return int.from_bytes(key[8:12], "little") % segment_blocks == 0


def segment_starts(keys: Sequence[bytes], segment_blocks: int = DEFAULT_SEGMENT_BLOCKS) -> list[int]:
    """Positions where a chain given from its root starts a segment (0 always)."""
    if not keys:
        return []
    packed = b"".join(keys)
    if len(packed) != len(keys) * KEY_BYTES:
        raise ValueError(f"every key must be {KEY_BYTES} bytes")
    return packed_segment_starts(packed, segment_blocks)


def packed_segment_starts(packed: bytes, segment_blocks: int = DEFAULT_SEGMENT_BLOCKS) -> list[int]:
    """segment_starts of packed keys (32 bytes each, back to back)."""
    if not packed:
        return []
    words = np.frombuffer(packed, dtype="<u4").reshape(-1, KEY_BYTES // 4)[:, 2]
    starts = np.flatnonzero(words % np.uint32(segment_blocks) == 0).tolist()
    return starts if starts[:1] == [0] else [0, *starts]


def segments(keys: Sequence[bytes], segment_blocks: int = DEFAULT_SEGMENT_BLOCKS) -> list[tuple[int, int]]:
    """(start, end) of each segment of a chain given from its root."""
    starts = segment_starts(keys, segment_blocks)
    return list(zip(starts, [*starts[1:], len(keys)]))


def anchor_of_block(block, segment_blocks: int = DEFAULT_SEGMENT_BLOCKS) -> bytes:
    """The anchor of an indexed block: walk up its parents to the first anchor or the root.

    Expected cost: segment_blocks parent steps (geometric), bounded by the depth.
    """
    while block.parent is not None and not is_anchor(block.key, segment_blocks):
        block = block.parent
    return block.key
