"""Fake bytes: what each slot of each tier would hold, moved as the daemon moves bytes.

Every slot holds the key of the block whose bytes were written there. A
writer fills its reserved host slots, write-back copies host slots to the
slots of a tier below (the disk, a middle tier), a Get copies a lower
tier's slots into the host slots the engine chose, and a journalled
removal empties a disk slot. Whatever the engine then serves can
be checked against the one property that matters: a Get returns the block
that was Put under that key, or nothing, never another block.

The unit tests of the engine's disk tier and the simulator share this.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from kvd.core.block import NO_SLOT, Block
from kvd.core.engine import Engine, Transfer
from kvd.core.tier import Tier
from kvd.invariants import check


class SlotContents:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.host: dict[int, bytes] = {}
        # Per tier below host memory: slot -> key.
        self.lower: dict[Tier, dict[int, bytes]] = {tier: {} for tier in engine.lower_tiers}
        self.disk: dict[int, bytes] = self.lower[engine.disk] if engine.disk is not None else {}

    def fill(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """A writer wrote its reserved host slots (NO_SLOT: not reserved)."""
        for key, slot in zip(keys, slots):
            if slot != NO_SLOT:
                self.host[slot] = key

    def write(self, writes: Sequence[Transfer], failing: Container[bytes] = ()) -> list[bool]:
        """Copy host slots to a lower tier's slots; blocks whose key is in `failing` fail."""
        ok = []
        for write in writes:
            good = write.block.key not in failing
            if good:
                self.lower[write.target][write.target_slot] = self.host[write.source_slot]
            ok.append(good)
        return ok

    def load(self, loads: Sequence[Transfer], corrupt: Container = ()) -> list[bool]:
        """Copy lower tiers' slots into host slots; those in `corrupt` read back
        bad (disk slots, or (tier name, slot) pairs for any tier)."""
        ok = []
        for load in loads:
            source = load.source
            good = ((source.name, load.source_slot) not in corrupt
                    and not (source is self.engine.disk and load.source_slot in corrupt))
            if good:
                self.host[load.target_slot] = self.lower[source][load.source_slot]
            ok.append(good)
        return ok

    def drop(self, removals: Sequence[tuple[bytes, bytes, int]]) -> list[int]:
        """Journal removals (namespace id, key, disk slot): the slots, to confirm."""
        for _, _, slot in removals:
            self.disk.pop(slot, None)
        return [slot for _, _, slot in removals]

    def journal_removals(self) -> None:
        """Make the engine's pending disk removals durable, at once."""
        self.engine.disk_removals_journalled(self.drop(self.engine.take_disk_removals()))

    def served(self, blocks: Sequence[Block]) -> list[bytes]:
        """What a client copies out of the host slots of `blocks`."""
        return [self.host.get(self.engine.host_slot(block), b"") for block in blocks]

    def check_served(self, blocks: Sequence[Block]) -> None:
        for block, content in zip(blocks, self.served(blocks)):
            check(content == block.key, f"served {block!r} holds the bytes of another block")
