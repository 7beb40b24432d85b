"""What a peer can READ of a holder's arena over NIXL (issue 37 item 2): what it was granted, nothing else.

Two real NIXL agents (UCX), each with its own arena, as two daemons have them.
The holder's member record (`metadata`) describes no memory; a PinBlocks
answer grants one tenant's view of the arena (HostArena.tenant_view), which
shows that tenant's blocks and zeros where another tenant's are. The
reader's agent refuses anything outside what it was granted.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from kvd.cluster.nixl_transport import NixlTransport, nixl_available
from kvd.tiers.host import ArenaLayout, HostArena

pytestmark = pytest.mark.skipif(not nixl_available(), reason="the nixl package is installed by `make setup`")

SLOT = 64 << 10
SLOTS = 4


def tenant_arena(tmp_blocks: dict[int, tuple[str, bytes]]) -> HostArena:
    """A per-tenant arena with each slot of `tmp_blocks` claimed by its tenant and filled."""
    arena = HostArena(ArenaLayout(SLOT, SLOTS), prefault=True, per_tenant=True)
    for slot, (tenant, payload) in tmp_blocks.items():
        arena.claim(slot, tenant)
        arena.write(slot, payload)
    return arena


@contextlib.asynccontextmanager
async def two_agents(holder_blocks: dict[int, tuple[str, bytes]]):
    """(holder, its arena, reader, its arena): two agents, each with its own arena, connected as
    two members are (each has the other's member-record metadata)."""
    holder_arena = tenant_arena(holder_blocks)
    reader_arena = HostArena(ArenaLayout(SLOT, SLOTS), prefault=True)
    holder = NixlTransport("holder", 1, holder_arena.address_at(0), holder_arena.layout.arena_bytes)
    reader = NixlTransport("reader", 1, reader_arena.address_at(0), reader_arena.layout.arena_bytes)
    try:
        await reader.add_peer("holder", holder.metadata)
        await holder.add_peer("reader", reader.metadata)
        holder.serving(+1)  # as while a peer holds pins: the holder's agent makes progress
        yield holder, holder_arena, reader, reader_arena
    finally:
        await reader.close()
        await holder.close()
        holder_arena.close()
        reader_arena.close()


def test_a_peer_reads_what_it_was_granted_and_nothing_else():
    mine, theirs = b"A" * SLOT, b"B" * SLOT

    async def scenario():
        async with two_agents({0: ("tenant-a", mine), 1: ("tenant-b", theirs)}) as (holder, holder_arena, reader,
                                                                                     reader_arena):
            view = holder_arena.tenant_view("tenant-a")
            grant = await holder.grant(view, holder_arena.layout.arena_bytes)
            assert await holder.grant(view, holder_arena.layout.arena_bytes) == grant  # registered once

            def read(remote: int, with_grant: bytes):
                reader_arena.slots[0] = 0
                return reader.read("holder", [reader_arena.address(0)], [remote], SLOT, 5.0, with_grant)

            # Tenant a's block, through tenant a's grant.
            assert await read(view + holder_arena.offset(0), grant) == (True, None)
            assert reader_arena.read(0, SLOT) == mine
            # Tenant b's block through tenant a's view: the READ lands, and shows zeros, never b's bytes.
            assert await read(view + holder_arena.offset(1), grant) == (True, None)
            assert reader_arena.read(0, SLOT) == bytes(SLOT)
            # The holder's arena itself was never granted: the reader's agent refuses the READ.
            assert await read(holder_arena.address_at(holder_arena.offset(1)), grant) == (False, None)
            # Past the end of the view: refused too.
            assert await read(view + holder_arena.layout.arena_bytes, grant) == (False, None)
            assert reader_arena.read(0, SLOT) == bytes(SLOT)
            assert reader.failed_reads == 2

    asyncio.run(scenario())


def test_the_member_record_grants_nothing():
    """What etcd holds (the member record's metadata) lets no one READ anything: a reader that has
    only that, even passing it as a grant, gets no bytes."""
    async def scenario():
        async with two_agents({0: ("tenant-a", b"A" * SLOT)}) as (holder, holder_arena, reader, reader_arena):
            view = holder_arena.tenant_view("tenant-a")
            for remote in (view, holder_arena.address_at(0)):
                assert await reader.read("holder", [reader_arena.address(0)], [remote], SLOT, 5.0,
                                         holder.metadata) == (False, None)
            assert not reader_arena.slots[0].any()

    asyncio.run(scenario())
