"""What each request-handling part of the engine (reads, puts, prefetch) works with."""

from __future__ import annotations

from kvd.core.blocks import BlockBook
from kvd.core.eviction import HostAllocator
from kvd.core.lease import LeaseTable
from kvd.core.limits import EngineLimits
from kvd.core.namespaces import NamespaceTable


class EnginePart:
    def __init__(self, limits: EngineLimits, namespaces: NamespaceTable, blocks: BlockBook,
                 allocator: HostAllocator, leases: LeaseTable) -> None:
        self.limits = limits
        self.namespaces = namespaces
        self.blocks = blocks
        self.allocator = allocator
        self.leases = leases
        self.host = blocks.host
        self.disk = blocks.disk
