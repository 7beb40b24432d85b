"""The device tier: a daemon-owned pool of device memory ([device] tier_bytes) above host memory,
holding copies of the blocks engines saved, so another engine's load is a device-to-device copy
that never passes through host memory.

It is a cache of the host tier, never the only copy: a save stores every block in the arena
first, and the tier keeps a copy of it. Entries are found by (namespace, key) and trusted only
for the very Block object of the index they were made from: a block that was removed and stored
again under the same key is a new Block, so an old copy is never served for it. Slots are fixed
size; the least recently used unpinned entry makes room. A load pins the slots it reads until its
copies have landed, so no save overwrites them meanwhile.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvd.device import Device
from kvd.invariants import check

NO_SLOT = -1


@dataclass(slots=True)
class Entry:
    slot: int
    block: object   # the index's Block this copy was made from
    pins: int = 0
    landed: bool = False  # its save's copies are all in: before that it is never served


class DeviceTier:
    def __init__(self, device: Device, tier_bytes: int, slot_bytes: int) -> None:
        check(slot_bytes > 0 and tier_bytes >= slot_bytes, "a device tier of {} bytes in slots of {}", tier_bytes,
              slot_bytes)
        self.slot_bytes = slot_bytes
        self.slot_count = tier_bytes // slot_bytes
        self.memory = device.alloc(self.slot_count * slot_bytes)
        self.device = device
        self._free = list(range(self.slot_count - 1, -1, -1))
        self._entries: OrderedDict[tuple[bytes, bytes], Entry] = OrderedDict()
        # Entries dropped while pinned (their key was stored again, or went stale): their slots come
        # back when the last pin goes.
        self._orphans: dict[int, Entry] = {}
        self.hits = self.misses = self.evictions = self.stored = 0

    def __len__(self) -> int:
        return len(self._entries)

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    def find(self, namespace_id: bytes, keys, blocks) -> list[int]:
        """The slot holding each block (NO_SLOT where none), pinned; `unpin` them once read."""
        slots = []
        for key, block in zip(keys, blocks):
            entry = self._entries.get((namespace_id, key))
            if entry is not None and entry.block is not block:
                self._drop((namespace_id, key))  # another block under that key now: the copy is stale
                entry = None
            if entry is None or not entry.landed:
                self.misses += 1
                slots.append(NO_SLOT)
                continue
            self.hits += 1
            entry.pins += 1
            self._entries.move_to_end((namespace_id, key))
            slots.append(entry.slot)
        return slots

    def holds(self, namespace_id: bytes, keys, blocks) -> list[bool]:
        """Whether a landed copy of each block is here (Lookup's view: no pin, no recency, no count)."""
        held = []
        for key, block in zip(keys, blocks):
            entry = self._entries.get((namespace_id, key))
            held.append(entry is not None and entry.block is block and entry.landed)
        return held

    def unpin(self, namespace_id: bytes, keys, slots) -> None:
        for key, slot in zip(keys, slots):
            if slot != NO_SLOT:
                self._release((namespace_id, key), slot)

    def _release(self, name: tuple[bytes, bytes], slot: int) -> Entry | None:
        """Drop one pin of `slot`; the entry if it still holds that name, None if it was orphaned."""
        entry = self._entries.get(name)
        if entry is not None and entry.slot == slot:
            check(entry.pins > 0, "a device tier slot unpinned more often than pinned")
            entry.pins -= 1
            return entry
        orphan = self._orphans[slot]
        orphan.pins -= 1
        if orphan.pins == 0:
            del self._orphans[slot]
            self._free.append(slot)
        return None

    def place(self, namespace_id: bytes, keys, blocks, block_bytes: int) -> list[int]:
        """Slots for new copies of `blocks` (NO_SLOT where no room), pinned until `settle`."""
        if block_bytes > self.slot_bytes:
            return [NO_SLOT] * len(keys)
        slots = []
        for key, block in zip(keys, blocks):
            self._drop((namespace_id, key))
            slot = self._free.pop() if self._free else self._evict()
            if slot != NO_SLOT:
                self._entries[(namespace_id, key)] = Entry(slot, block, pins=1)
            slots.append(slot)
        return slots

    def settle(self, namespace_id: bytes, keys, slots, landed: bool) -> None:
        """After a save's copies into `slots`: keep the entries if they landed, else drop them."""
        for key, slot in zip(keys, slots):
            entry = self._release((namespace_id, key), slot) if slot != NO_SLOT else None
            if entry is None:
                continue
            if landed:
                entry.landed = True
                self.stored += 1
            else:
                self._drop((namespace_id, key))

    def _evict(self) -> int:
        for name, entry in self._entries.items():
            if entry.pins == 0:
                del self._entries[name]
                self.evictions += 1
                return entry.slot
        return NO_SLOT

    def _drop(self, name: tuple[bytes, bytes]) -> None:
        entry = self._entries.get(name)
        if entry is not None and entry.pins == 0:
            del self._entries[name]
            self._free.append(entry.slot)
        elif entry is not None:
            # Pinned by a load in flight: forget the name, the slot comes back when the load ends.
            del self._entries[name]
            self._orphans[entry.slot] = entry

    def verify(self) -> None:
        """Every slot is free, held by one entry, or orphaned and pinned: never two of these."""
        held = [entry.slot for entry in self._entries.values()] + list(self._orphans)
        check(len(set(held)) == len(held) and not set(held) & set(self._free), "a device tier slot used twice")
        check(len(held) + len(self._free) == self.slot_count, "device tier slots lost: {} held, {} free of {}",
              len(held), len(self._free), self.slot_count)
        check(all(entry.pins > 0 for entry in self._orphans.values()), "an orphaned device tier slot with no pin")

    def close(self) -> None:
        self.device.free(self.memory)
