"""The engine with tenants: per-tenant namespaces, and host and disk quotas.

Keys come from a one-token-per-block namespace, so a string names a chain
(K("abc") = keys of "a", "ab", "abc"). Every step ends with engine.verify(),
which recomputes each tenant's usage from the slots and checks its
candidates against the host policy's.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvd.core.block import NO_SLOT
import kvd.core.eviction as eviction_module
from kvd.core.engine import Engine, ReserveStatus
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.quota import QuotaExceeded, TenantQuota
from kvd.errors import NotFound, PermissionDenied, ResourceExhausted
from kvd.testing.engine_snapshot import snapshot
from kvd.core.requests import CommitRequest, KeysRequest
from kvd.testing import engine_ops

SPEC = NamespaceSpec(model_id="tenant-test", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
SLOT = 64
LONG = 10_000


def K(chain: str) -> list[bytes]:
    return chain_keys(SPEC, [ord(ch) for ch in chain])


def tenant_spec(tenant: str) -> NamespaceSpec:
    return dataclasses.replace(SPEC, tenant=tenant)


def put(engine: Engine, namespace_id: bytes, chain: str, client: str = "w", parent: str = "",
        verify: bool = True) -> int:
    keys = K(chain)[len(parent):]
    parent_key = K(parent)[-1] if parent else b""
    result = engine.reserve(KeysRequest(namespace_id, client, keys, LONG, 0, parent_key=parent_key))
    if result.lease is None:
        return 0
    sealed, _, _ = engine.commit(CommitRequest(namespace_id, client, result.lease.lease_id, 0))
    if verify:
        engine.verify()
    return sealed


def stored(engine: Engine, namespace_id: bytes, chain: str) -> int:
    return len(engine.lookup(namespace_id, K(chain)))


def test_identical_specs_of_two_tenants_are_two_namespaces():
    engine = Engine(host_slot_count=8, host_slot_bytes=SLOT)
    a = engine.register_namespace(tenant_spec("a"))
    b = engine.register_namespace(tenant_spec("b"))
    plain = engine.register_namespace(SPEC)
    assert len({a.namespace_id, b.namespace_id, plain.namespace_id}) == 3
    # Clients know all three by the same id: the digest of the spec they sent.
    assert a.public_id == b.public_id == plain.public_id == SPEC.namespace_id()
    assert engine.tenant_namespace("a", SPEC.namespace_id()) is a
    assert engine.tenant_namespace("b", SPEC.namespace_id()) is b
    assert engine.tenant_namespace("", SPEC.namespace_id()) is plain
    put(engine, a.namespace_id, "abc")
    assert stored(engine, a.namespace_id, "abc") == 3
    assert stored(engine, b.namespace_id, "abc") == stored(engine, plain.namespace_id, "abc") == 0
    # Another tenant's engine id is no id of this tenant's: the same error as an unknown one.
    with pytest.raises(NotFound) as foreign:
        engine.tenant_namespace("b", a.namespace_id)
    with pytest.raises(NotFound) as unknown:
        engine.tenant_namespace("b", bytes(32))
    assert str(foreign.value).replace(a.namespace_id.hex()[:16], "X") == str(unknown.value).replace("0" * 16, "X")
    with pytest.raises(NotFound):
        engine.tenant_namespace("c", SPEC.namespace_id())
    engine.verify()


def test_leases_of_another_scope_are_not_found_and_of_another_client_denied():
    engine = Engine(host_slot_count=8, host_slot_bytes=SLOT)
    a = engine.register_namespace(tenant_spec("a")).namespace_id
    put(engine, a, "ab", client="a\x00w")
    lease, _ = engine_ops.get(engine, KeysRequest(a, "a\x00reader", K("ab"), LONG, 0))
    with pytest.raises(NotFound):
        engine.release("b\x00reader", [lease.lease_id])
    with pytest.raises(NotFound):
        engine.renew("b\x00reader", lease.lease_id, LONG, 0)
    with pytest.raises(PermissionDenied):
        engine.release("a\x00other", [lease.lease_id])
    assert engine.release("a\x00reader", [lease.lease_id]) == 1
    engine.verify()


def host_quota_engine(slots: int, limit_slots: int) -> tuple[Engine, TenantQuota, bytes, bytes]:
    quota = TenantQuota("a", host_limit_bytes=limit_slots * SLOT)
    engine = Engine(host_slot_count=slots, host_slot_bytes=SLOT, tenant_quotas=[quota])
    a = engine.register_namespace(tenant_spec("a")).namespace_id
    b = engine.register_namespace(tenant_spec("b")).namespace_id
    return engine, quota, a, b


def test_a_put_past_the_host_quota_evicts_the_tenants_own_least_recently_used_blocks():
    engine, quota, a, b = host_quota_engine(slots=16, limit_slots=4)
    put(engine, b, "zyx")
    put(engine, a, "ab")
    put(engine, a, "cd")
    assert quota.host_used_bytes == 4 * SLOT
    engine.lookup(a, K("ab"))  # "ab" is now more recently used than "cd"
    assert put(engine, a, "e") == 1
    # One slot made: the tenant's least recently used leaf ("cd"'s tail) went,
    # the free slots and the other tenant's blocks were not used for it.
    assert quota.host_used_bytes == 4 * SLOT
    assert (stored(engine, a, "ab"), stored(engine, a, "cd"), stored(engine, a, "e")) == (2, 1, 1)
    assert stored(engine, b, "zyx") == 3
    assert quota.counters.host_evicted == 1
    assert len(engine.host.pool.free_slots) == 16 - 7


def test_a_put_the_quota_cannot_make_room_for_is_refused_and_changes_nothing():
    engine, quota, a, b = host_quota_engine(slots=16, limit_slots=3)
    put(engine, a, "abc")
    lease, _ = engine_ops.get(engine, KeysRequest(a, "r", K("abc"), LONG, 0))  # every block of the tenant pinned
    before = snapshot(engine)
    with pytest.raises(QuotaExceeded, match=r"tenant 'a' is over its host quota: its blocks take 192 of its 192 "):
        engine.reserve(KeysRequest(a, "w", K("x"), LONG, 0))
    assert snapshot(engine) == before
    assert quota.host_used_bytes == 3 * SLOT
    assert quota.counters.host_refused == 1
    # A Put larger than the quota itself can never fit.
    engine.release("r", [lease.lease_id])
    with pytest.raises(QuotaExceeded, match="needs 256 bytes .4 slots of 64 bytes., more than its whole quota of 192"):
        engine.reserve(KeysRequest(a, "w", K("wxyz"), LONG, 0))
    # The other tenant, with no quota, is not limited by this one's.
    assert put(engine, b, "abcdefgh") == 8
    engine.verify()


def test_keys_already_stored_are_not_charged_again_and_the_extended_block_is_kept():
    engine, quota, a, _ = host_quota_engine(slots=16, limit_slots=3)
    put(engine, a, "ab")
    put(engine, a, "x")
    # Extending "ab" by one needs one slot: "x" goes, not "ab"'s tail, which
    # the new block hangs under, even though "ab" is older.
    result = engine.reserve(KeysRequest(a, "w", K("abc"), LONG, 0))
    assert result.statuses == [ReserveStatus.EXISTS, ReserveStatus.EXISTS, ReserveStatus.RESERVED]
    engine.commit(CommitRequest(a, "w", result.lease.lease_id, 0))
    assert (stored(engine, a, "abc"), stored(engine, a, "x")) == (3, 0)
    assert quota.host_used_bytes == 3 * SLOT
    engine.verify()


def test_deletes_and_evictions_give_quota_back():
    engine, quota, a, b = host_quota_engine(slots=4, limit_slots=3)
    put(engine, a, "abc")
    engine.delete(a, [K("abc")[1]])
    assert quota.host_used_bytes == SLOT
    assert [block.key for block in quota.candidates] == K("a")
    # The other tenant fills the arena: global eviction takes the tenant's last block.
    put(engine, b, "wxyz")
    assert quota.host_used_bytes == 0 and not quota.candidates
    engine.verify()


def disk_engine(disk_limit_slots: int) -> tuple[Engine, TenantQuota, bytes, bytes]:
    quota = TenantQuota("a", disk_limit_bytes=disk_limit_slots * SLOT)
    engine = Engine(host_slot_count=32, host_slot_bytes=SLOT, disk_slot_count=8, disk_slot_bytes=SLOT,
                    tenant_quotas=[quota])
    a = engine.register_namespace(tenant_spec("a")).namespace_id
    b = engine.register_namespace(tenant_spec("b")).namespace_id
    engine.enable_disk(a)
    engine.enable_disk(b)
    return engine, quota, a, b


def flush(engine: Engine) -> list[bytes]:
    """Write what is queued, as the daemon's disk plane would; the keys made durable."""
    writes = engine.pick_writes(100)
    removals = engine.take_disk_removals()
    engine.finish_writes(writes, [True] * len(writes))
    engine.disk_removals_journalled([slot for _, _, slot in removals])
    engine.verify()
    return [write.block.key for write in writes if engine.disk_slot(write.block) == write.target_slot]


def test_a_tenant_at_its_disk_quota_replaces_its_own_disk_blocks_never_anothers():
    engine, quota, a, b = disk_engine(disk_limit_slots=2)
    put(engine, b, "zy")
    put(engine, a, "p")
    put(engine, a, "q")
    assert len(flush(engine)) == 4
    assert quota.disk_used_bytes == 2 * SLOT
    put(engine, a, "r")
    assert flush(engine) == K("r")
    # One of the tenant's own blocks gave its disk slot up (its host copy stays).
    on_disk = [chain for chain in "pqr" if engine.disk_slot(engine.namespace(a).index.get(K(chain)[0])) != NO_SLOT]
    assert len(on_disk) == 2 and "r" in on_disk
    assert quota.disk_used_bytes == 2 * SLOT
    assert quota.counters.disk_evicted == 1
    assert all(engine.disk_slot(engine.namespace(b).index.get(key)) != NO_SLOT for key in K("zy"))


def test_a_block_the_disk_quota_has_no_room_for_is_not_written():
    engine, quota, a, _ = disk_engine(disk_limit_slots=1)
    put(engine, a, "p")
    assert flush(engine) == K("p")
    # "pq": its only evictable own block would be its parent: nothing can go.
    put(engine, a, "pq", parent="p")
    assert flush(engine) == []
    assert quota.counters.disk_refused == 1
    assert quota.disk_used_bytes == SLOT
    # It stays in host memory, served from there.
    assert stored(engine, a, "pq") == 2
    assert engine.disk.counters.write_failures == 0


@pytest.mark.parametrize("seed", range(10))
def test_random_operations_keep_every_tenants_accounting_exact(seed):
    import random

    rng = random.Random(seed)
    quotas = [TenantQuota("a", host_limit_bytes=5 * SLOT, disk_limit_bytes=4 * SLOT),
              TenantQuota("b", host_limit_bytes=9 * SLOT)]
    engine = Engine(host_slot_count=12, host_slot_bytes=SLOT, disk_slot_count=10, disk_slot_bytes=SLOT,
                    tenant_quotas=quotas, policy=rng.choice(["lru", "s3fifo"]))
    namespaces = []
    for tenant in ("a", "b", "c"):
        state = engine.register_namespace(tenant_spec(tenant))
        engine.enable_disk(state.namespace_id)
        namespaces.append(state.namespace_id)
    leases: list[tuple[str, int]] = []
    for _ in range(300):
        namespace_id = rng.choice(namespaces)
        chain = "".join(rng.choice("abc") for _ in range(rng.randint(1, 4)))
        operation = rng.random()
        try:
            if operation < 0.45:
                put(engine, namespace_id, chain)
            elif operation < 0.6:
                plan = engine.begin_get(KeysRequest(namespace_id, "r", K(chain), LONG, 0))
                engine.finish_loads(plan.loads, [True] * len(plan.loads))
                engine.settle_get(plan)
                if plan.lease is not None:
                    leases.append(("r", plan.lease.lease_id))
            elif operation < 0.7 and leases:
                client, lease_id = leases.pop(rng.randrange(len(leases)))
                engine.release(client, [lease_id])
            elif operation < 0.8:
                engine.delete(namespace_id, [K(chain)[-1]])
            elif operation < 0.9:
                plan = engine.begin_prefetch(namespace_id, K(chain), max_in_flight=4)
                engine.finish_prefetch(plan.loads, [True] * len(plan.loads))
            else:
                flush(engine)
        except ResourceExhausted:
            pass  # over a quota, or every host slot pinned by the Gets' leases
        engine.verify()
        # Disk quotas are never exceeded (host ones can be, by Gets reading blocks back).
        assert all(quota.disk_used_bytes <= quota.disk_limit_bytes for quota in quotas if quota.disk_limit_bytes)


# ----------------------------------------------------------------------
# Per-tenant host memory: slots that change tenant are costly (a remap and
# zeroed pages), so a full host tier gives a tenant its own victims where
# the policy allows (Engine._allocate_host_slot).


def single(index: int) -> str:
    """A one-block chain of its own."""
    return chr(0x100 + index)


def engine_with_claims(slots: int, policy: str) -> tuple[Engine, list[tuple[int, str]]]:
    engine = Engine(host_slot_count=slots, host_slot_bytes=SLOT, policy=policy)
    claims: list[tuple[int, str]] = []
    engine.claim_host_slot = lambda slot, tenant: claims.append((slot, tenant))
    return engine, claims


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_tenants_taking_turns_in_a_full_host_tier_keep_their_own_slots(policy, monkeypatch):
    def take_turns() -> tuple[Engine, int]:
        engine, claims = engine_with_claims(256, policy)
        a = engine.register_namespace(tenant_spec("a")).namespace_id
        b = engine.register_namespace(tenant_spec("b")).namespace_id
        for index in range(256):
            assert put(engine, a if index < 128 else b, single(index), verify=False) == 1
        assert len(claims) == 256 and engine.host.pool.free_slots == []
        # Turns in a shuffled order: strictly alternating ones would make
        # plain LRU's victim the writer's own block anyway.
        writers = [a if turn else b for turn in random.Random(7).choices([0, 1], k=1000)]
        for index, writer in enumerate(writers, start=256):
            assert put(engine, writer, single(index), verify=False) == 1
        # The newest blocks stayed, whatever the policy kept of the rest.
        assert all(stored(engine, writer, single(index)) == 1 for index, writer in enumerate(writers, start=256)
                   if index >= 256 + 1000 - 32)
        engine.verify()
        return engine, len(claims) - 256

    engine, changes = take_turns()
    # A slot changes hands only when none of the writer's blocks is among
    # the next 8 (1/32 of the tier) to go.
    assert changes <= 256  # the first turns: b takes a's old slots until its own oldest are next
    by_tenant = {"a": 0, "b": 0}
    for block in engine.host.pool.owners:
        by_tenant[block.index.tenant] += 1
    assert sum(by_tenant.values()) == 256 and abs(by_tenant["a"] - 128) <= 64
    monkeypatch.setattr(eviction_module, "TENANT_AFFINITY_WINDOW", 0)
    _, changes_without = take_turns()
    assert changes_without >= 3 * changes  # 491 and 162 when written


def test_a_newcomer_tenant_takes_the_tier_over_chain_by_chain():
    """Candidates are chain leaves; the window counts the blocks that leave
    with them, so a tenant whose Puts are long chains is not stuck evicting
    its own newest chain while another's old chains stay."""
    engine, claims = engine_with_claims(2048, "lru")
    a = engine.register_namespace(tenant_spec("a")).namespace_id
    b = engine.register_namespace(tenant_spec("b")).namespace_id
    chain = [[single(16 * number + offset) for offset in range(16)] for number in range(256)]
    for number in range(128):
        assert put(engine, a, "".join(chain[number]), verify=False) == 16
    for number in range(128, 256):
        assert put(engine, b, "".join(chain[number]), verify=False) == 16
    engine.verify()
    b_chains = sum(stored(engine, b, "".join(chain[number])) == 16 for number in range(128, 256))
    a_blocks = sum(1 for block in engine.host.pool.owners if block.index.tenant == "a")
    # LRU would keep all 128 of b's; the window (64 blocks: 4 chains) may keep up to 4 of a's instead.
    assert b_chains >= 124 and a_blocks <= 64
    assert len(claims) - 2048 >= 124 * 16


def test_a_tenant_without_blocks_or_with_only_young_ones_takes_the_victims_slot():
    engine, claims = engine_with_claims(128, "lru")
    a = engine.register_namespace(tenant_spec("a")).namespace_id
    b = engine.register_namespace(tenant_spec("b")).namespace_id
    c = engine.register_namespace(tenant_spec("c")).namespace_id
    for index in range(100):
        put(engine, b, single(index))
    for index in range(100, 128):
        put(engine, a, single(index))
    claims.clear()
    # a's oldest block is 100 places from the victim, past the window: b's oldest goes.
    put(engine, a, single(200))
    assert claims == [(0, "a")] and stored(engine, b, single(0)) == 0
    # c has no block at all: it can only take another tenant's slot.
    put(engine, c, single(201))
    assert [tenant for _, tenant in claims] == ["a", "c"]
    # b's own victim is the oldest block: b keeps its slot.
    put(engine, b, single(202))
    assert len(claims) == 2 and stored(engine, b, single(2)) == 0


def test_without_per_tenant_memory_the_policy_victim_goes_exactly():
    engine = Engine(host_slot_count=8, host_slot_bytes=SLOT)
    a = engine.register_namespace(tenant_spec("a")).namespace_id
    b = engine.register_namespace(tenant_spec("b")).namespace_id
    for index in range(8):
        put(engine, b if index < 4 else a, single(index))
    put(engine, a, single(8))
    assert stored(engine, b, single(0)) == 0 and stored(engine, a, single(4)) == 1


def test_a_tenant_at_its_host_quota_makes_room_for_a_chain_from_its_own_chains():
    """Only chain leaves are candidates, but evicting a leaf makes its parent
    one: a Put of a 16-block chain at the quota evicts the least recently
    used 16-block chain whole, though the tenant has just two leaves."""
    quota = TenantQuota("a", host_limit_bytes=32 * SLOT)
    engine = Engine(host_slot_count=64, host_slot_bytes=SLOT, tenant_quotas=[quota])
    a = engine.register_namespace(tenant_spec("a")).namespace_id
    chains = ["".join(single(16 * number + offset) for offset in range(16)) for number in range(3)]
    assert put(engine, a, chains[0]) == 16 and put(engine, a, chains[1]) == 16
    assert len(quota.candidates) == 2 and quota.host_used_bytes == 32 * SLOT
    assert put(engine, a, chains[2]) == 16
    assert [stored(engine, a, chain) for chain in chains] == [0, 16, 16]
    assert quota.counters.host_evicted == 16 and quota.counters.host_refused == 0
    # One chain pinned, one pinned but for its last 4 blocks: 4 can go, 16 are needed.
    leases = [engine_ops.get(engine, KeysRequest(a, "w2", K(chains[1]), LONG, 0))[0],
              engine_ops.get(engine, KeysRequest(a, "w2", K(chains[2])[:12], LONG, 0))[0]]
    before = snapshot(engine)
    with pytest.raises(QuotaExceeded, match=f"only {4 * SLOT} bytes of its blocks can be evicted"):
        engine.reserve(KeysRequest(a, "w", K(chains[0]), LONG, 0))
    assert snapshot(engine) == before
    engine.release("w2", [lease.lease_id for lease in leases])
    assert put(engine, a, chains[0]) == 16
    assert stored(engine, a, chains[0]) == 16
    assert sorted(stored(engine, a, chain) for chain in chains[1:]) == [0, 16]


def test_a_slot_the_kernel_will_not_switch_to_the_tenant_is_no_slot_not_an_error():
    engine = Engine(host_slot_count=4, host_slot_bytes=SLOT)
    refused: list[int] = []

    def claim(slot: int, tenant: str) -> None:
        if slot == 2:
            refused.append(slot)
            raise OSError(12, "Cannot allocate memory")

    engine.claim_host_slot = claim
    a = engine.register_namespace(tenant_spec("a")).namespace_id
    result = engine.reserve(KeysRequest(a, "w", K("abcd"), LONG, 0))
    # Slots 0 and 1 reserved; slot 2 refused: the rest of the chain gets no space, and slot 2 stays free.
    assert result.statuses == [ReserveStatus.RESERVED] * 2 + [ReserveStatus.NO_SPACE] * 2
    assert refused == [2] and engine.claim_failures == 1 and 2 in engine.host.pool.free_slots
    engine.commit(CommitRequest(a, "w", result.lease.lease_id, 0))
    engine.verify()
    assert stored(engine, a, "abcd") == 2 and engine.slot_tenants[:2] == ["a", "a"]
