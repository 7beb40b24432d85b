"""The blocks and the contenders of bench_disk_restore.py (not a benchmark itself).

Blocks: a long prompt's blocks of one namespace in a HostArena whose slot
is one block, every layer object stamped with a header. The contenders each
`run()` one restore (or store) of all of them and return its seconds, CPU
and counts: kvd's DiskTier restores and stores and the engine-only reads
beside them, and the baselines fio and one-file-per-block "naive" reads.
bench_disk_restore.py's docstring says what each measures.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

import _common  # noqa: F401  (puts the repository on sys.path, for kvd)

from kvd.core.keys import DType, NamespaceSpec
from kvd.io import Op, open_engine
from kvd.tiers.disk.journal import FsyncPolicy
from kvd.tiers.disk.layout import DiskConfig, locate_many
from kvd.io.checksum import crc32c_chunks
from kvd.testing import disk_ops
from kvd.tiers.disk.tier import DiskTier
from kvd.tiers.host import ArenaLayout, HostArena

NUM_LAYERS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
SEGMENT_BYTES = 256 << 20  # a multiple of both block sizes
HEADER_BYTES = 16  # (block, layer) stamped at the start of every layer object
POISON = 0xFF


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def cpu_split() -> tuple[float, float]:
    """(user, system) CPU seconds of this process, all threads (io_uring's workers included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime, usage.ru_stime


def block_key(index: int) -> bytes:
    return hashlib.blake2b(index.to_bytes(8, "little"), digest_size=32).digest()


def make_spec(block_tokens: int) -> NamespaceSpec:
    return NamespaceSpec(
        "bench-llama-8b-like", num_layers=NUM_LAYERS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
        block_tokens=block_tokens, kv_dtype=DType.BFLOAT16,
    )


# ---------------------------------------------------------------------------
# The blocks


class Blocks:
    """N blocks of one namespace in a HostArena whose slot is exactly one block."""

    def __init__(self, spec: NamespaceSpec, count: int) -> None:
        self.spec = spec
        self.namespace_id = spec.namespace_id()
        self.count = count
        self.layer_bytes = spec.layer_bytes
        self.num_layers = spec.num_layers
        self.block_bytes = spec.block_bytes
        self.arena = HostArena(ArenaLayout(self.block_bytes, count), prefault=True)
        self.objects = self.arena.slots.reshape(count, self.num_layers, self.layer_bytes)
        self.keys = [block_key(i) for i in range(count)]
        self.parents = [b""] + self.keys[:-1]  # one chain: a long prompt
        self.addresses = [self.arena.address(i) for i in range(count)]
        # Random bytes (a 64 MiB pattern tiled), then a unique header per object.
        pattern = np.random.default_rng(7).integers(0, 256, 64 << 20, dtype=np.uint8)
        flat = self.arena.array
        for start in range(0, flat.size, pattern.size):
            chunk = min(pattern.size, flat.size - start)
            flat[start : start + chunk] = pattern[:chunk]
        headers = np.zeros((count, self.num_layers, 2), dtype=np.uint64)
        headers[:, :, 0] = np.arange(count, dtype=np.uint64)[:, None]
        headers[:, :, 1] = np.arange(self.num_layers, dtype=np.uint64)[None, :] + 0x5EED0000
        self.expected_headers = headers.view(np.uint8).reshape(count, self.num_layers, HEADER_BYTES)
        self.objects[:, :, :HEADER_BYTES] = self.expected_headers

    @property
    def total_bytes(self) -> int:
        return self.count * self.block_bytes

    @property
    def object_count(self) -> int:
        return self.count * self.num_layers

    def poison(self) -> None:
        """Make the host cold: the start of every layer object is overwritten."""
        self.objects[:, :, :HEADER_BYTES] = POISON

    def headers_intact(self) -> bool:
        return bool(np.array_equal(self.objects[:, :, :HEADER_BYTES], self.expected_headers))

    def restore_headers(self) -> None:
        self.objects[:, :, :HEADER_BYTES] = self.expected_headers

    def crc_pass(self) -> tuple[float, float]:
        """crc32c of every layer object with the engine's function (ISA-L): (wall, cpu) seconds."""
        addresses = np.array(self.addresses, dtype=np.uint64)
        cpu0, t0 = cpu_seconds(), time.perf_counter()
        crc32c_chunks(addresses, self.layer_bytes, self.num_layers)
        return time.perf_counter() - t0, cpu_seconds() - cpu0

    def close(self) -> None:
        self.objects = None  # type: ignore[assignment]
        self.arena.close()


# ---------------------------------------------------------------------------
# kvd


def disk_config(directories: list[Path], blocks: Blocks, policy: FsyncPolicy, queue_depth: int,
                read_extent_bytes: int) -> DiskConfig:
    per_drive = -(-blocks.count // len(directories)) * blocks.block_bytes
    capacity = -(-per_drive // SEGMENT_BYTES) * SEGMENT_BYTES
    return DiskConfig(
        directories=tuple(directories), capacity_bytes=capacity, slot_bytes=blocks.block_bytes,
        segment_bytes=SEGMENT_BYTES, fsync_policy=policy, queue_depth=queue_depth, io_engine="auto",
        read_extent_bytes=read_extent_bytes,
    )


def open_tier(root: Path, drives: int, blocks: Blocks, policy: FsyncPolicy, queue_depth: int,
              read_extent_bytes: int = 512 << 10) -> DiskTier:
    root.mkdir(parents=True, exist_ok=True)
    tier = DiskTier(disk_config([root / f"drive{d}" for d in range(drives)], blocks, policy, queue_depth,
                                read_extent_bytes))
    tier.open()
    tier.register_namespace(blocks.namespace_id, blocks.spec.encode())
    return tier


def write_items(blocks: Blocks, first: int, stop: int) -> list[tuple[bytes, bytes, int, int]]:
    # Disk slot i holds block i, written from (and read back into) arena slot i.
    return [(blocks.keys[i], blocks.parents[i], i, blocks.addresses[i]) for i in range(first, stop)]


class KvdRestore:
    """DiskTier.read_blocks of every block into the (cold) arena."""

    name = "kvd restore"

    def __init__(self, tier: DiskTier, blocks: Blocks) -> None:
        self.tier = tier
        self.blocks = blocks
        # What the daemon hands the tier: key, slot, destination, the record's checksums.
        self.items = [
            (blocks.keys[i], i, blocks.addresses[i], tier.layer_checksums_of(i)) for i in range(blocks.count)
        ]

    def read(self) -> np.ndarray:
        b = self.blocks
        return self.tier.read_blocks(b.namespace_id, b.layer_bytes, b.num_layers, self.items)

    def run(self) -> dict[str, Any]:
        b, tier = self.blocks, self.tier
        b.poison()
        stats0 = (tier.stats.submissions, tier.stats.blocks_read, tier.stats.bytes_read,
                  tier.stats.checksum_failures, tier.stats.read_failures)
        engine0 = disk_ops.engine_stats(tier)
        (user0, sys0), t0 = cpu_split(), time.perf_counter()
        ok = self.read()
        seconds = time.perf_counter() - t0
        user1, sys1 = cpu_split()
        engine1 = disk_ops.engine_stats(tier)
        submissions, blocks_read, bytes_read, checksum_failures, read_failures = (
            now - before for now, before in zip(
                (tier.stats.submissions, tier.stats.blocks_read, tier.stats.bytes_read,
                 tier.stats.checksum_failures, tier.stats.read_failures), stats0, strict=True))
        verified = (bool(ok.all()) and blocks_read == b.count and bytes_read == b.total_bytes
                    and checksum_failures == 0 and read_failures == 0)
        headers = b.headers_intact()
        if not (verified and headers):
            raise RuntimeError(
                f"kvd restore wrong: ok {int(ok.sum())}/{b.count}, blocks_read {blocks_read}, bytes_read {bytes_read}, "
                f"checksum failures {checksum_failures}, headers intact {headers}")
        crc_wall, crc_cpu = b.crc_pass()  # not timed above: the CPU floor of verification, same bytes
        return {
            "seconds": seconds,
            "cpu_seconds": (user1 - user0) + (sys1 - sys0),
            "cpu_user_seconds": user1 - user0,
            "cpu_sys_seconds": sys1 - sys0,
            "objects": b.object_count,
            "submissions": submissions,
            "engine_batches": engine1["batches"] - engine0["batches"],
            "enter_calls": engine1["enter_calls"] - engine0["enter_calls"],
            "submit_calls": engine1["submit_calls"] - engine0["submit_calls"],
            "entries": engine1["entries"] - engine0["entries"],
            "checksums_verified": verified,
            "layers_verified": blocks_read * b.num_layers,
            "crc_only_wall_seconds": crc_wall,
            "crc_only_cpu_seconds": crc_cpu,
        }


class KvdRestoreWholeBlocks(KvdRestore):
    """What a Get or a Prefetch does: `read_blocks(whole_blocks=True)`, every block one extent in one
    batch, every layer object still checksummed (as the engine reaps) and compared."""

    name = "kvd restore blocks"

    def read(self) -> np.ndarray:
        b = self.blocks
        return self.tier.read_blocks(b.namespace_id, b.layer_bytes, b.num_layers, self.items, whole_blocks=True)


class KvdEngineOnly:
    """The restore's batches (same groups of layers) through the tier's engine, no checksums (information only)."""

    name = "kvd engine only"

    def __init__(self, tier: DiskTier, blocks: Blocks) -> None:
        self.engine = tier.engine
        self.blocks = blocks
        _, files, offsets = locate_many(tier.config, np.arange(blocks.count, dtype=np.int64))
        self.files = files.astype(np.int32)
        self.offsets = offsets.astype(np.int64)
        self.addresses = np.array(blocks.addresses, dtype=np.uint64)
        self.width = max(1, min(blocks.num_layers, tier.config.read_extent_bytes // blocks.layer_bytes))

    def run(self) -> dict[str, Any]:
        b = self.blocks
        b.poison()
        engine0 = self.engine.stats
        (user0, sys0), t0 = cpu_split(), time.perf_counter()
        firsts = list(range(0, b.num_layers, self.width))

        def submit(first: int) -> tuple[int, int]:
            shift = first * b.layer_bytes
            extent = (min(first + self.width, b.num_layers) - first) * b.layer_bytes
            lengths = np.full(b.count, extent, dtype=np.uint32)
            return self.engine.submit(Op.READ, self.files, self.offsets + shift, lengths,
                                      self.addresses + np.uint64(shift)), extent

        bad = 0
        in_flight = submit(0)
        for position in range(len(firsts)):
            following = submit(firsts[position + 1]) if position + 1 < len(firsts) else None
            batch, extent = in_flight
            bad += int(np.count_nonzero(self.engine.wait(batch) != extent))
            in_flight = following
        seconds = time.perf_counter() - t0
        user1, sys1 = cpu_split()
        engine1 = self.engine.stats
        if bad or not b.headers_intact():
            raise RuntimeError(f"{self.name}: read wrong, {bad} short or failed entries")
        return {
            "seconds": seconds, "cpu_seconds": (user1 - user0) + (sys1 - sys0), "cpu_user_seconds": user1 - user0,
            "cpu_sys_seconds": sys1 - sys0, "objects": b.object_count,
            "submissions": engine1["batches"] - engine0["batches"],
            "enter_calls": engine1["enter_calls"] - engine0["enter_calls"],
        }


class KvdEngineWholeBlocks(KvdEngineOnly):
    """Information only: each block as ONE extent (block_bytes), one batch, no checksums.

    What the same slots could deliver without reading in layer order: the
    cost of layer-ordered groups shows against this."""

    name = "kvd engine blocks"

    def __init__(self, tier: DiskTier, blocks: Blocks) -> None:
        super().__init__(tier, blocks)
        self.width = blocks.num_layers  # one group: every layer of a block in one extent


class EngineSequential:
    """Information only: the fio file read sequentially in 1 MiB entries through kvd.io (fio's access
    pattern, kvd's engine, queue depth 32, into the same arena): the device path's reference."""

    name = "kvd.io seq 1M"

    def __init__(self, path: Path, blocks: Blocks, queue_depth: int) -> None:
        self.blocks = blocks
        self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        self.engine = open_engine("auto", queue_depth, max_batch_entries=1 << 20)
        self.engine.register_files([self.fd])
        count = blocks.total_bytes >> 20
        self.offsets = np.arange(count, dtype=np.int64) << 20
        self.files = np.zeros(count, dtype=np.int32)
        self.lengths = np.full(count, 1 << 20, dtype=np.uint32)
        self.addresses = np.uint64(blocks.addresses[0]) + self.offsets.astype(np.uint64)  # the arena is contiguous

    def run(self) -> dict[str, Any]:
        (user0, sys0), t0 = cpu_split(), time.perf_counter()
        results = self.engine.wait(self.engine.submit(Op.READ, self.files, self.offsets, self.lengths, self.addresses))
        seconds = time.perf_counter() - t0
        user1, sys1 = cpu_split()
        if not np.all(results == 1 << 20):
            raise RuntimeError(f"sequential engine read failed: {np.unique(results)}")
        return {"seconds": seconds, "cpu_seconds": (user1 - user0) + (sys1 - sys0), "cpu_user_seconds": user1 - user0,
                "cpu_sys_seconds": sys1 - sys0, "objects": len(results)}

    def close(self) -> None:
        self.engine.close()
        os.close(self.fd)


class KvdStore:
    """write_blocks of the whole set, in calls of `batch_blocks`, under one fsync policy."""

    def __init__(self, root: Path, drives: int, blocks: Blocks, policy: FsyncPolicy, queue_depth: int,
                 batch_blocks: int) -> None:
        self.policy = policy
        self.name = f"kvd store {policy.value}"
        self.blocks = blocks
        self.batch_blocks = batch_blocks
        self.tier = open_tier(root, drives, blocks, policy, queue_depth)
        self.stored = False

    def clear(self) -> None:
        """Not timed: remove the previous round's blocks so their slots take new ones."""
        if not self.stored:
            return
        b = self.blocks
        ok = self.tier.remove_blocks(b.namespace_id, [(b.keys[i], i) for i in range(b.count)])
        if not all(ok):
            raise RuntimeError(f"{self.name}: remove failed")
        if self.policy == FsyncPolicy.GROUP:
            self.tier.sync()
        self.stored = False

    def run(self) -> dict[str, Any]:
        b, tier = self.blocks, self.tier
        self.clear()
        submissions0, fsyncs0 = tier.stats.submissions, tier.stats.fsyncs
        calls = 0
        (user0, sys0), t0 = cpu_split(), time.perf_counter()
        durable = 0
        for first in range(0, b.count, self.batch_blocks):
            ok = disk_ops.write_blocks(tier, b.namespace_id, b.layer_bytes, b.num_layers,
                                       write_items(b, first, min(b.count, first + self.batch_blocks)))
            durable += sum(ok)
            calls += 1
        if self.policy == FsyncPolicy.GROUP:
            tier.sync()  # the group commit that makes the manifest durable
        seconds = time.perf_counter() - t0
        user1, sys1 = cpu_split()
        self.stored = True
        if durable != b.count:
            raise RuntimeError(f"{self.name}: only {durable}/{b.count} blocks durable")
        return {
            "seconds": seconds, "cpu_seconds": (user1 - user0) + (sys1 - sys0), "cpu_user_seconds": user1 - user0,
            "cpu_sys_seconds": sys1 - sys0, "objects": b.object_count, "write_calls": calls,
            "submissions": tier.stats.submissions - submissions0, "segment_fdatasyncs": tier.stats.fsyncs - fsyncs0,
        }

    def close(self) -> None:
        self.tier.close()


# ---------------------------------------------------------------------------
# Baselines


class Fio:
    def __init__(self, binary: str, path: Path, rw: str, file_bytes: int, queue_depth: int) -> None:
        self.name = f"fio {rw}"
        self.rw = rw
        self.command = [
            binary, "--name=kvd-bench", f"--filename={path}", f"--rw={rw}", "--bs=1M", "--direct=1",
            "--ioengine=io_uring", f"--iodepth={queue_depth}", f"--size={file_bytes}",
            # Submit and reap up to a queue's worth per call (faster here, see bench_io_engine).
            f"--iodepth_batch_submit={queue_depth}", f"--iodepth_batch_complete_max={queue_depth}",
            "--numjobs=1", "--output-format=json",
        ]
        if rw == "write":
            self.command.append("--end_fsync=1")  # fio's runtime includes it
        self.file_bytes = file_bytes

    def run(self) -> dict[str, Any]:
        started = time.perf_counter()
        out = subprocess.run(self.command, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - started
        job = json.loads(out.stdout)["jobs"][0]
        side = job["read" if self.rw == "read" else "write"]
        if side["io_bytes"] != self.file_bytes:
            raise RuntimeError(f"fio moved {side['io_bytes']} bytes, expected {self.file_bytes}")
        seconds = side["io_bytes"] / side["bw_bytes"]  # fio's own I/O time, without its start-up
        job_seconds = job["job_runtime"] / 1e3
        return {
            "seconds": seconds, "wall_seconds_with_startup": wall,
            "cpu_seconds": (job["usr_cpu"] + job["sys_cpu"]) / 100 * job_seconds,
            "cpu_user_seconds": job["usr_cpu"] / 100 * job_seconds,
            "cpu_sys_seconds": job["sys_cpu"] / 100 * job_seconds,
            "objects": side["total_ios"],
        }


class NaiveFiles:
    """One file per block, buffered reads, one Python call per layer object."""

    name = "naive"

    def __init__(self, directory: Path, blocks: Blocks) -> None:
        self.blocks = blocks
        directory.mkdir(parents=True, exist_ok=True)
        self.paths = [directory / f"block-{i:06d}.kv" for i in range(blocks.count)]
        for i, path in enumerate(self.paths):
            with open(path, "wb") as handle:
                handle.write(blocks.arena.slots[i].data)
                handle.flush()
                os.fsync(handle.fileno())
        fd = os.open(directory, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        self.dropped_cache = True

    def drop_cache(self) -> bool:
        """posix_fadvise(DONTNEED) on every file (clean pages go), so a round reads the drive."""
        try:
            for path in self.paths:
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
        except (OSError, AttributeError):
            return False
        return True

    def run(self) -> dict[str, Any]:
        b = self.blocks
        b.poison()
        dropped = self.drop_cache()
        self.dropped_cache = self.dropped_cache and dropped
        view = memoryview(b.arena.array)
        layer_bytes, num_layers, block_bytes = b.layer_bytes, b.num_layers, b.block_bytes
        short = 0
        try:
            (user0, sys0), t0 = cpu_split(), time.perf_counter()
            for i, path in enumerate(self.paths):
                with open(path, "rb") as handle:
                    base = i * block_bytes
                    for layer in range(num_layers):
                        start = base + layer * layer_bytes
                        if handle.readinto(view[start : start + layer_bytes]) != layer_bytes:
                            short += 1
            seconds = time.perf_counter() - t0
            user1, sys1 = cpu_split()
        finally:
            view.release()
        if short or not b.headers_intact():
            raise RuntimeError(f"naive read wrong: {short} short reads")
        return {"seconds": seconds, "cpu_seconds": (user1 - user0) + (sys1 - sys0), "cpu_user_seconds": user1 - user0,
                "cpu_sys_seconds": sys1 - sys0, "objects": b.object_count, "page_cache_dropped": dropped}
