"""Shared pieces of the disk tier tests: small real drive sets in tmp_path.

Geometry used throughout: 2 drives, 4 MiB segments, 64 KiB slots, and a
namespace of 3 layers of 8 KiB (so a block is 24 KiB of its 64 KiB slot).
Data really goes through O_DIRECT files and the I/O engine; blocks come
from and go to a real HostArena (memfd host memory).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from kvd.core.keys import DType, NamespaceSpec
from kvd.io import uring_unavailable_reason
from kvd.testing import disk_ops
from kvd.tiers.disk.journal import FsyncPolicy
from kvd.tiers.disk.records import PutRecord
from kvd.tiers.disk.layout import DiskConfig, locate, segment_name
from kvd.tiers.disk.tier import DiskTier
from kvd.tiers.host import ArenaLayout, HostArena

SLOT_BYTES = 64 << 10
SEGMENT_BYTES = 4 << 20
SPEC = NamespaceSpec("test-model", num_layers=3, num_kv_heads=2, head_dim=64, block_tokens=8, kv_dtype=DType.FLOAT32)
NAMESPACE = SPEC.namespace_id()
LAYER_BYTES = SPEC.layer_bytes
LAYERS = SPEC.num_layers
BLOCK_BYTES = SPEC.block_bytes
assert LAYER_BYTES == 8192 and BLOCK_BYTES == 24576


def key(number: int) -> bytes:
    return number.to_bytes(4, "little") * 8


def _direct_io_works(directory: Path) -> bool:
    path = directory / "probe"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    path.unlink()
    return True


ENGINES = ["fallback"] + (["uring"] if uring_unavailable_reason() is None else [])


@pytest.fixture(params=ENGINES)
def io_engine(request) -> str:
    return request.param


@pytest.fixture
def drives(tmp_path: Path) -> tuple[Path, ...]:
    # The disk tier needs O_DIRECT; a machine without it must fail loudly,
    # not pass by skipping every disk test.
    if not _direct_io_works(tmp_path):
        pytest.fail(f"{tmp_path} does not support O_DIRECT; the disk tier cannot run here")
    return (tmp_path / "nvme0", tmp_path / "nvme1")


def make_config(directories, *, segments: int = 2, policy: FsyncPolicy = FsyncPolicy.STRICT,
                engine: str = "auto", **overrides) -> DiskConfig:
    fields = {
        "directories": tuple(directories),
        "capacity_bytes": segments * SEGMENT_BYTES,
        "slot_bytes": SLOT_BYTES,
        "segment_bytes": SEGMENT_BYTES,
        "fsync_policy": policy,
        "queue_depth": 32,
        "io_engine": engine,
    }
    fields.update(overrides)
    return DiskConfig(**fields)


@pytest.fixture
def arena():
    arena = HostArena(ArenaLayout(SLOT_BYTES, 64), prefault=False)
    yield arena
    arena.close()


def arena_address(arena: HostArena, slot: int) -> int:
    return arena.array.ctypes.data + arena.offset(slot)


def fill(arena: HostArena, host_slot: int, seed: int) -> bytes:
    """Put a block of seeded random bytes into a host slot; return them."""
    data = np.random.default_rng(seed).integers(0, 256, BLOCK_BYTES, dtype=np.uint8)
    arena.slots[host_slot, :BLOCK_BYTES] = data
    return data.tobytes()


def open_tier(config: DiskConfig, **kwargs) -> tuple[DiskTier, object]:
    tier = DiskTier(config, **kwargs)
    recovery = tier.open()
    tier.register_namespace(NAMESPACE, SPEC.encode())
    return tier, recovery


def write(tier: DiskTier, arena: HostArena, blocks: dict[int, int], parent: bytes = b"") -> list[bool]:
    """Write {disk slot: seed} from host slots 0.. ; keys are key(seed)."""
    items = []
    for host_slot, (slot, seed) in enumerate(blocks.items()):
        fill(arena, host_slot, seed)
        items.append((key(seed), parent, slot, arena_address(arena, host_slot)))
    return disk_ops.write_blocks(tier, NAMESPACE, LAYER_BYTES, LAYERS, items)


def records_by_slot(tier: DiskTier) -> dict[int, PutRecord]:
    return {record.location: record for record in tier.live_records()}


def read(tier: DiskTier, arena: HostArena, slots: list[int], first_host_slot: int = 32, **kwargs) -> np.ndarray:
    """Read disk slots into host slots first_host_slot.. using their live records."""
    records = records_by_slot(tier)
    items = [
        (records[slot].key, slot, arena_address(arena, first_host_slot + i), records[slot].layer_checksums)
        for i, slot in enumerate(slots)
    ]
    return tier.read_blocks(NAMESPACE, LAYER_BYTES, LAYERS, items, **kwargs)


def expected_bytes(seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes()


def host_bytes(arena: HostArena, host_slot: int) -> bytes:
    return arena.slots[host_slot, :BLOCK_BYTES].tobytes()


def segment_path(config: DiskConfig, slot: int) -> tuple[Path, int]:
    """The segment file that holds disk slot `slot`, and the slot's offset in it."""
    place = locate(config, slot)
    return config.directories[place.drive] / segment_name(place.segment), place.offset


def raw_block(config: DiskConfig, slot: int) -> bytes:
    """The bytes of disk slot `slot` as they lie in its segment file."""
    path, offset = segment_path(config, slot)
    with open(path, "rb") as handle:
        handle.seek(offset)
        return handle.read(BLOCK_BYTES)
