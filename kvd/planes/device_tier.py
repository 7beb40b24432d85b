"""The device tier: a daemon-owned pool of device memory ([device] tier_bytes) above host memory,
holding copies of the blocks engines saved, so another engine's load is a device-to-device copy
that never passes through host memory.

It is a cache of the host tier, never the only copy: a save stores every block in the arena
first, and the tier keeps a copy of it. Entries are found by (namespace, key) and trusted only
for the very Block object of the index they were made from: a block that was removed and stored
again under the same key is a new Block, so an old copy is never served for it. The least recently
used unpinned entry makes room. A load pins the entries it reads until its copies have landed, so
no save overwrites them meanwhile.

A copy may hold only some of the block's layers: a save that carries a placement plan's offload
distance d (docs/planner.md) keeps here the layers the plan keeps on the device, and leaves every
(d+1)-th layer in host memory, from where a load fetches it. Memory is fixed-size slots; an entry
packs its layers `slot_bytes // page_bytes` to a slot, so a plan that leaves layers on the host
frees whole slots when slots are a few layers wide (tier_slot_bytes).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from kvd.device import Device
from kvd.device.transfer import ABSENT
from kvd.invariants import check
from kvd.planner.distance import NONE, is_offloaded


@dataclass(slots=True, eq=False)
class Entry:
    slots: tuple[int, ...]
    offsets: np.ndarray  # per layer, its byte offset in the tier's memory, or ABSENT
    block: object        # the index's Block this copy was made from
    pins: int = 0
    landed: bool = False  # its save's copies are all in: before that it is never served


def resident_layers(layers: int, distance: int) -> np.ndarray:
    """The layers (0-based) a plan at `distance` keeps on the device: all but every (d+1)-th."""
    return np.array([layer for layer in range(layers) if not is_offloaded(distance, layer + 1)], dtype=np.int64)


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
        self._orphans: dict[int, Entry] = {}  # id(entry) -> entry
        self.hits = self.misses = self.evictions = self.stored = 0
        self.host_layers = 0  # layers of placed copies left in host memory by their plans

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def used_slots(self) -> int:
        return self.slot_count - len(self._free)

    def find(self, namespace_id: bytes, keys, blocks) -> list[Entry | None]:
        """The entry holding each block (None where none), pinned; `unpin` them once read."""
        found = []
        for key, block in zip(keys, blocks):
            entry = self._entries.get((namespace_id, key))
            if entry is not None and entry.block is not block:
                self._drop((namespace_id, key))  # another block under that key now: the copy is stale
                entry = None
            if entry is None or not entry.landed:
                self.misses += 1
                found.append(None)
                continue
            self.hits += 1
            entry.pins += 1
            self._entries.move_to_end((namespace_id, key))
            found.append(entry)
        return found

    def holds(self, namespace_id: bytes, keys, blocks) -> list[bool]:
        """Whether a landed copy of each block is here (Lookup's view: no pin, no recency, no count)."""
        held = []
        for key, block in zip(keys, blocks):
            entry = self._entries.get((namespace_id, key))
            held.append(entry is not None and entry.block is block and entry.landed)
        return held

    def unpin(self, namespace_id: bytes, keys, entries) -> None:
        for key, entry in zip(keys, entries):
            if entry is not None:
                self._release((namespace_id, key), entry)

    def _release(self, name: tuple[bytes, bytes], entry: Entry) -> bool:
        """Drop one pin of `entry`; whether it still holds that name (False: it was orphaned)."""
        check(entry.pins > 0, "a device tier entry unpinned more often than pinned")
        entry.pins -= 1
        if self._entries.get(name) is entry:
            return True
        if entry.pins == 0:
            del self._orphans[id(entry)]
            self._free.extend(entry.slots)
        return False

    def place(self, namespace_id: bytes, keys, blocks, page_bytes: int, layers: int,
              distance: int = NONE) -> list[Entry | None]:
        """Entries for new copies of `blocks` (None where no room), pinned until `settle`: the layers
        a plan at `distance` keeps on the device (NONE: every layer)."""
        per_slot = self.slot_bytes // page_bytes
        resident = resident_layers(layers, distance)
        if per_slot == 0:
            return [None] * len(keys)
        need = -(-len(resident) // per_slot)
        placed = []
        for key, block in zip(keys, blocks):
            self._drop((namespace_id, key))
            slots = self._take(need)
            entry = None
            if slots is not None:
                offsets = np.full(layers, ABSENT, dtype=np.int64)
                rank = np.arange(len(resident))
                offsets[resident] = np.asarray(slots, dtype=np.int64)[rank // per_slot] * self.slot_bytes \
                    + (rank % per_slot) * page_bytes
                entry = Entry(tuple(slots), offsets, block, pins=1)
                self._entries[(namespace_id, key)] = entry
                self.host_layers += layers - len(resident)
            placed.append(entry)
        return placed

    def _take(self, need: int) -> list[int] | None:
        """`need` free slots, evicting the least recently used unpinned entries for them; None if
        every entry is pinned before enough are free (what was evicted stays free)."""
        while len(self._free) < need:
            name = next((name for name, entry in self._entries.items() if entry.pins == 0), None)
            if name is None:
                return None
            self._free.extend(self._entries.pop(name).slots)
            self.evictions += 1
        return [self._free.pop() for _ in range(need)]

    def settle(self, namespace_id: bytes, keys, entries, landed: bool) -> None:
        """After a save's copies into `entries`: keep them if they landed, else drop them."""
        for key, entry in zip(keys, entries):
            if entry is None or not self._release((namespace_id, key), entry):
                continue
            if landed:
                entry.landed = True
                self.stored += 1
            else:
                self._drop((namespace_id, key))

    def _drop(self, name: tuple[bytes, bytes]) -> None:
        entry = self._entries.pop(name, None)
        if entry is not None and entry.pins == 0:
            self._free.extend(entry.slots)
        elif entry is not None:
            # Pinned by a load in flight: forget the name, the slots come back when the load ends.
            self._orphans[id(entry)] = entry

    def verify(self) -> None:
        """Every slot is free, held by one entry, or by an orphaned and pinned one: never two of these."""
        held = [slot for entry in (*self._entries.values(), *self._orphans.values()) for slot in entry.slots]
        check(len(set(held)) == len(held) and not set(held) & set(self._free), "a device tier slot used twice")
        check(len(held) + len(self._free) == self.slot_count, "device tier slots lost: {} held, {} free of {}",
              len(held), len(self._free), self.slot_count)
        check(all(entry.pins > 0 for entry in self._orphans.values()), "an orphaned device tier entry with no pin")

    def close(self) -> None:
        self.device.free(self.memory)
