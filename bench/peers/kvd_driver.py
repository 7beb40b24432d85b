#!/usr/bin/env python3
"""kvd as a contender of bench_peers.py: a real daemon, driven through its client.

    .venv/bin/python bench/peers/kvd_driver.py '<Workload JSON>' [--no-disk] [--no-huge-pages] [--pinned] [--steady]
                                               [--zero-segments]

The daemon runs in its own process with the workload's directory as two
disk-tier drives (two directories on one file system, as a host with two
NVMe drives would configure it), host memory sized to hold every block
below the write-back watermark, and slots exactly one block long. Blocks
are one prefix chain, stored with a durable Put (the call returns once
every block is on disk and synced, whatever the daemon's fsync policy,
which the store command picks with its "fsync" key: none, group or
strict; under none and group the waiting Put starts the commits). A restore is a
Get into the caller's array once the running daemon has dropped its host
copies (`cold`: the Demote call), so every byte comes from disk, checksums
verified; the caller's array is filled from the arena by the client as the
daemon answers. The daemon is not restarted for that: a restart would read
into a just-allocated arena, while the peers read into the buffer they
have read into before (on this VM, O_DIRECT into memory the disk has never
touched is slower).

With --pinned the blocks move in place, as an engine moves them (vLLM's
connector does): a restore is `get_pinned`, the blocks left in the arena
under a lease, where an engine uploads them from (copied out and checked
only after the timed section); a store is `reserve`, the slots filled
(not timed: the engine's download from the GPU), then a durable commit.
The same hand-over as the peers' store from, and restore into, their own
host buffer, which an engine fills from and uploads from.

With --steady the disk tier is kept between rounds, as a long-running
daemon keeps it: a round's clear deletes the blocks through the API (and
checks that none is left) instead of removing the drives' directories, so
a store writes into slots written before. Without it every store meets a
tier just created, whose preallocated segments have never been written
(on ext4 each first write into them also converts unwritten extents).
The first clear of a steady run stores every block once, untimed, so that
no timed store meets a slot never written.

With --zero-segments the daemon writes zeros over the segments it creates
(disk.zero_segments), at the start that creates them (untimed: in the
clear before each store), so its first fill meets no unwritten extent.

With --no-disk the daemon has host memory only (the host-memory Get and
Lookup contender). With --no-huge-pages its arena stays in 4 KiB pages
(host.huge_pages = false), as on a host whose shmem_enabled is never.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import protocol  # noqa: E402

import kvd  # noqa: E402
from kvd.client import Client  # noqa: E402
from kvd.core.keys import DType, NamespaceSpec  # noqa: E402
from kvd.testing.daemon import start_daemon  # noqa: E402

HEADS, HEAD_DIM, ITEM = 8, 128, 2  # a Llama-3-8B-like layer in bf16: 4 KiB per token
WATERMARK_HEADROOM = 0.85  # host blocks / capacity, below the 0.9 write-back mark
LOOKUP_MAX_KEYS = 8192  # the lookup's tiny blocks the host tier makes room for
LOOKUP_SPEC = NamespaceSpec("bench-peers-lookup", num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16,
                            kv_dtype=DType.BFLOAT16)


def block_keys(count: int, salt: bytes = b"") -> list[bytes]:
    return [hashlib.blake2b(salt + i.to_bytes(8, "little"), digest_size=32).digest() for i in range(count)]


class KvdContender:
    def __init__(self, workload: protocol.Workload, disk: bool, huge_pages: bool = True, pinned: bool = False,
                 steady: bool = False, zero_segments: bool = False) -> None:
        tokens, remainder = divmod(workload.layer_bytes, 2 * HEADS * HEAD_DIM * ITEM)
        if remainder:
            raise SystemExit(f"layer_bytes {workload.layer_bytes} is not a whole number of bf16 tokens")
        self.workload = workload
        self.disk = disk
        self.huge_pages = huge_pages
        self.pinned = pinned
        self.steady = steady
        self.zero_segments = zero_segments
        self.warmed = False  # (--steady) the tier's slots for the blocks were written once
        self.spec = NamespaceSpec("bench-peers", num_layers=workload.layers, num_kv_heads=HEADS,
                                  head_dim=HEAD_DIM, block_tokens=tokens, kv_dtype=DType.BFLOAT16)
        self.keys = block_keys(workload.blocks)
        self.buffer = protocol.aligned_buffer(workload.total_bytes)
        protocol.fill(self.buffer, workload.seed)
        self.blocks = self.buffer.view(np.uint16).reshape(workload.blocks, *self.spec.block_shape)
        self.root = Path(workload.dir)
        self.fsync = "none"
        self.daemon = None
        self.client: Client | None = None
        self.namespace = None

    # -- the daemon

    def _config(self) -> dict:
        workload = self.workload
        pages = int(workload.blocks / WATERMARK_HEADROOM) + 2
        smallest = workload.block_bytes
        if not self.disk:  # room for the lookup's tiny blocks, in 4 KiB slots of their own pages
            smallest = 4096
            pages += -(-int(LOOKUP_MAX_KEYS * smallest / WATERMARK_HEADROOM) // workload.block_bytes) + 1
        config: dict = {
            "host": {"capacity_bytes": pages * workload.block_bytes, "slot_bytes": workload.block_bytes,
                     "min_slot_bytes": smallest, "huge_pages": self.huge_pages},
            "log": {"level": "warning"},
        }
        if self.disk:
            segment = max(workload.block_bytes, 1 << 30) // workload.block_bytes * workload.block_bytes
            per_drive = -(-workload.total_bytes // segment) * segment
            config["disk"] = {
                "directories": [str(self.root / "drive0"), str(self.root / "drive1")],
                "capacity_bytes": per_drive, "slot_bytes": workload.block_bytes,
                "min_slot_bytes": workload.block_bytes, "segment_bytes": segment, "fsync": self.fsync,
                "zero_segments": self.zero_segments,
            }
        return config

    def start(self) -> None:
        self.daemon = start_daemon(self.root / "daemon", self._config())
        self.client = Client(self.daemon.unix_target)
        self.namespace = self.client.register_namespace(self.spec)
        # Connect now (map the arena), as an engine does once at start: set-up, not part of a store or restore.
        self.client.arena_info()

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.daemon is not None:
            code = self.daemon.stop()
            if code != 0:
                raise RuntimeError(f"kvd exited with {code}:\n{self.daemon.log()[-2000:]}")
            self.daemon = None

    def restart(self) -> None:
        self.stop()
        self.start()

    # -- the ops

    def store(self, command: dict) -> dict:
        fsync = command.get("fsync", "none")
        if fsync != self.fsync or self.daemon is None:
            self.fsync = fsync
            self.restart()
        if self.pinned:
            seconds, stored = self._store_in_place()
        else:
            seconds, stored = protocol.timed(
                lambda: self.client.put(self.namespace, self.keys, self.blocks, durable=True))
        return {"seconds": seconds, "ok": stored == len(self.keys), "fsync": fsync}

    def _store_in_place(self) -> tuple[float, int]:
        """Reserve, fill the slots (not timed: the engine's own copy from the GPU, as the peers'
        copy into their host buffer is not), commit durable (timed)."""
        started = time.perf_counter()
        with self.client.reserve(self.namespace, self.keys) as slots:
            reserved = time.perf_counter()
            slots.fill(self.blocks)
            filled = time.perf_counter()
            stored = slots.commit(durable=True)
            return reserved - started + time.perf_counter() - filled, stored

    def clear(self, command: dict) -> dict:
        if not (self.steady and self.warmed):
            self.stop()
            for name in ("daemon", "drive0", "drive1"):
                shutil.rmtree(self.root / name, ignore_errors=True)
            self.start()
            if not self.steady:
                return {"ok": True}
            self.client.put(self.namespace, self.keys, self.blocks, durable=True)  # the untimed first fill
            self.warmed = True
        self.client.delete(self.namespace, self.keys[:1])  # the chain's root: every block
        self.restart()
        left = self.client.lookup(self.namespace, self.keys).matched
        if left:
            raise RuntimeError(f"{left} blocks still stored after the clear: the next store would skip them")
        return {"ok": True}

    def cold(self, command: dict) -> dict:
        """Drop every host copy (each block is on disk: the store was durable), so the next Get reads the disk."""
        answer = self.client.demote()
        if answer.blocks_demoted != len(self.keys) or answer.blocks_kept:
            raise RuntimeError(f"Demote dropped {answer.blocks_demoted} of {len(self.keys)} blocks and kept "
                               f"{answer.blocks_kept}: the restore would not read them all from disk")
        return {"ok": True}

    def _get(self) -> dict:
        protocol.scramble(self.buffer)
        seconds, out = protocol.timed(lambda: self.client.get_numpy(self.namespace, self.keys, out=self.blocks))
        ok = out.shape[0] == len(self.keys) and protocol.check(self.buffer, self.workload.seed)
        protocol.fill(self.buffer, self.workload.seed)  # the source for the next store
        return {"seconds": seconds, "ok": bool(ok)}

    def _get_pinned(self) -> dict:
        protocol.scramble(self.buffer)
        seconds, held = protocol.timed(lambda: self.client.get_pinned(self.namespace, self.keys))
        with held:  # checked after the timed section, through a copy out of the arena
            ok = held.matched == len(self.keys) and held.copy_to(self.blocks).shape[0] == len(self.keys)
        ok = ok and protocol.check(self.buffer, self.workload.seed)
        protocol.fill(self.buffer, self.workload.seed)
        return {"seconds": seconds, "ok": bool(ok)}

    def restore(self, command: dict) -> dict:
        """A Get after `cold`, and how long of it the daemon's read job ran."""
        before = self._restore_job_seconds()
        answer = self._get_pinned() if self.pinned else self._get()
        return {**answer, "daemon_read_s": self._restore_job_seconds() - before,
                "arena_huge_share": self._arena_huge_share()}

    def _arena_huge_share(self) -> float:
        """How much of the arena the daemon maps with huge pages (its kvd_arena_huge_page_bytes)."""
        huge = sum(self.daemon.metric_samples("kvd_arena_huge_page_bytes").values())
        return huge / self._config()["host"]["capacity_bytes"]

    def _restore_job_seconds(self) -> float:
        samples = self.daemon.metric_samples("kvd_disk_job_run_seconds_sum")
        return sum(value for key, value in samples.items() if 'class="restore"' in key)

    def put_memory(self, command: dict) -> dict:
        if self.daemon is None:
            self.start()
        stored = self.client.put(self.namespace, self.keys, self.blocks)
        return {"ok": stored == len(self.keys)}

    def lookup(self, command: dict) -> dict:
        count, repeats = int(command["keys"]), int(command.get("repeats", 20))
        if self.daemon is None:
            self.start()
        tiny = self.client.register_namespace(LOOKUP_SPEC)
        keys = block_keys(count, b"lookup")
        blocks = np.zeros((count, *LOOKUP_SPEC.block_shape), dtype=np.uint16)
        self.client.put(tiny, keys, blocks)
        latencies, matched = [], []
        for _ in range(repeats):
            seconds, result = protocol.timed(lambda: self.client.lookup(tiny, keys))
            latencies.append(seconds)
            matched.append(result.matched)
        return {"latencies_s": latencies, "ok": all(m == count for m in matched)}

    def handlers(self) -> dict:
        return {"store": self.store, "clear": self.clear, "cold": self.cold,
                "restore": self.restore,
                "put_memory": self.put_memory,
                "get_memory": lambda command: self._get(), "lookup": self.lookup}


def main() -> None:
    workload = protocol.Workload.from_json(sys.argv[1])
    contender = KvdContender(workload, disk="--no-disk" not in sys.argv[2:],
                             huge_pages="--no-huge-pages" not in sys.argv[2:], pinned="--pinned" in sys.argv[2:],
                             steady="--steady" in sys.argv[2:], zero_segments="--zero-segments" in sys.argv[2:])
    contender.start()
    try:
        protocol.serve("kvd", kvd.__version__, contender.handlers())
    finally:
        contender.stop()


if __name__ == "__main__":
    main()
