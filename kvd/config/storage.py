"""The storage tiers' settings, [host] and [disk]: capacities, slot size classes,
watermarks, write-back, syncing, the disk's I/O schedule and the tiers' policies,
with their checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvd.config.values import one_of, positive
from kvd.errors import ConfigError

# The registries of kvd.core.policy (the config imports nothing from the
# core; tests/unit/test_policies.py checks the two agree).
HOST_POLICIES = ("lru", "s3fifo")
DISK_POLICIES = ("clock",)
PROMOTION_POLICIES = ("always",)
# disk.write_mode; must match kvd.core.mover.WRITE_MODES.
WRITE_MODES = ("behind", "back", "through")
ADMISSION_MIN_HITS_MAX = 255


@dataclass(slots=True)
class HostConfig:
    capacity_bytes: int = 1 << 30
    slot_bytes: int = 2 << 20
    # Slot size classes: host memory is carved into pages of slot_bytes,
    # and each page into slots of one size, slot_bytes halved down to this
    # (a namespace takes the smallest that holds its blocks), so models of
    # different block sizes share memory. slot_bytes: one size only.
    min_slot_bytes: int = 64 << 10
    prefault: bool = True
    huge_pages: bool = True
    # Watermarks, as fractions of the host slots: from high_watermark
    # occupied on, dirty blocks are written back (write_mode = "back") and
    # durable ones demoted in the background until low_watermark, so Puts
    # find free slots instead of evicting.
    high_watermark: float = 0.9
    low_watermark: float = 0.8
    # Eviction: "lru", or "s3fifo" (scan-resistant: blocks used once leave
    # before blocks used again). Must match HOST_POLICIES.
    policy: str = "lru"


@dataclass(slots=True)
class DiskSettings:
    # One directory per drive; empty: no disk tier.
    directories: list[str] = field(default_factory=list)
    capacity_bytes: int = 16 << 30  # per directory
    slot_bytes: int = 2 << 20
    # Slot size classes, as in host memory: disk pages of slot_bytes carved
    # into slots of slot_bytes halved down to this. Each slot of each class
    # costs 35-55 B of memory, so the disk's smallest slots are larger than host
    # memory's. slot_bytes: one size only.
    min_slot_bytes: int = 512 << 10
    segment_bytes: int = 1 << 30
    # "behind": queue every block the admission filter takes for the disk
    # and write it in the gaps between reads, at the lowest priority, so a
    # crash loses only the last moments (kvd_disk_oldest_unwritten_seconds);
    # "back": write only when the host tier runs short of free slots (or a
    # client asks for durability), so short-lived blocks never cost SSD
    # writes, and a crash loses whatever was never written; "through":
    # write every block at once, taking drive time from reads when behind.
    write_mode: str = "behind"
    # When written blocks are synced (data, then the records that point to
    # it): "strict" with every write batch; "group" by a commit every
    # group_commit_ms; "none" never on its own. Whatever the policy, an
    # ACK_DURABLE Put or MakeDurable returns only once its blocks are synced:
    # under group and none it starts a commit at once and waits for it.
    fsync: str = "strict"
    # fsync = "group": commit at least this often (also when nobody waits).
    group_commit_ms: int = 10
    write_batch_blocks: int = 64
    queue_depth: int = 128
    # Streamed restores (GetLayers, or reads with writes in their slack)
    # read each block in extents of whole layers: layer 0 alone, then twice
    # as many layers each time, up to about this many bytes (larger is
    # nearer the drive's bandwidth; layer 0 lands early either way). A Get
    # or Prefetch reads each block as one extent.
    read_extent_bytes: int = 512 << 10
    # Order of the disk's jobs: "slack" (restores, then prefetches, then
    # write-back in chunks of write_chunk_blocks between reads) or "fifo"
    # (arrival order, whole write batches; for comparison).
    io_schedule: str = "slack"
    write_chunk_blocks: int = 8
    # ... and of at most this many bytes (one block at least): a restore waits for one chunk, however
    # large the blocks (8 blocks of a 256-token Llama-8B block are 256 MiB).
    write_chunk_bytes: int = 16 << 20
    # While more than write_backlog_blocks wait for write-back under host
    # pressure, writes get one job in every write_share + 1 even if reads wait.
    write_backlog_blocks: int = 256
    write_share: int = 4
    # Under slack, a write that would start within this long after a read
    # ended waits that long for another read first (0: never waits).
    write_anticipation_ms: float = 2.0
    # A slack table (kvd.planner.slack, measured by `make slack-profile`): under slack,
    # write-back jobs are sized to the write budget its profile leaves in each layer of the
    # latest restore, with the drive's bandwidths as observed. "": write_chunk_blocks.
    slack_profile: str = ""
    # Prefetch: at most this many blocks read ahead of a Get in flight at a
    # time (a Prefetch beyond it is cut short, not refused), in jobs of at
    # most prefetch_chunk_blocks, so a restore waits for one job at most.
    prefetch_max_blocks: int = 256
    prefetch_chunk_blocks: int = 16
    # "auto" (io_uring when available), "uring" or "fallback".
    io_engine: str = "auto"
    # Write zeros over every segment file the daemon creates, before it serves. A file system
    # hands out preallocated space as unwritten extents, and the first write into each costs
    # its conversion (on ext4 up to a third of the store speed); zeroed, the first fill stores
    # as fast as a tier that ran a while. Costs one write of capacity_bytes per drive at the
    # start that creates the segments, never again.
    zero_segments: bool = False
    manifest_max_bytes: int = 64 << 20
    # Eviction of disk slots: "clock".
    policy: str = "clock"
    # Write a block to disk only once it has been seen (sealed, served by a
    # Get, or Put again) this many times; 1 writes every block. ACK_DURABLE
    # Puts are written regardless. Saves SSD writes on one-off blocks.
    admission_min_hits: int = 1
    # Whether a Get's disk hit is read into host memory: "always".
    promotion: str = "always"


def validate_host(host: HostConfig) -> None:
    positive("host.slot_bytes", host.slot_bytes)
    if host.slot_bytes % 4096:
        raise ConfigError("host.slot_bytes", f"must be a multiple of 4096, got {host.slot_bytes}")
    if host.capacity_bytes < host.slot_bytes:
        raise ConfigError(
            "host.capacity_bytes",
            f"{host.capacity_bytes} is smaller than one slot ({host.slot_bytes} bytes)",
        )
    positive("host.min_slot_bytes", host.min_slot_bytes)
    if host.min_slot_bytes % 4096:
        raise ConfigError("host.min_slot_bytes", f"must be a multiple of 4096, got {host.min_slot_bytes}")
    one_of("host.policy", host.policy, HOST_POLICIES)
    if not 0.0 < host.low_watermark < host.high_watermark <= 1.0:
        raise ConfigError(
            "host.low_watermark",
            f"need 0 < low_watermark ({host.low_watermark}) < high_watermark "
            f"({host.high_watermark}) <= 1",
        )


def validate_disk(disk: DiskSettings) -> None:
    one_of("disk.policy", disk.policy, DISK_POLICIES)
    one_of("disk.promotion", disk.promotion, PROMOTION_POLICIES)
    if not 1 <= disk.admission_min_hits <= ADMISSION_MIN_HITS_MAX:
        raise ConfigError(
            "disk.admission_min_hits",
            f"must be 1..{ADMISSION_MIN_HITS_MAX} (1 writes every block), got {disk.admission_min_hits}",
        )
    if disk.directories:
        if disk.fsync not in ("strict", "group", "none"):
            raise ConfigError("disk.fsync", f"must be strict, group or none, got {disk.fsync!r}")
        one_of("disk.write_mode", disk.write_mode, WRITE_MODES)
        if not 0.0 <= disk.write_anticipation_ms <= 1000.0:
            raise ConfigError("disk.write_anticipation_ms", f"must be in [0, 1000], got {disk.write_anticipation_ms}")
        if disk.io_schedule not in ("slack", "fifo"):
            raise ConfigError("disk.io_schedule", f"must be slack or fifo, got {disk.io_schedule!r}")
        if disk.io_engine not in ("auto", "uring", "fallback"):
            raise ConfigError("disk.io_engine", f"must be auto, uring or fallback, got {disk.io_engine!r}")
        for name in ("group_commit_ms", "write_batch_blocks", "queue_depth", "manifest_max_bytes",
                     "read_extent_bytes", "write_chunk_blocks", "write_chunk_bytes", "write_backlog_blocks",
                     "write_share",
                     "prefetch_max_blocks", "prefetch_chunk_blocks"):
            positive(f"disk.{name}", getattr(disk, name))
