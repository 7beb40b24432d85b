"""The manifest's records: a block stored (PUT, with its layers' checksums) and removed (REMOVE)."""

from __future__ import annotations

from dataclasses import dataclass

from kvd.invariants import check
from kvd.tiers.disk.frames import KEY_BYTES, PUT_HEAD, REMOVE, RecordType, encode_frame

ROOT_PARENT = bytes(KEY_BYTES)



@dataclass(frozen=True, slots=True)
class PutRecord:
    sequence: int
    namespace_id: bytes
    key: bytes
    parent_key: bytes  # ROOT_PARENT for a root block
    location: int
    # crc32c of each layer, packed as u32 little-endian: 4 bytes a layer,
    # which is how the frame stores them and far smaller in memory than a
    # tuple of ints (the tier keeps one record per block on disk).
    layer_checksums: bytes

    @property
    def layer_count(self) -> int:
        return len(self.layer_checksums) // 4

    def encode(self) -> bytes:
        check(len(self.layer_checksums) % 4 == 0, "layer checksums are packed u32s")
        head = PUT_HEAD.pack(
            self.sequence, self.namespace_id, self.key, self.parent_key, self.location, self.layer_count
        )
        return encode_frame(RecordType.PUT, head + self.layer_checksums)

    @staticmethod
    def decode(payload: bytes) -> PutRecord | None:
        if len(payload) < PUT_HEAD.size:
            return None
        sequence, namespace_id, key, parent_key, location, layers = PUT_HEAD.unpack_from(payload)
        if len(payload) != PUT_HEAD.size + 4 * layers:
            return None
        return PutRecord(sequence, namespace_id, key, parent_key, location, payload[PUT_HEAD.size:])


@dataclass(frozen=True, slots=True)
class RemoveRecord:
    sequence: int
    namespace_id: bytes
    key: bytes

    def encode(self) -> bytes:
        return encode_frame(RecordType.REMOVE, REMOVE.pack(self.sequence, self.namespace_id, self.key))

    @staticmethod
    def decode(payload: bytes) -> RemoveRecord | None:
        if len(payload) != REMOVE.size:
            return None
        return RemoveRecord(*REMOVE.unpack(payload))


Record = PutRecord | RemoveRecord
