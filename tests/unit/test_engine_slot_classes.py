"""Two models of different block sizes in one host tier carved into slot classes.

Host memory is 8 pages of 64 KiB with classes of 64, 32 and 16 KiB: a
model with 64 KiB blocks takes whole pages, one with 16 KiB blocks four
per page. Each namespace's blocks take slots of its own class only; a
class that needs a slot when every page is taken gets the page of the
blocks that went unused longest, all of them evicted; a page with a
pinned block is never taken; and no two resident blocks ever overlap in
bytes.
"""

from __future__ import annotations

import random

import pytest

from kvd.core.block import NO_SLOT
from kvd.core.engine import CommitRequest, Engine, KeysRequest
from kvd.core.keys import NamespaceSpec
from kvd.errors import ResourceExhausted
from kvd.testing import engine_ops
from kvd.testing.chains import text_chain as keys

PAGE = 64 << 10
PAGES = 8
BIG = NamespaceSpec(model_id="big", num_layers=4, num_kv_heads=1, head_dim=4096, block_tokens=1)
SMALL = NamespaceSpec(model_id="small", num_layers=1, num_kv_heads=1, head_dim=4096, block_tokens=1)
LONG = 10_000


class Rig:
    def __init__(self, min_slot_bytes: int = 16 << 10) -> None:
        self.engine = Engine(host_slot_count=PAGES, host_slot_bytes=PAGE, host_min_slot_bytes=min_slot_bytes)
        self.ns = {spec.model_id: self.engine.register_namespace(spec).namespace_id for spec in (BIG, SMALL)}

    def put(self, spec: NamespaceSpec, chain: str) -> int:
        request = KeysRequest(self.ns[spec.model_id], "w", keys(spec, chain), LONG, 0)
        result = self.engine.reserve(request)
        if result.lease is None:
            return 0
        sealed, _, _ = self.engine.commit(CommitRequest(request.namespace_id, "w", result.lease.lease_id, 0))
        return sealed

    def stored(self, spec: NamespaceSpec, chain: str) -> int:
        return len(self.engine.lookup(self.ns[spec.model_id], keys(spec, chain)))

    def check(self) -> None:
        """verify(), each block in a slot of its namespace's class, and no two blocks' bytes overlap."""
        engine = self.engine
        engine.verify()
        pool = engine.host.pool
        spans = []
        for state in engine.namespaces():
            for block in state.index:
                slot = engine.host_slot(block)
                if slot == NO_SLOT:
                    continue
                assert pool.class_of(slot).index == state.index.host_class
                assert pool.slot_bytes_of(slot) >= state.block_bytes
                spans.append((pool.offset_of(slot), pool.offset_of(slot) + pool.slot_bytes_of(slot)))
        spans.sort()
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "two blocks share bytes"
        assert all(end <= pool.page_count * pool.page_bytes for _, end in spans)


def test_namespaces_map_to_the_smallest_class_that_holds_their_blocks():
    rig = Rig()
    assert BIG.block_bytes == 64 << 10 and SMALL.block_bytes == 16 << 10
    assert [slot_class.slot_bytes for slot_class in rig.engine.host.pool.classes] == [64 << 10, 32 << 10, 16 << 10]
    assert rig.engine.namespace(rig.ns["big"]).index.host_class == 0
    assert rig.engine.namespace(rig.ns["small"]).index.host_class == 2


def test_small_blocks_pack_four_to_a_page_next_to_whole_page_blocks():
    rig = Rig()
    assert rig.put(SMALL, "abcdefgh") == 8  # two pages
    assert rig.put(BIG, "ABCDEF") == 6  # the six others
    rig.check()
    assert rig.engine.host.pool.free_pages == []
    assert rig.engine.host.counters.evictions == 0
    # One size of slot for both: the same memory holds 8 blocks, not 14.
    one_size = Rig(min_slot_bytes=PAGE)
    assert one_size.put(SMALL, "abcdefgh") == 8
    assert one_size.put(BIG, "ABCDEF") == 0 or one_size.engine.host.counters.evictions > 0


def test_a_full_tier_gives_the_page_of_the_oldest_blocks_to_the_class_that_needs_one():
    rig = Rig()
    assert rig.put(SMALL, "abcd") == 4  # page 0, used longest ago
    assert rig.put(BIG, "ABCDEFG") == 7  # pages 1-7
    assert rig.stored(BIG, "ABCDEFG") == 7  # touched since
    assert rig.put(BIG, "X") == 1  # no free page: page 0's four small blocks go
    rig.check()
    assert rig.stored(SMALL, "abcd") == 0 and rig.stored(BIG, "ABCDEFG") == 7
    assert rig.engine.host.counters.evictions == 4


def test_a_page_with_a_pinned_block_is_never_reclaimed():
    rig = Rig()
    assert rig.put(SMALL, "abcd") == 4
    assert rig.put(BIG, "ABCDEFG") == 7
    pins = engine_ops.acquire(rig.engine, rig.ns["small"], keys(SMALL, "abcd"))
    assert len(pins) == 4
    assert rig.put(BIG, "X") == 1  # a big block of its own class goes instead
    rig.check()
    assert rig.stored(SMALL, "abcd") == 4 and rig.stored(BIG, "ABCDEFG") == 6
    for pin in pins:
        pin.release()
    rig.check()


def test_a_class_finds_its_own_candidate_past_the_front_of_the_eviction_order():
    """80 pages: 70 hold four small blocks each, one of them pinned (so no
    such page can be emptied), and their 210 unpinned blocks are the oldest
    candidates; 10 pages hold big blocks. A big Put must still evict a big
    block, however far down the order the first one is."""
    engine = Engine(host_slot_count=80, host_slot_bytes=PAGE, host_min_slot_bytes=16 << 10)
    rig = Rig.__new__(Rig)
    rig.engine = engine
    rig.ns = {spec.model_id: engine.register_namespace(spec).namespace_id for spec in (BIG, SMALL)}
    small_chains = [f"s{page:03d}{position}" for page in range(70) for position in range(4)]
    for chain in small_chains:
        assert rig.put(SMALL, chain) >= 1
    assert rig.put(BIG, "ABCDEFGHIJ") == 10
    pins = [pin for chain in small_chains[::4]
            for pin in engine_ops.acquire(engine, rig.ns["small"], keys(SMALL, chain))]
    assert len(engine.host.policy) > 64 and not engine.host.pool.free_pages
    assert rig.put(BIG, "X") == 1
    rig.check()
    assert rig.stored(BIG, "ABCDEFGHIJ") == 9  # its leaf went
    for pin in pins:
        pin.release()
    rig.check()


@pytest.mark.parametrize("seed", range(6))
def test_a_random_two_model_workload_keeps_every_invariant(seed):
    rng = random.Random(seed)
    rig = Rig()
    held = []
    for _ in range(300):
        spec = rng.choice((BIG, SMALL))
        chain = "".join(rng.choice("abc") for _ in range(rng.randint(1, 5)))
        action = rng.random()
        if action < 0.5:
            try:
                rig.put(spec, chain)
            except ResourceExhausted:
                pass  # every slot it could take is pinned: refused, nothing changed (check() below)
        elif action < 0.7:
            rig.stored(spec, chain)
        elif action < 0.8:
            held.extend(engine_ops.acquire(rig.engine, rig.ns[spec.model_id], keys(spec, chain)))
        elif action < 0.9 and held:
            held.pop(rng.randrange(len(held))).release()
        else:
            rig.engine.delete(rig.ns[spec.model_id], keys(spec, chain)[-1:])
        rig.check()
    for pin in held:
        pin.release()
    rig.check()
