"""S3-FIFO (kvd.core.policy.s3fifo): exact queue contents on its own, scan
resistance against LRU on its own and inside the engine, and a Hypothesis
state machine against a plain-list model of the same rules."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvd.core.block import Block, BlockState
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.policy import make_policy
from kvd.core.policy.lru import LruPolicy
from kvd.core.policy.s3fifo import COLD, FREQUENCY, LINKED, MAIN, S3FifoPolicy
from kvd.core.radix import PrefixIndex
from kvd.invariants import InvariantError
from kvd.testing import core_ops, engine_ops
from kvd.core.requests import CommitRequest, KeysRequest

INDEX = PrefixIndex("s3fifo-test")
NAMES = "abcdefghijklmnopqrstuvwxyz"


def new_block(name: str) -> Block:
    return Block(key=name.encode().ljust(32, b"\0"), index=INDEX, parent=None, state=BlockState.SEALED)


class Named:
    """Blocks by one-letter name, and the policy's queues as strings."""

    def __init__(self, policy: S3FifoPolicy, names: str) -> None:
        self.policy = policy
        self.blocks = {name: new_block(name) for name in names}

    def __getitem__(self, name: str) -> Block:
        return self.blocks[name]

    def name(self, block: Block | None) -> str | None:
        return None if block is None else block.key.rstrip(b"\0").decode()

    def queues(self) -> tuple[str, str]:
        small, main = self.policy.queues()
        return "".join(map(self.name, small)), "".join(map(self.name, main))

    def ghost(self) -> str:
        return "".join(key.rstrip(b"\0").decode() for key in core_ops.ghost_keys(self.policy))

    def evict(self) -> str | None:
        victim = self.policy.victim()
        if victim is not None:
            self.policy.remove(victim)
        self.policy.verify()
        return self.name(victim)

    def admit(self, names: str, *, cold: bool = False) -> None:
        for name in names:
            self.policy.admit(self.blocks[name], cold=cold)
        self.policy.verify()


@pytest.fixture
def s3() -> Named:
    return Named(S3FifoPolicy(slot_count=10), NAMES)


def frequency(block: Block) -> int:
    return block.policy_state & FREQUENCY


def test_make_policy_knows_s3fifo_and_lists_the_known_names():
    policy = make_policy("s3fifo", 50)
    assert isinstance(policy, S3FifoPolicy) and policy.name == "s3fifo"
    assert policy.ghost_limit == 45
    with pytest.raises(ValueError, match=r"unknown eviction policy 'arc' \(known: lru, s3fifo\)"):
        make_policy("arc")


def test_new_blocks_enter_small_and_unused_ones_leave_first_in_fifo_order(s3):
    s3.admit("abcd")
    assert s3.queues() == ("abcd", "")
    assert len(s3.policy) == 4 and all(s3[name] in s3.policy for name in "abcd")
    assert [s3.evict() for _ in range(4)] == list("abcd")
    assert s3.evict() is None
    # Evicted from S: remembered in the ghost, oldest first.
    assert s3.ghost() == "abcd"


def test_a_used_block_moves_to_main_when_it_reaches_the_end_of_small(s3):
    s3.admit("abcd")
    s3.policy.touch(s3["b"])
    s3.policy.touch(s3["c"])
    s3.policy.touch(s3["c"])
    assert s3.queues() == ("abcd", "")  # a use moves nothing
    assert s3.evict() == "a"
    # Looking for the next victim moves b and c to M (count cleared) and
    # finds d; M holds only blocks that were used.
    assert s3.evict() == "d"
    assert s3.queues() == ("", "bc")
    assert frequency(s3["b"]) == frequency(s3["c"]) == 0
    assert s3.ghost() == "ad"


def fill_main(s3: Named, names: str) -> None:
    """Make `names` the contents of M (used once each, moved on the way)."""
    s3.admit(names)
    for name in names:
        s3.policy.touch(s3[name])
    assert s3.name(s3.policy.victim()) == names[0]  # found, not removed
    assert s3.queues() == ("", names)


def test_small_is_evicted_while_it_holds_a_tenth_of_the_candidates(s3):
    fill_main(s3, "abcdefghi")
    s3.admit("jk")
    # S holds 2 of 11 candidates (at least a tenth): S's unused oldest goes.
    assert s3.evict() == "j"
    # 1 of 10: still a tenth.
    assert s3.evict() == "k"
    # S empty: M's oldest, count 0.
    assert s3.evict() == "a"


def test_main_is_evicted_while_small_is_under_a_tenth(s3):
    fill_main(s3, "abcdefghij")
    s3.admit("k")
    # 1 of 11 is under a tenth: M gives up its oldest, k stays.
    assert s3.evict() == "a"
    assert s3.queues() == ("k", "bcdefghij")
    # 1 of 10 is a tenth again.
    assert s3.evict() == "k"


def test_main_reinserts_used_blocks_and_spends_one_use_each_time(s3):
    s3.admit("abc")
    for name in "abc":
        s3.policy.touch(s3[name])
    s3.admit("x")
    assert s3.evict() == "x"
    assert s3.queues() == ("", "abc")
    s3.policy.touch(s3["a"])
    s3.policy.touch(s3["a"])
    s3.policy.touch(s3["b"])
    assert s3.evict() == "c"  # a and b go round once (a: 2 -> 1, b: 1 -> 0)
    assert s3.queues() == ("", "ab")
    assert (frequency(s3["a"]), frequency(s3["b"])) == (1, 0)
    assert s3.evict() == "b"
    assert s3.evict() == "a"
    # Evictions from M leave no ghost.
    assert s3.ghost() == "x"


def test_uses_saturate_at_three(s3):
    s3.admit("a")
    for _ in range(10):
        s3.policy.touch(s3["a"])
    assert frequency(s3["a"]) == 3


def test_victim_is_stable_and_does_not_remove(s3):
    s3.admit("abc")
    s3.policy.touch(s3["a"])
    first = s3.policy.victim()
    queues = s3.queues()
    assert s3.policy.victim() is first is s3["b"]
    assert s3.queues() == queues == ("bc", "a")
    assert s3["b"] in s3.policy and len(s3.policy) == 3


def test_a_ghost_hit_goes_straight_to_main(s3):
    s3.admit("ab")
    assert s3.evict() == "a"
    assert s3.ghost() == "a"
    # The same key again (a new record, as after a Put of an evicted block).
    again = new_block("a")
    s3.blocks["a"] = again
    s3.admit("a")
    assert s3.queues() == ("b", "a")
    assert s3.ghost() == ""


def test_the_ghost_is_bounded_oldest_first():
    s3 = Named(S3FifoPolicy(slot_count=4), NAMES)  # ghost limit 3
    assert s3.policy.ghost_limit == 3
    s3.admit("abcde")
    for _ in range(5):
        s3.evict()
    assert s3.ghost() == "cde"


def test_a_pin_keeps_the_queue_and_the_uses(s3):
    """remove() that is not an eviction (a Get pins the block) remembers
    where the block was; admit() puts it back there, at the newest end."""
    s3.admit("abc")
    s3.policy.touch(s3["a"])
    s3.admit("x")
    assert s3.evict() == "b"  # a moved to M on the way
    assert s3.queues() == ("cx", "a")
    s3.policy.touch(s3["a"])
    s3.policy.touch(s3["a"])
    s3.policy.remove(s3["a"])  # pinned
    assert s3["a"] not in s3.policy
    assert s3["a"].policy_state == MAIN | 2
    s3.admit("a")  # unpinned
    assert s3.queues() == ("cx", "a") and frequency(s3["a"]) == 2
    # In S too: a pinned block of S comes back to S's newest end, uses kept.
    s3.policy.touch(s3["c"])
    s3.policy.remove(s3["c"])
    assert s3["c"].policy_state == 1
    s3.admit("c")
    assert s3.queues() == ("xc", "a") and frequency(s3["c"]) == 1
    assert s3.ghost() == "b"


def test_eviction_clears_the_state(s3):
    s3.admit("ab")
    s3.policy.touch(s3["a"])
    s3.admit("c")
    assert s3.evict() == "b"
    assert s3["b"].policy_state == 0
    s3.policy.touch(s3["c"])
    # Looking for a victim moves c to M and finds a (its count was cleared
    # when it moved). Something else happening between victim() and
    # remove() makes the remove an ordinary one: a keeps its place in M
    # (to come back to) and leaves no ghost.
    victim = s3.policy.victim()
    assert victim is s3["a"]
    s3.policy.touch(s3["c"])
    s3.policy.remove(victim)
    assert victim.policy_state == MAIN
    assert s3.ghost() == "b"
    s3.admit("a")
    assert s3.queues() == ("", "ca")


def test_cold_admission_goes_next_in_line_before_anything(s3):
    s3.admit("abc")
    s3.admit("x", cold=True)
    s3.admit("y", cold=True)
    assert s3.queues() == ("yxabc", "")
    assert s3["y"].policy_state == LINKED | COLD
    for name in "abc":
        s3.policy.touch(s3[name])
    assert s3.evict() == "y"
    assert s3.evict() == "x"
    assert s3.queues() == ("abc", "")


def test_a_cold_block_goes_first_even_while_small_is_under_its_share(s3):
    fill_main(s3, "abcdefghij")
    s3.admit("x", cold=True)
    assert s3.evict() == "x"


def test_a_used_cold_block_is_warm_again(s3):
    s3.admit("ab")
    s3.admit("x", cold=True)
    s3.policy.touch(s3["x"])
    assert s3.queues() == ("abx", "")
    assert s3["x"].policy_state == LINKED | 1
    assert s3.evict() == "a"


def test_cold_admission_forgets_main_and_the_ghost(s3):
    s3.admit("a")
    s3.policy.touch(s3["a"])
    s3.admit("b")
    assert s3.evict() == "b"  # a moved to M on the way
    s3.policy.remove(s3["a"])  # got a child
    s3.admit("a", cold=True)  # the child was evicted: a follows it
    assert s3.queues() == ("a", "")
    s3.blocks["b"] = new_block("b")
    s3.admit("b", cold=True)  # its key was a ghost
    assert s3.ghost() == ""
    assert [s3.evict(), s3.evict()] == ["b", "a"]


def test_misuse_is_refused(s3):
    s3.admit("a")
    with pytest.raises(InvariantError):
        s3.policy.admit(s3["a"])
    with pytest.raises(InvariantError):
        s3.policy.admit(s3["a"], cold=True)
    with pytest.raises(InvariantError):
        s3.policy.remove(s3["b"])
    with pytest.raises(InvariantError):
        s3.policy.touch(s3["b"])
    assert s3.queues() == ("a", "")
    s3.policy.verify()


def corruptions():
    def broken_back_link(s3):
        s3["c"].policy_prev = s3["a"]

    def wrong_count(s3):
        s3.policy._small.length += 1

    def main_bit_in_small(s3):
        s3["a"].policy_state |= MAIN

    def cold_behind_warm(s3):
        s3["b"].policy_state |= COLD

    def candidate_in_ghost(s3):
        s3.policy._ghost[s3["a"].key] = s3["a"].index.namespace_id

    def ghost_over_limit(s3):
        for n in range(20):
            s3.policy._ghost[bytes([n]) * 32] = True

    return [broken_back_link, wrong_count, main_bit_in_small, cold_behind_warm, candidate_in_ghost, ghost_over_limit]


@pytest.mark.parametrize("corrupt", corruptions(), ids=lambda f: f.__name__)
def test_verify_catches_corruption(s3, corrupt):
    s3.admit("abc")
    s3.policy.verify()
    corrupt(s3)
    with pytest.raises(InvariantError):
        s3.policy.verify()


# ----------------------------------------------------------------------
# Scan resistance


def run_cache(policy, capacity: int, trace: str) -> set[str]:
    """A cache of `capacity` blocks driven by `policy`: a hit touches, a miss
    evicts the victim if full and admits. Returns the names cached at the end."""
    cached: dict[str, Block] = {}
    for name in trace:
        if name in cached:
            policy.touch(cached[name])
            continue
        if len(cached) == capacity:
            victim = policy.victim()
            policy.remove(victim)
            del cached[victim.key.rstrip(b"\0").decode()]
        cached[name] = new_block(name)
        policy.admit(cached[name])
        policy.verify()
    return set(cached)


def test_a_one_pass_scan_keeps_the_hot_set_under_s3fifo_but_not_lru():
    hot = "abcd"
    scan = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"  # 36 blocks, each seen once
    trace = hot + hot + hot + scan
    assert run_cache(S3FifoPolicy(10), 10, trace) >= set(hot)
    assert not run_cache(LruPolicy(), 10, trace) & set(hot)


SPEC = NamespaceSpec(model_id="s3fifo-engine", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)


def engine_put(engine, ns: bytes, chain: str) -> None:
    result = engine.reserve(KeysRequest(ns, "writer", chain_keys(SPEC, [ord(ch) for ch in chain]), 10_000, 0))
    engine.commit(CommitRequest(ns, "writer", result.lease.lease_id, 0))


def stored_chains(engine, ns: bytes, chains: list[str]) -> list[str]:
    """The chains stored whole."""
    return [chain for chain in chains if len(engine.lookup(ns, chain_keys(SPEC, [ord(ch) for ch in chain]))) == 2]


@pytest.mark.parametrize(("policy", "hot_survives"), [("lru", False), ("s3fifo", True)])
@pytest.mark.parametrize("use", ["lookup", "get"])
def test_engine_scan_resistance(engine_factory, policy, hot_survives, use):
    """Hot prefixes used again (by Lookup, or by Get, which pins and
    releases them) survive a scan of 40 two-block prefixes, each Put once,
    under S3-FIFO; LRU evicts them all."""
    engine = engine_factory(12, 64, policy=policy)
    ns = engine.register_namespace(SPEC).namespace_id
    hot = ["ab", "cd", "ef"]
    for chain in hot:
        engine_put(engine, ns, chain)
    for _ in range(2):
        for chain in hot:
            keys = chain_keys(SPEC, [ord(ch) for ch in chain])
            if use == "lookup":
                engine.lookup(ns, keys)
            else:
                lease, _ = engine_ops.get(engine, KeysRequest(ns, "reader", keys, 10_000, 0))
                engine.release("reader", [lease.lease_id])
            engine.verify()
    scan = [chr(0x100 + 2 * n) + chr(0x101 + 2 * n) for n in range(40)]
    for chain in scan:
        engine_put(engine, ns, chain)
        engine.verify()
    # Every slot was needed: 3 * 2 hot + 40 * 2 scan blocks in 12 slots.
    assert engine.host.counters.evictions >= 40 * 2 + 6 - 12
    assert stored_chains(engine, ns, hot) == (hot if hot_survives else [])


# ----------------------------------------------------------------------
# The policy against a plain model


class Model:
    """The same rules, written plainly over lists of names."""

    def __init__(self, ghost_limit: int) -> None:
        self.small: list[str] = []  # oldest first
        self.main: list[str] = []
        self.ghost: list[str] = []
        self.ghost_limit = ghost_limit
        self.uses: dict[str, int] = {}
        self.was_main: dict[str, bool] = {}
        self.cold: set[str] = set()
        self.last_victim: str | None = None

    def candidates(self) -> list[str]:
        return self.small + self.main

    def admit(self, name: str, cold: bool) -> None:
        self.last_victim = None
        recalled = name in self.ghost
        if recalled:
            self.ghost.remove(name)
        if cold:
            self.small.insert(0, name)
            self.cold.add(name)
            self.uses[name] = 0
            self.was_main[name] = False
        elif self.was_main.get(name, False):
            self.main.append(name)
        elif recalled:
            self.main.append(name)
            self.was_main[name] = True
            self.uses[name] = 0
        else:
            self.small.append(name)
            self.uses.setdefault(name, 0)

    def remove(self, name: str) -> None:
        evicted = name == self.last_victim
        self.last_victim = None
        if name in self.main:
            self.main.remove(name)
        else:
            self.small.remove(name)
        self.cold.discard(name)
        if evicted:
            if not self.was_main.get(name, False):
                self.ghost.append(name)
                if len(self.ghost) > self.ghost_limit:
                    self.ghost.pop(0)
            self.uses[name] = 0
            self.was_main[name] = False

    def touch(self, name: str) -> None:
        self.last_victim = None
        if name in self.cold:
            self.cold.discard(name)
            self.small.remove(name)
            self.small.append(name)
            self.uses[name] = 1
        else:
            self.uses[name] = min(3, self.uses[name] + 1)

    def victim(self) -> str | None:
        while True:
            total = len(self.small) + len(self.main)
            if self.small and (self.small[0] in self.cold or not self.main or 10 * len(self.small) >= total):
                name = self.small[0]
                if self.uses[name] > 0:
                    self.small.pop(0)
                    self.main.append(name)
                    self.was_main[name] = True
                    self.uses[name] = 0
                    continue
                self.last_victim = name
                return name
            if not self.main:
                return None
            name = self.main[0]
            if self.uses[name] > 0:
                self.main.append(self.main.pop(0))
                self.uses[name] -= 1
                continue
            self.last_victim = name
            return name

    def forget(self, name: str) -> None:
        """A new record for the same key (the old one left the index)."""
        self.uses.pop(name, None)
        self.was_main.pop(name, None)


POOL = "abcdefghijklmnopqrst"  # more names than the sizes below, so S takes a tenth
names = st.sampled_from(POOL)


class S3FifoMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.policy = S3FifoPolicy(slot_count=5)  # ghost limit 4: trimmed often
        self.model = Model(self.policy.ghost_limit)
        self.blocks = {name: new_block(name) for name in POOL}

    def name(self, block: Block | None) -> str | None:
        return None if block is None else block.key.rstrip(b"\0").decode()

    @rule(name=names, cold=st.booleans())
    def admit(self, name, cold):
        if name in self.model.candidates():
            with pytest.raises(InvariantError):
                self.policy.admit(self.blocks[name], cold=cold)
            return
        self.policy.admit(self.blocks[name], cold=cold)
        self.model.admit(name, cold)

    @rule(name=names)
    def remove(self, name):
        if name not in self.model.candidates():
            with pytest.raises(InvariantError):
                self.policy.remove(self.blocks[name])
            return
        self.policy.remove(self.blocks[name])
        self.model.remove(name)

    @rule(name=names)
    def touch(self, name):
        if name in self.model.candidates():
            self.policy.touch(self.blocks[name])
            self.model.touch(name)

    @rule()
    def victim(self):
        assert self.name(self.policy.victim()) == self.model.victim()

    @rule()
    def evict(self):
        expected = self.model.victim()
        victim = self.policy.victim()
        assert self.name(victim) == expected
        if victim is not None:
            self.policy.remove(victim)
            self.model.remove(expected)

    @rule(used=st.booleans())
    def admit_every_other_block(self, used):
        # Large queues quickly: S's share of a tenth matters only then.
        for name in POOL:
            if name not in self.model.candidates():
                self.admit(name, cold=False)
                if used:
                    self.touch(name)

    @rule(name=names)
    def put_again(self, name):
        if name not in self.model.candidates():
            self.blocks[name] = new_block(name)
            self.model.forget(name)

    @invariant()
    def same_queues_uses_and_ghost(self):
        self.policy.verify()
        small, main = self.policy.queues()
        assert [self.name(b) for b in small] == self.model.small
        assert [self.name(b) for b in main] == self.model.main
        assert len(self.policy) == len(self.model.candidates())
        for name in POOL:
            block = self.blocks[name]
            assert (block in self.policy) == (name in self.model.candidates())
            if block in self.policy:
                assert frequency(block) == self.model.uses[name]
                assert bool(block.policy_state & COLD) == (name in self.model.cold)
        assert [key.rstrip(b"\0").decode() for key in core_ops.ghost_keys(self.policy)] == self.model.ghost


S3FifoMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=60, deadline=None)
TestS3FifoAgainstModel = S3FifoMachine.TestCase
