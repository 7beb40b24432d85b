"""Manifest framing: each record a frame of (payload length, crc32c, type) and payload.

See FORMAT.md. `encode_frame` makes one; `decode_frames` reads a log, resynchronising past
damage at the next valid frame and reporting what it skipped, and a torn tail. The
records' payloads are kvd.tiers.disk.records'.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass, field

import crc32c
import numpy as np

from kvd.invariants import check

# An id takes this many bytes (a NAMESPACE frame is longer than one).
KEY_BYTES = 32
# The fixed parts of the records' payloads (kvd.tiers.disk.records), which tell a
# plausible frame length from garbage while resynchronising.
PUT_HEAD = struct.Struct("<Q32s32s32sQH")
REMOVE = struct.Struct("<Q32s32s")
SEQUENCE = struct.Struct("<Q")
SNAPSHOT_END = struct.Struct("<QQ")

FRAME_HEADER = struct.Struct("<IIB")  # length of payload, crc32c(type+payload), type
MAX_PAYLOAD_BYTES = 1 << 20


class RecordType(enum.IntEnum):
    SNAPSHOT_BEGIN = 1
    PUT = 2
    REMOVE = 3
    SNAPSHOT_END = 4
    NAMESPACE = 5  # only in a drive's NAMESPACES registry (registry.py), never in a manifest


def _checksum(record_type: int, payload: bytes) -> int:
    return crc32c.crc32c(payload, crc32c.crc32c(bytes((record_type,))))


def encode_frame(record_type: RecordType, payload: bytes) -> bytes:
    check(len(payload) <= MAX_PAYLOAD_BYTES, "manifest payload too large")
    return FRAME_HEADER.pack(len(payload), _checksum(record_type, payload), record_type) + payload


@dataclass(slots=True)
class FrameScan:
    """What decode_frames found in a log.

    frames: every valid frame, in file order. valid_end: where the last
    valid frame ends; anything after it is a torn tail (an append a crash
    cut short), safe to truncate. damaged: (start, end) byte ranges between
    valid frames that hold no valid frame: damage inside the log, which
    cost the records that were there.
    """

    frames: list[tuple[RecordType, bytes]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # where each frame starts
    valid_end: int = 0
    damaged: list[tuple[int, int]] = field(default_factory=list)

    @property
    def damaged_bytes(self) -> int:
        return sum(end - start for start, end in self.damaged)


def _frame_at(data: bytes, position: int) -> tuple[RecordType, bytes, int] | None:
    """The valid frame starting at `position` (type, payload, end), or None."""
    if position + FRAME_HEADER.size > len(data):
        return None
    length, checksum, record_type = FRAME_HEADER.unpack_from(data, position)
    start = position + FRAME_HEADER.size
    end = start + length
    if length > MAX_PAYLOAD_BYTES or end > len(data) or record_type not in RecordType._value2member_map_:
        return None
    if not _plausible_length(record_type, length):
        return None
    payload = bytes(data[start:end])
    if _checksum(record_type, payload) != checksum:
        return None
    return RecordType(record_type), payload, end


def _plausible_length(record_type: int, length: int) -> bool:
    """Each record type has payloads of known lengths; resynchronisation
    only considers frames whose length fits their type."""
    if record_type == RecordType.PUT:
        return length >= PUT_HEAD.size and (length - PUT_HEAD.size) % 4 == 0
    if record_type == RecordType.REMOVE:
        return length == REMOVE.size
    if record_type == RecordType.SNAPSHOT_BEGIN:
        return length == SEQUENCE.size
    if record_type == RecordType.SNAPSHOT_END:
        return length == SNAPSHOT_END.size
    return length > KEY_BYTES  # NAMESPACE: an id, then a spec encoding


def _candidates(data: bytes, start: int) -> np.ndarray:
    """Positions >= start where a frame header is plausible (a known type, a
    length that fits the type and the data); ascending. One vectorised pass
    over the rest of the log, so a damaged log costs O(bytes), not a
    checksum per byte."""
    size = len(data)
    last = size - FRAME_HEADER.size  # the last position a header fits at
    if last < start:
        return np.zeros(0, dtype=np.int64)
    raw = np.frombuffer(data, dtype=np.uint8)
    positions = np.arange(start, last + 1, dtype=np.int64)
    types = raw[positions + 8]
    lengths = (raw[positions].astype(np.int64) | raw[positions + 1].astype(np.int64) << 8
               | raw[positions + 2].astype(np.int64) << 16 | raw[positions + 3].astype(np.int64) << 24)
    fits = (lengths <= MAX_PAYLOAD_BYTES) & (positions + FRAME_HEADER.size + lengths <= size)
    plausible = np.zeros(positions.shape, dtype=bool)
    for kind in RecordType:
        mine = types == kind
        if kind == RecordType.PUT:
            mine &= (lengths >= PUT_HEAD.size) & ((lengths - PUT_HEAD.size) % 4 == 0)
        elif kind == RecordType.REMOVE:
            mine &= lengths == REMOVE.size
        elif kind == RecordType.SNAPSHOT_BEGIN:
            mine &= lengths == SEQUENCE.size
        elif kind == RecordType.SNAPSHOT_END:
            mine &= lengths == SNAPSHOT_END.size
        else:
            mine &= lengths > KEY_BYTES
        plausible |= mine
    return positions[plausible & fits]


def decode_frames(data: bytes) -> FrameScan:
    """Every valid frame of a log, resynchronising after damage.

    A frame that is short, too long, of unknown type, of a length its type
    never has, or whose checksum does not match is not a frame. After one,
    decoding resumes at the next position where a valid frame starts (the
    crc32c of the whole frame makes a false start about 1 in 4 billion per
    plausible header), so a flipped byte costs the records it hit, not the
    rest of the log. Trailing bytes with no valid frame after them are a
    torn tail.
    """
    scan = FrameScan()
    position = 0
    candidates: np.ndarray | None = None
    while position < len(data):
        found = _frame_at(data, position)
        if found is not None:
            record_type, payload, end = found
            scan.frames.append((record_type, payload))
            scan.positions.append(position)
            position = scan.valid_end = end
            continue
        if candidates is None:
            candidates = _candidates(data, position + 1)
        resume = None
        for candidate in candidates[np.searchsorted(candidates, position + 1):].tolist():
            if _frame_at(data, candidate) is not None:
                resume = candidate
                break
        if resume is None:
            break  # a torn tail: nothing valid follows
        scan.damaged.append((position, resume))
        position = resume
    return scan
