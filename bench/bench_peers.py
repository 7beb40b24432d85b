#!/usr/bin/env python3
"""kvd side by side with the stores its users would otherwise run, same bytes, same run.

Run:  make bench-peers      (installs the peers' environments, then this)
      .venv/bin/python bench/bench_peers.py [--total-mib 2048] [--host-mib 1024] [--rounds 5]
                                            [--only kvd vllm-fs ...] [--skip-host] [--skip-disk]
                                            [--result-name bench_peers]

Every contender is a long-lived process in its own virtual environment,
driven over a line protocol (bench/peers/protocol.py), so rounds are
interleaved (the order rotates every round) and nothing is started inside
a timed section. All hold the same bytes (a seeded pattern) laid out as a
Llama-3-8B-like bf16 cache: 32 layers of 8 KV heads x 128 dims, at 16
tokens per block (64 KiB layers, 2 MiB blocks) and 256 tokens per block
(1 MiB layers, 32 MiB blocks). Every read is checked against the pattern
after its timed section.

Disk, per block size (--total-mib per round, each contender in its own
directory on one file system):
  * kvd: a real daemon (bench/peers/kvd_driver.py) with two disk-tier
    drives; store = a durable Put under fsync none, group and strict;
    restore = a Get into the caller's array once the daemon has dropped
    its host copies (Demote: a cold host tier, no restart), checksums
    verified by the daemon. The run sets the
    kernel's shmem_enabled to advise (--shmem-thp; put back at the end),
    as docs/operations.md recommends, so kvd's arena gets huge pages;
    kvd-4k is the same daemon with host.huge_pages off, as on a host left
    at never. kvd-pinned moves the blocks in place, as an engine does:
    restore with get_pinned (the blocks stay in the arena under a lease,
    where an engine uploads them from; copied out and checked after the
    timed section), store with reserve, fill (not timed: the engine's copy
    from the GPU) and a durable commit: as the peers restore into, and
    store from, their own host buffer. kvd-steady is kvd-pinned in a
    long-running daemon's steady state: its disk tier is kept between
    rounds (the blocks deleted through the API), so a store writes into
    slots written before, where the others store into a tier just created
    (whose preallocated segments pay ext4's unwritten-extent conversion on
    their first write).
  * vllm-fs: vLLM's FS secondary tier (its native fs_io_C batch calls, one
    O_DIRECT file per block, 16 threads), from .venv-vllm.
  * vllm-tiering-fs: the same FS tier as vLLM's tiering OffloadingConnector
    builds it (TieringOffloadingSpec.get_manager(), its scheduler side, which
    runs without a GPU), moved through the tier's own jobs (submit_store,
    submit_load); its primary tier's /dev/shm region is the caller's buffer.
  * vllm-tiering-obj: that connector's object-store tier, the same way. It
    needs NIXL's OBJ plugin and an S3 endpoint; where it cannot be built,
    its row is "could not run" with vLLM's exception and where it was raised.
  * vllm-simple-disk: SimpleCPUOffloadConnector's disk backend: its own
    pwritev / preadv of one block at a time into one O_DIRECT slot file
    (its init needs CUDA; the error is kept in the results as init_error).
  * lmcache-disk: LMCache's local disk backend, from .venv-lmcache.
  * fio: the physical reference. Before the rounds, fio sweeps jobs x queue
    depths (1 MiB O_DIRECT io_uring) over a file of the same size; the best
    read and write settings then run in every round.
  Before every store the contender's previous data is removed (kvd-steady:
  deleted through the API); before
  every restore the contender drops what it holds in memory and the page
  cache is dropped (as root). In a round, each contender runs its stores
  and then its restore before the next contender starts: the restore
  reads what it has just stored, with no other contender's bytes written
  in between (the VM's disk caches recent writes on its host).
Host memory, per block size (--host-mib, blocks already in the store):
  * kvd without a disk tier, Mooncake's store (.venv-mooncake, shared
    memory and TCP modes), Redis; memcpy with one and two threads is the
    ceiling (kvd's client copies with two).
  * Lookup of an 8,000-block prefix: kvd, Mooncake's batch_is_exist, Redis
    pipelined EXISTS.

Each timed disk operation also reports what the block device under --dir
saw (bench/devicestats.py, from /proc/diskstats): the mean request size,
the mean number of requests queued, the bytes kept in flight and the mean
time a request took; kvd's restores add the share of the call its
daemon's read job ran (kvd_disk_job_run_seconds). Readers that keep
different amounts in flight at latencies in the same proportion are both
at the device's bandwidth.

Targets (issue 13, medians): restore >= 1.1x the best peer; store with fsync
none >= 1.0x the best peer's unsynced store, group >= 0.9x of it, strict >=
1.0x the best peer's store plus a final sync; host Get >= 0.9x memcpy with
two threads; Lookup p50 <= 2 ms. A peer whose environment is missing is
reported as absent, never as beaten.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))

import devicestats  # noqa: E402
import protocol  # noqa: E402
from _common import REPO_ROOT, progress, report, summarize_latencies, warn_if_busy, write_result  # noqa: E402
from _peer_process import Contender, ContenderSpec, close_all, start_all  # noqa: E402

MIB = 1 << 20
LAYERS, TOKEN_BYTES = 32, 2 * 8 * 128 * 2  # K and V of 8 heads x 128 dims in bf16
SHAPES = {"tokens16": 16, "tokens256": 256}
TARGETS = {"restore": 1.1, "store_none": 1.0, "store_group": 0.9, "store_strict": 1.0,
           "host_get": 0.9, "lookup_p50_ms": 2.0}
LOOKUP_KEYS = 8000


PEER_STORE = (("store", {"sync": False}), ("store+sync", {"sync": True}))
KVD_STORE = tuple((f"store {mode}", {"fsync": mode}) for mode in ("none", "group", "strict"))
DISK_CONTENDERS = (
    ContenderSpec("kvd", ".venv", "kvd_driver.py", store_variants=KVD_STORE),
    # kvd storing from and restoring into its arena (reserve, get_pinned), where an engine
    # fills and uploads from: as the peers store from and restore into their own host buffer.
    ContenderSpec("kvd-pinned", ".venv", "kvd_driver.py", ("--pinned",), store_variants=KVD_STORE),
    # kvd-pinned in a long-running daemon's steady state: its disk tier kept between rounds (the
    # blocks deleted through the API), so stores write into slots written before; the others
    # store into a tier just created.
    ContenderSpec("kvd-steady", ".venv", "kvd_driver.py", ("--pinned", "--steady"), store_variants=KVD_STORE),
    # kvd-pinned with disk.zero_segments: a tier just created, its segments zeroed at the start.
    ContenderSpec("kvd-zeroed", ".venv", "kvd_driver.py", ("--pinned", "--zero-segments"), store_variants=KVD_STORE),
    # kvd with its arena in 4 KiB pages, as on a host whose shmem_enabled is never.
    ContenderSpec("kvd-4k", ".venv", "kvd_driver.py", ("--no-huge-pages",), store_variants=KVD_STORE),
    ContenderSpec("vllm-fs", ".venv-vllm", "vllm_fs.py", store_variants=PEER_STORE),
    # The secondary tiers of vLLM's tiering OffloadingConnector, built by its own spec and driven
    # through the tier's job interface; and SimpleCPUOffloadConnector's disk backend, its own I/O
    # methods (bench/peers/vllm_tiering.py, vllm_simple_disk.py say what runs and what cannot).
    ContenderSpec("vllm-tiering-fs", ".venv-vllm", "vllm_tiering.py", ("--tier", "fs"), PEER_STORE),
    ContenderSpec("vllm-tiering-obj", ".venv-vllm", "vllm_tiering.py", ("--tier", "obj"), PEER_STORE),
    ContenderSpec("vllm-simple-disk", ".venv-vllm", "vllm_simple_disk.py", store_variants=PEER_STORE),
    ContenderSpec("lmcache-disk", ".venv-lmcache", "lmcache_disk.py", store_variants=PEER_STORE),
)
HOST_CONTENDERS = (
    ContenderSpec("kvd", ".venv", "kvd_driver.py", ("--no-disk",)),
    ContenderSpec("mooncake-shm", ".venv-mooncake", "mooncake_store.py", ("--mode", "shm")),
    ContenderSpec("mooncake-tcp", ".venv-mooncake", "mooncake_store.py", ("--mode", "tcp")),
    ContenderSpec("redis", ".venv", "redis_driver.py"),
    ContenderSpec("memcpy x1", ".venv", "memcpy_driver.py", ("1",)),
    ContenderSpec("memcpy x2", ".venv", "memcpy_driver.py", ("2",)),
)


def drop_page_cache() -> bool:
    """Write back and drop the page cache (root only); False where not allowed."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


SHMEM_THP = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")


@contextlib.contextmanager
def shmem_huge_pages(mode: str):
    """Run with the kernel's shmem huge page setting at `mode` ("leave": as found), put back after;
    yields the setting in force."""
    try:
        found = SHMEM_THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        yield "unknown"
        return
    if mode in ("leave", found):
        yield found
        return
    try:
        SHMEM_THP.write_text(mode + "\n")
    except OSError as error:
        progress(f"shmem_enabled stays {found}: {error}")
        yield found
        return
    progress(f"shmem_enabled {found} -> {mode} for this run (put back at the end)")
    try:
        yield mode
    finally:
        SHMEM_THP.write_text(found + "\n")


# ---------------------------------------------------------------------------
# fio, the physical reference


@dataclass
class FioSetting:
    jobs: int
    depth: int
    rw: str
    end_fsync: bool = False

    @property
    def label(self) -> str:
        sync = " +fsync" if self.end_fsync else ""
        return f"fio {self.rw} {self.jobs}j qd{self.depth}{sync}"

    def command(self, path: Path, total: int) -> list[str]:
        per_job = total // self.jobs // MIB * MIB
        command = [shutil.which("fio") or "fio", "--name=peers", f"--filename={path}", f"--rw={self.rw}",
                   "--bs=1M", "--direct=1", "--ioengine=io_uring", f"--iodepth={self.depth}",
                   f"--numjobs={self.jobs}", f"--size={per_job}", f"--offset_increment={per_job}",
                   "--group_reporting", "--output-format=json"]
        return command + (["--end_fsync=1"] if self.end_fsync else [])

    def run(self, path: Path, total: int) -> float:
        drop_page_cache()
        out = subprocess.run(self.command(path, total), capture_output=True, text=True, check=True)
        side = json.loads(out.stdout)["jobs"][0]["read" if self.rw == "read" else "write"]
        if side["io_bytes"] < total // self.jobs // MIB * MIB * self.jobs:
            raise RuntimeError(f"{self.label} moved {side['io_bytes']} bytes")
        return side["io_bytes"] / side["bw_bytes"] * total / side["io_bytes"]  # seconds for `total` bytes


def fio_sweep(path: Path, total: int, jobs: list[int], depths: list[int]) -> dict[str, Any]:
    """Every jobs x depth for reads and writes once; the best of each, by bandwidth."""
    seen: dict[str, float] = {}
    best: dict[str, FioSetting] = {}
    for rw in ("write", "read"):  # the write lays the file out for the reads
        for count in jobs:
            for depth in depths:
                setting = FioSetting(count, depth, rw)
                seconds = setting.run(path, total)
                seen[setting.label] = total / seconds / (1 << 30)
                progress(f"  {setting.label}: {seen[setting.label]:.2f} GiB/s")
                if rw not in best or seconds < total / (seen[best[rw].label] * (1 << 30)):
                    best[rw] = setting
    write = best["write"]
    best["write+fsync"] = FioSetting(write.jobs, write.depth, "write", end_fsync=True)
    return {"gib_s": seen, "best": best}


# ---------------------------------------------------------------------------
# Rounds


@dataclass
class Samples:
    seconds: dict[str, list[float]] = field(default_factory=dict)
    devices: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    daemon_reads: dict[str, list[float]] = field(default_factory=dict)
    huge_pages: dict[str, list[float]] = field(default_factory=dict)  # kvd: share of the arena in huge pages

    def add(self, label: str, seconds: float, device: dict[str, float] | None = None,
            answer: dict[str, Any] | None = None) -> None:
        self.seconds.setdefault(label, []).append(seconds)
        if device is not None:
            self.devices.setdefault(label, []).append(device)
        answer = answer or {}
        if answer.get("daemon_read_s") is not None:
            self.daemon_reads.setdefault(label, []).append(answer["daemon_read_s"] / seconds)
        if answer.get("arena_huge_share") is not None:
            self.huge_pages.setdefault(label, []).append(answer["arena_huge_share"])

    def timed(self, label: str, device: str | None, run) -> dict[str, Any]:
        """run() answers {"seconds": ...}; recorded with what `device` saw meanwhile."""
        before = devicestats.snapshot(device)
        answer = run()
        seen = devicestats.view(before, devicestats.snapshot(device), answer["seconds"])
        self.add(label, answer["seconds"], seen, answer)
        return answer

    def summary(self, nbytes: int) -> dict[str, Any]:
        out = {}
        for label, values in self.seconds.items():
            rates = [nbytes / s / (1 << 30) for s in values]
            out[label] = {"median_gib_s": statistics.median(rates), "best_gib_s": max(rates), "gib_s": rates}
            if self.devices.get(label):
                views = self.devices[label]
                out[label]["device"] = {key: statistics.median(v[key] for v in views) for key in views[0]}
            if self.daemon_reads.get(label):
                out[label]["daemon_read_share"] = statistics.median(self.daemon_reads[label])
            if self.huge_pages.get(label):
                out[label]["arena_huge_share_min"] = min(self.huge_pages[label])
        return out


def disk_round(contenders: dict[str, Contender], order: list[str], fio: dict, fio_path: Path,
               total: int, samples: Samples, device: str | None) -> None:
    # Each contender reads back what it has just stored, nobody else's bytes
    # written in between: the virtual disk's host caches recent writes, and
    # a restore after the others' stores would find less of its own there.
    for name in order:
        contender = contenders[name]
        for label, fields in contender.spec.store_variants:
            contender.ask("clear")
            drop_page_cache()
            samples.timed(f"{name} {label}", device, lambda: contender.ask("store", **fields))
        contender.ask("cold")
        drop_page_cache()
        samples.timed(f"{name} restore", device, lambda: contender.ask("restore"))
    for key in ("read", "write", "write+fsync"):
        setting = fio["best"][key]
        samples.timed(f"fio {key}", device, lambda: {"seconds": setting.run(fio_path, total)})


def host_round(contenders: dict[str, Contender], order: list[str], samples: Samples) -> None:
    for name in order:
        samples.add(f"{name} get", contenders[name].ask("get_memory")["seconds"])


def rotated(names: list[str], round_index: int) -> list[str]:
    shift = round_index % max(1, len(names))
    return names[shift:] + names[:shift]


# ---------------------------------------------------------------------------
# Phases


def workload(root: Path, name: str, layer_bytes: int, total: int) -> protocol.Workload:
    directory = root / name
    directory.mkdir(parents=True, exist_ok=True)
    return protocol.Workload(dir=str(directory), layers=LAYERS, layer_bytes=layer_bytes,
                             blocks=max(1, total // (LAYERS * layer_bytes)))


def disk_phase(args, shape: str, tokens: int, root: Path) -> dict[str, Any]:
    layer_bytes = tokens * TOKEN_BYTES
    total = args.total_mib * MIB
    base = root / shape
    specs = [s for s in DISK_CONTENDERS if not args.only or s.name in args.only]
    refused: dict[str, dict] = {}
    contenders = start_all(specs, lambda s: workload(base, s.name.replace(" ", "_"), layer_bytes, total), base,
                           refused)
    device = devicestats.device_of(base)
    try:
        progress(f"{shape}: fio sweep")
        fio = fio_sweep(base / "fio.bin", total, args.fio_jobs, args.fio_depths)
        samples = Samples()
        for index in range(args.rounds):
            progress(f"{shape}: disk round {index + 1}/{args.rounds}")
            disk_round(contenders, rotated(sorted(contenders), index), fio, base / "fio.bin", total, samples, device)
        versions = {name: c.version for name, c in contenders.items()}
        notes = {name: c.notes for name, c in contenders.items() if c.notes}
    finally:
        close_all(contenders)
        shutil.rmtree(base, ignore_errors=True)
    results = samples.summary(total)
    return {"layer_bytes": layer_bytes, "total_bytes": total, "versions": versions, "device": device,
            "fio_sweep_gib_s": fio["gib_s"], "fio_best": {k: v.label for k, v in fio["best"].items()},
            "results": results, "could_not_run": refused, "notes": notes, "ratios": disk_ratios(results)}


def host_phase(args, shape: str, tokens: int, root: Path, with_lookup: bool) -> dict[str, Any]:
    layer_bytes = tokens * TOKEN_BYTES
    total = args.host_mib * MIB
    base = root / f"host-{shape}"
    specs = [s for s in HOST_CONTENDERS if not args.only or s.name in args.only]
    contenders = start_all(specs, lambda s: workload(base, s.name.replace(" ", "_"), layer_bytes, total), base)
    lookups: dict[str, Any] = {}
    try:
        for contender in contenders.values():
            contender.ask("put_memory")
        samples = Samples()
        for index in range(args.rounds):
            progress(f"{shape}: host round {index + 1}/{args.rounds}")
            host_round(contenders, rotated(sorted(contenders), index), samples)
        if with_lookup:
            lookups = lookup_phase(contenders, args.lookup_repeats)
        versions = {name: c.version for name, c in contenders.items()}
    finally:
        close_all(contenders)
        shutil.rmtree(base, ignore_errors=True)
    results = samples.summary(total)
    return {"layer_bytes": layer_bytes, "total_bytes": total, "versions": versions, "results": results,
            "ratios": host_ratios(results), "lookup": lookups}


def lookup_phase(contenders: dict[str, Contender], repeats: int) -> dict[str, Any]:
    out = {}
    for name, contender in contenders.items():
        answer = contender.ask("lookup", keys=LOOKUP_KEYS, repeats=repeats)
        if answer.get("unsupported"):
            continue
        progress(f"lookup {LOOKUP_KEYS} keys: {name}")
        out[name] = summarize_latencies(answer["latencies_s"])
    return out


# ---------------------------------------------------------------------------
# Ratios and the report


def _median(results: dict, label: str) -> float | None:
    entry = results.get(label)
    return entry["median_gib_s"] if entry else None


def _best_peer(results: dict, suffix: str, exclude: tuple[str, ...] = ("kvd", "fio")) -> tuple[str | None, float]:
    best_name, best = None, 0.0
    for label, entry in results.items():
        if label.endswith(suffix) and not label.startswith(exclude) and entry["median_gib_s"] > best:
            best_name, best = label, entry["median_gib_s"]
    return best_name, best


def disk_ratios(results: dict) -> dict[str, Any]:
    ratios: dict[str, Any] = {}
    restore_peer, restore_best = _best_peer(results, " restore")
    store_peer, store_best = _best_peer(results, " store")
    synced_peer, synced_best = _best_peer(results, " store+sync")
    pairs = {
        "restore": ("restore", restore_peer, restore_best),
        "store_none": ("store none", store_peer, store_best),
        "store_group": ("store group", store_peer, store_best),
        "store_strict": ("store strict", synced_peer, synced_best),
    }
    for contender, suffix in (("kvd", ""), ("kvd-pinned", "_pinned"), ("kvd-steady", "_steady"),
                              ("kvd-zeroed", "_zeroed")):
        for key, (operation, peer, best) in pairs.items():
            value = _median(results, f"{contender} {operation}")
            if value or not suffix:
                ratios[key + suffix] = {"vs": peer, "ratio": value / best if value and best else None,
                                        "target": TARGETS[key]}
    fio_read = _median(results, "fio read")
    kvd_restore = _median(results, "kvd restore")
    ratios["restore_vs_fio_best"] = kvd_restore / fio_read if kvd_restore and fio_read else None
    for operation in ("restore", "store none"):  # what huge pages for the arena gave
        huge, small = _median(results, f"kvd {operation}"), _median(results, f"kvd-4k {operation}")
        ratios[f"{operation} huge pages / 4 KiB pages"] = huge / small if huge and small else None
    ratios.update(vllm_path_ratios(results))
    return ratios


VLLM_PATHS = ("vllm-fs", "vllm-tiering-fs", "vllm-tiering-obj", "vllm-simple-disk")


def vllm_path_ratios(results: dict) -> dict[str, float]:
    """kvd-pinned (the engine's hand-over, as the peers') against each of vLLM's storage paths that ran:
    restore against restore, fsync none against the unsynced store, strict against store+sync."""
    ratios = {}
    for peer in VLLM_PATHS:
        for mine, theirs in (("restore", "restore"), ("store none", "store"), ("store strict", "store+sync")):
            kvd, other = _median(results, f"kvd-pinned {mine}"), _median(results, f"{peer} {theirs}")
            if kvd and other:
                ratios[f"kvd-pinned {mine} / {peer} {theirs}"] = kvd / other
    return ratios


def host_ratios(results: dict) -> dict[str, Any]:
    kvd = _median(results, "kvd get")
    ratios: dict[str, Any] = {}
    for label, entry in results.items():
        if not label.startswith("kvd") and kvd:
            ratios[f"kvd / {label.removesuffix(' get')}"] = kvd / entry["median_gib_s"]
    memcpy = _median(results, "memcpy x2 get")
    ratios["host_get"] = {"vs": "memcpy x2", "ratio": kvd / memcpy if kvd and memcpy else None,
                          "target": TARGETS["host_get"]}
    return ratios


def print_phase(title: str, phase: dict[str, Any]) -> None:
    report(f"\n{title}  ({phase['total_bytes'] / MIB:.0f} MiB, {phase['layer_bytes'] // 1024} KiB layers)")
    for label, entry in sorted(phase["results"].items()):
        report(f"  {label:28s} median {entry['median_gib_s']:6.2f} GiB/s   best {entry['best_gib_s']:6.2f}")
        if "device" in entry:
            report(f"  {'':28s} {phase.get('device')}: {devicestats.describe(entry['device'])}")
        if "daemon_read_share" in entry:
            report(f"  {'':28s} the daemon's read job: {entry['daemon_read_share']:.0%} of the call")
        if "arena_huge_share_min" in entry:
            report(f"  {'':28s} the arena in huge pages: at least {entry['arena_huge_share_min']:.0%}")
    print_refusals(phase)
    for key, value in phase["ratios"].items():
        if isinstance(value, dict):
            shown = "n/a" if value["ratio"] is None else f"{value['ratio']:.2f}x"
            met = "" if value["ratio"] is None else ("  met" if value["ratio"] >= value["target"] else "  MISSED")
            report(f"  {key:28s} {shown} of {value['vs']} (target {value['target']}x){met}")
        elif value is not None:
            report(f"  {key:28s} {value:.2f}x")
    for name, latency in phase.get("lookup", {}).items():
        report(f"  lookup {LOOKUP_KEYS} {name:18s} p50 {latency['p50_ms']:7.2f} ms   p99 {latency['p99_ms']:7.2f} ms")


def print_refusals(phase: dict[str, Any]) -> None:
    """The peers that could not run here, and what a peer that ran could not do, as vLLM raised it."""
    for name, row in sorted(phase.get("could_not_run", {}).items()):
        report(f"  {name:28s} could not run: {row['error']} ({row['raised_at']})")
    for name, notes in sorted(phase.get("notes", {}).items()):
        for key, note in notes.items():
            report(f"  {name:28s} {key}: {note.get('error', note)} ({note.get('raised_at', '')})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--total-mib", type=int, default=2048, help="bytes per disk round")
    parser.add_argument("--host-mib", type=int, default=1024, help="bytes per host-memory round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--only", nargs="+", help="contender names to run (kvd, vllm-fs, lmcache-disk, ...)")
    parser.add_argument("--skip-disk", action="store_true")
    parser.add_argument("--skip-host", action="store_true")
    parser.add_argument("--fio-jobs", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--fio-depths", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--lookup-repeats", type=int, default=50)
    parser.add_argument("--shmem-thp", default="advise", choices=["advise", "leave"],
                        help="the kernel's shared-memory huge page setting for the run (root only; put back at the "
                        "end): advise, as docs/operations.md recommends for kvd's arena, or leave it as found. "
                        "Only kvd maps shared memory; kvd-4k shows it without huge pages")
    parser.add_argument("--result-name", default="bench_peers",
                        help="bench/results/<name>.json to write (a run of some contenders only can keep the full "
                        "run's file)")
    parser.add_argument("--dir", default=None, help="where the contenders' directories go (default: a temp dir "
                        "under the repository, on the same file system as the daemon's)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    warn_if_busy()
    root = Path(tempfile.mkdtemp(prefix="kvd-peers-", dir=args.dir or REPO_ROOT))
    out: dict[str, Any] = {"parameters": vars(args), "targets": TARGETS, "page_cache_dropped": drop_page_cache()}
    with shmem_huge_pages(args.shmem_thp) as shmem_mode:
        out["shmem_enabled"] = shmem_mode
        run_phases(args, root, out)
    write_result(args.result_name, out)


def run_phases(args, root: Path, out: dict[str, Any]) -> None:
    try:
        for shape in args.shapes:
            tokens = SHAPES[shape]
            if not args.skip_disk:
                out[f"disk {shape}"] = phase = disk_phase(args, shape, tokens, root)
                print_phase(f"disk, {tokens}-token blocks", phase)
            if not args.skip_host:
                out[f"host {shape}"] = phase = host_phase(args, shape, tokens, root, shape == args.shapes[0])
                print_phase(f"host memory, {tokens}-token blocks", phase)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
