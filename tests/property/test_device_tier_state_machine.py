"""The device tier's bookkeeping under random saves (with plans that leave some layers on the host),
loads, landings and removals (hypothesis state machine): a slot a load is reading is never handed to
a save; a copy is served only for the very block it was made from, and only once its save landed;
its layers are the ones its plan keeps, each at its own place; no slot is lost or held twice."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvd.device import open_device
from kvd.device.transfer import ABSENT
from kvd.planner.distance import NONE, is_offloaded
from kvd.planes.device_tier import DeviceTier

NS = b"n" * 32
KEYS = [bytes([i]) * 32 for i in range(8)]
SLOTS = 5
PAGE, LAYERS = 2048, 4  # two layers to a slot: a whole block takes two slots, a plan at distance 1 one


class Block:
    """Stands for the index's Block: only its identity matters."""


class DeviceTierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tier = DeviceTier(open_device("cpu"), SLOTS * 2 * PAGE, 2 * PAGE)
        self.index = {key: Block() for key in KEYS}     # the blocks the index serves now
        self.landed: dict[bytes, tuple[Block, object]] = {}  # key -> (block, entry) of a copy that landed
        self.saves: list[tuple[list[bytes], list, list[Block]]] = []
        self.latest: dict[bytes, list] = {}  # key -> the entries list of the save that placed it last
        self.loads: list[tuple[list[bytes], list]] = []

    def _reading(self) -> set[int]:
        return {slot for _, entries in self.loads for entry in entries if entry is not None for slot in entry.slots}

    @rule(picks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True),
          distance=st.sampled_from([NONE, 1, 3]))
    def save(self, picks, distance) -> None:
        blocks = [self.index[key] for key in picks]
        entries = self.tier.place(NS, picks, blocks, PAGE, LAYERS, distance)
        placed = [slot for entry in entries if entry is not None for slot in entry.slots]
        assert not set(placed) & self._reading(), "a save got a slot a load is reading"
        assert len(set(placed)) == len(placed)
        for entry in entries:
            if entry is not None:
                kept = [layer for layer in range(LAYERS) if not is_offloaded(distance, layer + 1)]
                assert [layer for layer in range(LAYERS) if entry.offsets[layer] != ABSENT] == kept
                places = {int(entry.offsets[layer]) // PAGE for layer in kept}
                assert len(places) == len(kept), "two layers of a copy at one place"
                assert {place // 2 for place in places} == set(entry.slots), "a layer outside the entry's slots"
        for key in picks:
            self.landed.pop(key, None)
            self.latest[key] = entries
        self.saves.append((picks, entries, blocks))

    @precondition(lambda self: self.saves)
    @rule(which=st.integers(0, 10), landed=st.booleans())
    def save_ends(self, which, landed) -> None:
        keys, entries, blocks = self.saves.pop(which % len(self.saves))
        self.tier.settle(NS, keys, entries, landed)
        for key, entry, block in zip(keys, entries, blocks):
            # Only the key's latest save counts: an earlier one's copy was let go when it was placed again.
            if landed and entry is not None and self.latest.get(key) is entries:
                self.landed[key] = (block, entry)

    @rule(picks=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4, unique=True))
    def load(self, picks) -> None:
        entries = self.tier.find(NS, picks, [self.index[key] for key in picks])
        for key, entry in zip(picks, entries):
            if entry is not None:
                block, landed_entry = self.landed.get(key, (None, None))
                assert block is self.index[key] and landed_entry is entry, "served a copy it must not"
        self.loads.append((picks, entries))

    @precondition(lambda self: self.loads)
    @rule(which=st.integers(0, 10))
    def load_ends(self, which) -> None:
        keys, entries = self.loads.pop(which % len(self.loads))
        self.tier.unpin(NS, keys, entries)

    @rule(key=st.sampled_from(KEYS))
    def removed_and_stored_again(self, key) -> None:
        self.index[key] = Block()

    @invariant()
    def consistent(self) -> None:
        self.tier.verify()

    def teardown(self) -> None:
        for keys, entries, _ in self.saves:
            self.tier.settle(NS, keys, entries, False)
        for keys, entries in self.loads:
            self.tier.unpin(NS, keys, entries)
        self.tier.verify()
        assert len(self.tier) <= SLOTS
        self.tier.close()


TestDeviceTier = DeviceTierMachine.TestCase
TestDeviceTier.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
