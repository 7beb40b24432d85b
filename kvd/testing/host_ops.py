"""Host arena queries that only tests need.

`HostArena` (kvd.tiers.host) carries what the host plane and the arena
socket call. Which tenant's file backs a byte, and how much memory a
tenant's file holds, only tests ask; they read the arena's own
bookkeeping and its files, which the arena has no other reason to show.
"""

from __future__ import annotations

import os

from kvd.tiers.host import HostArena


def tenant_at(arena: HostArena, offset: int) -> str | None:
    """The tenant whose file backs the arena byte at `offset` (None: the spare file)."""
    index = int(arena._granule_tenants[offset // arena.granule_bytes])
    return None if index < 0 else arena._tenant_names[index]


def resident_bytes(arena: HostArena, tenant: str | None) -> int:
    """Memory the file of `tenant` (None: the spare file) holds now; 0 for a tenant without one."""
    fd = arena._spare if tenant is None else arena._files.get(tenant)
    return 0 if fd is None else os.fstat(fd).st_blocks * 512
