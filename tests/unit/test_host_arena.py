"""The host arena's per-tenant files (kvd.tiers.host): what each tenant's
file shows as slots move between tenants, and a failed move."""

from __future__ import annotations

import mmap
import os

import pytest

from kvd.tiers.host import ArenaLayout, HostArena
from kvd.testing import host_ops

SLOT = 64 << 10
SLOTS = 8


@pytest.fixture
def arena():
    owner = HostArena(ArenaLayout(SLOT, SLOTS), prefault=True, per_tenant=True)
    yield owner
    owner.close()


def view(arena: HostArena, tenant: str) -> mmap.mmap:
    """What a client of `tenant` maps."""
    return mmap.mmap(arena.tenant_fd(tenant), SLOT * SLOTS, mmap.MAP_SHARED, mmap.PROT_READ)


def test_a_slot_that_changes_tenant_shows_zeros_to_the_old_tenant_and_its_bytes_to_no_other(arena):
    arena.claim(3, "a")
    arena.write(3, b"A" * SLOT)
    a, b = view(arena, "a"), view(arena, "b")
    assert a[3 * SLOT: 4 * SLOT] == b"A" * SLOT and b[3 * SLOT: 4 * SLOT] == bytes(SLOT)
    arena.claim(3, "b")
    arena.write(3, b"B" * 100)
    assert a[3 * SLOT: 4 * SLOT] == bytes(SLOT)  # punched: not even a's old bytes
    assert b[3 * SLOT: 3 * SLOT + 100] == b"B" * 100 and arena.read(3, 100) == b"B" * 100
    assert host_ops.tenant_at(arena, 3 * SLOT) == "b" and arena.reassigned_slots == 2
    # Memory follows the slot: the spare file gave slot 3's pages up, and so did a.
    assert host_ops.resident_bytes(arena, None) == (SLOTS - 1) * SLOT
    assert host_ops.resident_bytes(arena, "b") >= SLOT
    a.close()
    b.close()


def test_a_claim_the_kernel_refuses_leaves_the_slot_with_its_previous_tenant(arena, monkeypatch):
    arena.claim(5, "a")
    arena.write(5, b"kept" * 10)
    calls = []
    real = HostArena._map_range

    def refuse_once(self, offset, length, fd):
        calls.append(fd)
        if len(calls) == 1:
            return False  # as if mmap had failed (and unmapped the slot)
        return real(self, offset, length, fd)

    monkeypatch.setattr(HostArena, "_map_range", refuse_once)
    with pytest.raises(OSError, match=f"mmap of arena bytes {5 * SLOT}"):
        arena.claim(5, "b")
    assert calls == [arena.tenant_fd("b"), arena.tenant_fd("a")]  # mapped back to a's file
    assert host_ops.tenant_at(arena, 5 * SLOT) == "a" and arena.read(5, 40) == b"kept" * 10
    assert host_ops.resident_bytes(arena, "b") == 0  # the pages allocated for b went back


def test_files_are_sealed_and_distinct(arena):
    fd_a, fd_b = arena.tenant_fd("a"), arena.tenant_fd("b")
    assert os.fstat(fd_a).st_ino != os.fstat(fd_b).st_ino
    with pytest.raises(PermissionError):
        os.ftruncate(fd_a, 0)


def test_small_slots_of_one_page_are_backed_per_tenant_and_a_whole_page_claim_takes_them_all():
    """With slot classes a page holds slots of several tenants: each tenant's
    file backs only its own granules, and when the page goes whole to a
    third tenant, both lose theirs."""
    granule = SLOT // 4
    arena = HostArena(ArenaLayout(SLOT, SLOTS), prefault=True, per_tenant=True, granule_bytes=granule)
    try:
        arena.claim_range(2 * SLOT, granule, "a")
        arena.claim_range(2 * SLOT + granule, granule, "b")
        arena.write_at(2 * SLOT, b"A" * granule)
        arena.write_at(2 * SLOT + granule, b"B" * granule)
        a, b = view(arena, "a"), view(arena, "b")
        first, second = slice(2 * SLOT, 2 * SLOT + granule), slice(2 * SLOT + granule, 2 * SLOT + 2 * granule)
        assert a[first] == b"A" * granule and b[second] == b"B" * granule
        assert [host_ops.tenant_at(arena, 2 * SLOT + i * granule) for i in range(4)] == ["a", "b", None, None]
        arena.claim(2, "c")
        # Checked before any read of a hole: a client reading one faults a zero page into its file.
        assert host_ops.resident_bytes(arena, "a") == 0 and host_ops.resident_bytes(arena, "b") == 0
        assert {host_ops.tenant_at(arena, 2 * SLOT + i * granule) for i in range(4)} == {"c"}
        assert arena.read_at(2 * SLOT, 2 * granule) == bytes(2 * granule)  # c's fresh pages
        for mapping in (a, b):
            assert mapping[first] == bytes(granule) and mapping[second] == bytes(granule)
        with pytest.raises(Exception, match="off the granules"):
            arena.claim_range(2 * SLOT + 100, granule, "a")
        a.close()
        b.close()
    finally:
        arena.close()


def test_a_slot_moved_to_a_tenant_costs_its_own_bytes_with_huge_pages_asked_for():
    """A tenant's slot is mapped on its own, so even where shmem_enabled is
    advise it never takes a whole huge page of the tenant's file."""
    arena = HostArena(ArenaLayout(SLOT, 64), prefault=True, huge_pages=True, per_tenant=True)
    try:
        arena.claim(3, "a")
        arena.write(3, b"A" * SLOT)
        assert host_ops.resident_bytes(arena, "a") == SLOT and arena.read(3, 4) == b"AAAA"
    finally:
        arena.close()


@pytest.mark.parametrize("text, mode", [("always within_size advise [never] deny force\n", "never"),
                                        ("always within_size [advise] never deny force\n", "advise"),
                                        ("garbage\n", "unknown")])
def test_the_shmem_huge_page_mode_is_the_selected_word(monkeypatch, tmp_path, text, mode):
    import builtins

    from kvd.tiers import host

    setting = tmp_path / "shmem_enabled"
    setting.write_text(text)
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *args, **kwargs: real_open(
        setting if str(path).endswith("shmem_enabled") else path, *args, **kwargs))
    assert host.shmem_huge_page_mode() == mode
