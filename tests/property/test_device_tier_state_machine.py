"""The device tier's bookkeeping under random saves, loads, landings and removals (hypothesis state
machine): a slot a load is reading is never handed to a save; a copy is served only for the very
block it was made from, and only once its save landed; no slot is lost or held twice."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvd.device import open_device
from kvd.server.device_tier import NO_SLOT, DeviceTier

NS = b"n" * 32
KEYS = [bytes([i]) * 32 for i in range(8)]
SLOTS = 3


class Block:
    """Stands for the index's Block: only its identity matters."""


class DeviceTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tier = DeviceTier(open_device("cpu"), SLOTS * 4096, 4096)
        self.index = {key: Block() for key in KEYS}     # the blocks the index serves now
        self.landed: dict[bytes, tuple[Block, int]] = {}  # key -> (block, slot) of a copy that landed
        self.saves: list[tuple[list[bytes], list[int], list[Block]]] = []
        self.latest: dict[bytes, list[int]] = {}  # key -> the slots list of the save that placed it last
        self.loads: list[tuple[list[bytes], list[int]]] = []

    def _reading(self) -> set[int]:
        return {slot for _, slots in self.loads for slot in slots if slot != NO_SLOT}

    @rule(picks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def save(self, picks) -> None:
        blocks = [self.index[key] for key in picks]
        slots = self.tier.place(NS, picks, blocks, 4096)
        placed = [slot for slot in slots if slot != NO_SLOT]
        assert not set(placed) & self._reading(), "a save got a slot a load is reading"
        assert len(set(placed)) == len(placed)
        for key in picks:
            self.landed.pop(key, None)
            self.latest[key] = slots
        self.saves.append((picks, slots, blocks))

    @precondition(lambda self: self.saves)
    @rule(which=st.integers(0, 10), landed=st.booleans())
    def save_ends(self, which, landed) -> None:
        keys, slots, blocks = self.saves.pop(which % len(self.saves))
        self.tier.settle(NS, keys, slots, landed)
        for key, slot, block in zip(keys, slots, blocks):
            # Only the key's latest save counts: an earlier one's slot was let go when it was placed again.
            if landed and slot != NO_SLOT and self.latest.get(key) is slots:
                self.landed[key] = (block, slot)

    @rule(picks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def load(self, picks) -> None:
        slots = self.tier.find(NS, picks, [self.index[key] for key in picks])
        for key, slot in zip(picks, slots):
            if slot != NO_SLOT:
                block, landed_slot = self.landed.get(key, (None, NO_SLOT))
                assert block is self.index[key] and landed_slot == slot, "served a copy it must not"
        self.loads.append((picks, slots))

    @precondition(lambda self: self.loads)
    @rule(which=st.integers(0, 10))
    def load_ends(self, which) -> None:
        keys, slots = self.loads.pop(which % len(self.loads))
        self.tier.unpin(NS, keys, slots)

    @rule(key=st.sampled_from(KEYS))
    def removed_and_stored_again(self, key) -> None:
        self.index[key] = Block()

    @invariant()
    def consistent(self) -> None:
        self.tier.verify()

    def teardown(self) -> None:
        for keys, slots, _ in self.saves:
            self.tier.settle(NS, keys, slots, False)
        for keys, slots in self.loads:
            self.tier.unpin(NS, keys, slots)
        self.tier.verify()
        assert len(self.tier) <= SLOTS
        self.tier.close()


TestDeviceTier = DeviceTierMachine.TestCase
TestDeviceTier.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
