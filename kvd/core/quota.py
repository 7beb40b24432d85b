"""Per-tenant usage and quotas (auth.mode = "token").

A tenant's namespaces share one `TenantQuota` (their prefix indexes point
at it), and the engine charges it whole slots, the capacity its blocks
take whatever their size:

    host_used_bytes  host slots of its blocks: being written, sealed, or
                     being read back from disk (a Get or a Prefetch)
    disk_used_bytes  disk slots of its blocks: being written, or durable

Host quota. A Reserve (or inline Put) whose new blocks would take the
tenant past `host_limit_bytes` first evicts the tenant's own least recently
used host candidates (`candidates`, kept in step with the host policy's
candidates) to make room; if they are not enough, the request is refused
with RESOURCE_EXHAUSTED before anything changes. Blocks read back from
disk by a Get are never refused (the data is the tenant's already, bounded
by its disk quota) and count until the tenant's next Put evicts them; a
Prefetch over the quota is refused like one with no host slot to spare.

Disk quota. A block whose tenant is at `disk_limit_bytes` takes the disk
slot of one of the tenant's own blocks (the disk policy's victim among
them), never another tenant's; with none to give up it is not written at
all and stays in host memory only.

A limit of 0 means none. A tenant unknown to the configuration (its
namespaces recovered from disk, its entry since removed) has no limits.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from kvd.core.block import Block
from kvd.errors import ResourceExhausted


class QuotaExceeded(ResourceExhausted):
    """A tenant's request would take it past its quota; only its own blocks can make room."""


@dataclass(slots=True)
class QuotaCounters:
    # Reserves refused for the host quota, and host candidates evicted (or
    # demoted) to keep the tenant within it.
    host_refused: int = 0
    host_evicted: int = 0
    # Blocks left unwritten for the disk quota, and disk blocks evicted to
    # make room for the tenant's newer ones.
    disk_refused: int = 0
    disk_evicted: int = 0


@dataclass(slots=True, eq=False)
class TenantQuota:
    name: str
    host_limit_bytes: int = 0
    disk_limit_bytes: int = 0
    host_used_bytes: int = 0
    disk_used_bytes: int = 0
    # The tenant's host eviction candidates, least recently used first; kept
    # only under a host limit (it costs a dict entry per candidate).
    candidates: OrderedDict[Block, None] = field(default_factory=OrderedDict)
    counters: QuotaCounters = field(default_factory=QuotaCounters)

    @property
    def tracks_candidates(self) -> bool:
        return self.host_limit_bytes > 0

    def host_excess_bytes(self, slots: int, slot_bytes: int) -> int:
        """Bytes over the host limit if `slots` more slots were taken (<= 0: within it)."""
        if not self.host_limit_bytes:
            return 0
        return self.host_used_bytes + slots * slot_bytes - self.host_limit_bytes

    def disk_full(self, slot_bytes: int) -> bool:
        """Whether one more disk slot would take the tenant past its disk limit."""
        return bool(self.disk_limit_bytes) and self.disk_used_bytes + slot_bytes > self.disk_limit_bytes
