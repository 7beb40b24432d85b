"""One simulated run's configuration (`SimConfig`): the engine's tiers and policies, the clients'
habits (durable Puts, Deletes, prefetches, quotas), the inference engine's speed, the faults, the
modelled devices and the trace.

Defaults follow the daemon's own (kvd.config) where the daemon has the setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvd.config import DiskSettings, HostConfig, LeaseConfig
from kvd.core.engine import StorageSpec, TierId
from kvd.core.keys import NamespaceSpec
from kvd.core.mover import WRITE_MODES
from kvd.core.policy import DiskPolicies
from kvd.core.quota import TenantQuota
from kvd.invariants import check
from kvd.sim.disk import MEMORY_SPEC, DiskSpec
from kvd.sim.traces import TraceConfig

DISK_DEFAULTS = DiskSettings()
_HOST_DEFAULTS = HostConfig()


@dataclass(frozen=True, slots=True)
class SimConfig:
    seed: int = 0
    requests: int = 500
    policy: str = "lru"
    host_blocks: int = 32
    # 0: no disk tier.
    disk_blocks: int = 256
    # A volatile memory tier between host memory and the disk; 0: none.
    middle_blocks: int = 0
    # Every tenant's model: Llama-3-8B-shaped KV in bf16 (128 KiB a token),
    # in 256-token blocks (LMCache's chunk size) of 32 MiB.
    block_tokens: int = 256
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    write_mode: str = DISK_DEFAULTS.write_mode
    # Host watermarks (fractions of host_blocks): reclaim from high to low.
    high_watermark: float = _HOST_DEFAULTS.high_watermark
    low_watermark: float = _HOST_DEFAULTS.low_watermark
    # Smaller than the daemon's default: the simulated host tiers are small.
    write_batch_blocks: int = 16
    io_schedule: str = DISK_DEFAULTS.io_schedule
    write_chunk_blocks: int = DISK_DEFAULTS.write_chunk_blocks
    write_share: int = DISK_DEFAULTS.write_share
    write_backlog_blocks: int = DISK_DEFAULTS.write_backlog_blocks
    # Write a block to disk only once it was seen this many times.
    admission_min_hits: int = DISK_DEFAULTS.admission_min_hits
    lease_ms: int = LeaseConfig().default_ms
    # A Get that finds host memory full of blocks not yet written waits for
    # write-back batches this long, as the daemon does (STARVED_GET_WAIT_S).
    starved_get_wait_ms: int = 5_000
    # Share of requests whose Put asks to be acknowledged only once durable
    # (ACK_DURABLE), and how long such a Put waits at most (the daemon's
    # durable wait is bounded by the call's deadline).
    durable_share: float = 0.0
    durable_wait_ms: int = 30_000
    # Share of requests whose client then Deletes its conversation's reply
    # blocks (and whatever hangs under them).
    delete_share: float = 0.0
    # Share of requests a router prefetches (reads into host memory what is
    # only on disk) this long before the engine's Get.
    prefetch_share: float = 0.0
    prefetch_lead_ms: int = 5
    # Each tenant's host quota, in blocks (0: none). With quotas, every
    # tenant's namespace belongs to it, as under auth.mode = "token".
    tenant_host_quota_blocks: int = 0
    # The inference engine: how fast it computes what was not cached.
    prefill_tokens_per_s: float = 16_000.0
    decode_us_per_token: int = 25_000
    # Share of disk block reads and writes that fail (reads: corrupt bytes).
    fault_rate: float = 0.0
    verify_every: int = 1
    disk: DiskSpec = field(default_factory=DiskSpec)
    middle: DiskSpec = MEMORY_SPEC
    trace: TraceConfig = field(default_factory=TraceConfig)

    def validate(self) -> None:
        check(self.requests >= 1 and self.host_blocks >= 1 and self.disk_blocks >= 0, "sizes must be positive")
        check(self.middle_blocks >= 0 and (self.disk_blocks or not self.middle_blocks),
              "a middle tier sits above a disk tier")
        check(self.write_mode in WRITE_MODES, f"write_mode must be one of {WRITE_MODES}, got {self.write_mode!r}")
        check(self.write_chunk_blocks >= 1, "write_chunk_blocks must be positive")
        check(0.0 <= self.fault_rate < 1.0, "fault_rate must be in [0, 1)")
        check(0.0 <= self.durable_share <= 1.0 and self.durable_wait_ms > 0, "durable_share must be in [0, 1]")
        check(0.0 <= self.delete_share <= 1.0 and self.tenant_host_quota_blocks >= 0, "delete_share in [0, 1]")
        check(0.0 <= self.prefetch_share <= 1.0 and self.prefetch_lead_ms >= 0, "prefetch_share in [0, 1]")
        check(self.verify_every >= 1 and self.write_batch_blocks >= 1, "verify_every and batch must be positive")
        self.trace.validate()

    def namespace_spec(self, tenant: int) -> NamespaceSpec:
        return NamespaceSpec(
            model_id="sim/llama-3-8b", num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, block_tokens=self.block_tokens, tenant_salt=f"tenant-{tenant}".encode(),
            tenant=tenant_name(tenant) if self.tenant_host_quota_blocks else "",
        )

    def tenant_quotas(self) -> list[TenantQuota]:
        if not self.tenant_host_quota_blocks:
            return []
        return [TenantQuota(tenant_name(tenant), host_limit_bytes=self.tenant_host_quota_blocks * self.block_bytes)
                for tenant in range(self.trace.tenants)]

    @property
    def block_bytes(self) -> int:
        return self.namespace_spec(0).block_bytes

    def middle_tier(self) -> list[StorageSpec]:
        if not self.middle_blocks:
            return []
        return [StorageSpec(MIDDLE_TIER, self.middle_blocks, self.block_bytes,
                            policies=DiskPolicies(admission_min_hits=self.admission_min_hits), name="middle")]


# The middle tier borrows the remote tier's id: the wire's Tier enum has no
# other volatile tier below host memory.
MIDDLE_TIER = TierId.REMOTE


def tenant_name(tenant: int) -> str:
    return f"tenant-{tenant}"
