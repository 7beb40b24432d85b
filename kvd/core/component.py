"""The base of the engine's request components (reads, puts, prefetch): the engine's tables they
share, by reference (limits, namespaces, the block lifecycle, the host allocator, leases)."""

from __future__ import annotations

from kvd.core.blocks import BlockLifecycle
from kvd.core.eviction import HostAllocator
from kvd.core.lease import LeaseTable
from kvd.core.limits import EngineLimits
from kvd.core.namespaces import NamespaceTable


class EngineComponent:
    def __init__(self, limits: EngineLimits, namespaces: NamespaceTable, blocks: BlockLifecycle,
                 allocator: HostAllocator, leases: LeaseTable) -> None:
        self.limits = limits
        self.namespaces = namespaces
        self.blocks = blocks
        self.allocator = allocator
        self.leases = leases
        self.host = blocks.host
        self.disk = blocks.disk
