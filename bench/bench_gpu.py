#!/usr/bin/env python3
"""The GPU data plane's bandwidth table (make gpu-check runs it on a machine with a GPU).

What, all in one run on one GPU:

* copies: host (pinned, registered with cudaHostRegister) to device and back, as kvd issues them
  (Stream.copy_blocks: one cudaMemcpyBatchAsync per list of `--block-kib` blocks), against
  cudaMemcpy of the same bytes as one buffer, the device's own peak;
* restore: reads of a file into device memory through the GPU-initiated I/O ring (the kernels
  publish, kvd's proxy reads, checks and copies) against the same reads submitted by the CPU
  (bench_io_ring's CpuRestore: a kvd.io batch per layer into pinned staging, then copies).

Prints ratios against those baselines and writes bench/results/bench_gpu.json. On a machine without
a GPU it says so and exits 2 without writing anything: no GPU figure is ever made up.

Run: .venv/bin/python bench/bench_gpu.py [--mib 1024] [--block-kib 64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_ratio, progress, ratio, report, write_result  # noqa: E402
from bench_io_ring import CpuRestore, Workload  # noqa: E402

from kvd.device import NoDevice, open_device  # noqa: E402
from kvd.device.cuda_ring import GpuRingProducer, LayerPlan, plan_reads  # noqa: E402
from kvd.device.io_ring import RingMemory, start_proxy  # noqa: E402
from kvd.io import address_of, aligned_empty  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def gib_s(nbytes: int, seconds: list[float]) -> float:
    return statistics.median(nbytes / s / (1 << 30) for s in seconds)


def timed(run, rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return times


def copy_table(device, args) -> dict:
    nbytes, block = args.mib << 20, args.block_kib << 10
    host = aligned_empty(nbytes)
    host[:] = 1
    pinned = device.register_host(address_of(host), nbytes)
    memory = device.alloc(nbytes)
    stream = device.stream()
    offsets = np.arange(nbytes // block) * block
    rt = device.runtime

    def batched(to_device: bool):
        def run():
            if to_device:
                stream.copy_blocks(memory, offsets, pinned, offsets, block)
            else:
                stream.copy_blocks(pinned, offsets, memory, offsets, block)
            stream.synchronize()
        return run

    def whole(kind):
        def run():
            rt.cudaMemcpy(*((memory.address, host.ctypes.data) if kind == "h2d" else (host.ctypes.data,
                                                                                     memory.address)),
                          nbytes, rt.cudaMemcpyKind.cudaMemcpyHostToDevice if kind == "h2d"
                          else rt.cudaMemcpyKind.cudaMemcpyDeviceToHost)
        return run

    rows = {}
    for kind, to_device in (("h2d", True), ("d2h", False)):
        kvd_rate = gib_s(nbytes, timed(batched(to_device), args.rounds))
        peak = gib_s(nbytes, timed(whole(kind), args.rounds))
        rows[kind] = {"kvd_gib_s": kvd_rate, "cudamemcpy_gib_s": peak, "ratio": ratio(kvd_rate, peak)}
        progress(f"{kind}: kvd {kvd_rate:.2f} GiB/s, cudaMemcpy {peak:.2f} GiB/s")
    return rows


def ring_restore(device, args, directory: Path) -> dict:
    work_args = argparse.Namespace(reads=args.reads, read_kib=args.block_kib, layers=args.layers,
                                   file_mib=args.file_mib, rounds=args.rounds, device="cuda")
    work = Workload(directory, work_args)
    target = device.alloc(work.count * work.read_bytes)
    cpu = CpuRestore(device, target, work)
    ring = RingMemory(1024, work.layers)
    proxy = start_proxy(device, ring, [work.fd], [target], staging_bytes=32 << 20, batch_entries=128,
                        queue_depth=256)
    producer = GpuRingProducer(device, args.fatbin)
    mapped = producer.map_ring(ring)
    stream = device.stream()
    per_layer = work.count // work.layers
    plans, reads = zip(*(_plan(device, stream, work, target, layer, per_layer) for layer in range(work.layers)))
    reads = np.vstack(reads)
    rounds = iter(range(1 << 30))

    def gpu_run():
        ring.reset()
        proxy.grant(reads, next(rounds) * len(reads) + 1 + np.arange(len(reads), dtype=np.uint64))
        waits = []
        for layer, plan in enumerate(plans):
            producer.submit_layer(stream, mapped, plan, layer, timeout_s=60)
            waits.append(producer.wait_layer(stream, mapped, layer, per_layer, timeout_s=60))
        stream.synchronize()
        if not all(wait.result().ok for wait in waits):
            raise RuntimeError(f"ring waits did not all end OK: {[wait.result() for wait in waits]}; "
                               f"proxy {proxy.native.stats()}")

    nbytes = work.count * work.read_bytes
    rates = {"cpu_submitted_gib_s": gib_s(nbytes, timed(cpu.run, args.rounds)),
             "gpu_ring_gib_s": gib_s(nbytes, timed(gpu_run, args.rounds))}
    rates["ring_over_cpu"] = ratio(rates["gpu_ring_gib_s"], rates["cpu_submitted_gib_s"])
    proxy.stop()
    producer.close()
    cpu.close()
    return rates


def _plan(device, stream, work: Workload, target, layer: int, per_layer: int) -> tuple[LayerPlan, np.ndarray]:
    """The layer's plan on the device, and its reads as the proxy must grant them (tags layer-major)."""
    reads = work.layer(layer)
    columns = (np.zeros(len(reads)), work.offsets[reads], np.full(len(reads), work.read_bytes),
               target.address + reads * work.read_bytes, work.checksums[reads])
    first_tag = layer * per_layer
    return (LayerPlan.upload(device, stream, *columns, first_tag=first_tag),
            plan_reads(layer, first_tag, *columns))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--block-kib", type=int, default=64)
    parser.add_argument("--reads", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--file-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fatbin", default=os.environ.get("KVD_IO_RING_FATBIN",
                                                           str(ROOT / "build/cuda/io_ring_kernel.fatbin")))
    args = parser.parse_args()
    try:
        device = open_device("cuda")
    except NoDevice as error:
        report(f"no GPU here ({error}): nothing measured, nothing written")
        sys.exit(2)
    name = device.runtime.cudaGetDeviceProperties(device.index)[1].name.decode(errors="replace")
    with tempfile.TemporaryDirectory(dir=str(ROOT / "build"), prefix="bench-gpu-") as directory:
        result = {"device": name, "copies": copy_table(device, args),
                  "restore": ring_restore(device, args, Path(directory))}
    report(f"GPU: {name}")
    for kind, row in result["copies"].items():
        report(f"  {kind}: kvd batched {row['kvd_gib_s']:.2f} GiB/s vs cudaMemcpy {row['cudamemcpy_gib_s']:.2f}: "
               f"{fmt_ratio(row['ratio'])}")
    restore = result["restore"]
    report(f"  restore: GPU ring {restore['gpu_ring_gib_s']:.2f} GiB/s vs CPU-submitted "
           f"{restore['cpu_submitted_gib_s']:.2f}: {fmt_ratio(restore['ring_over_cpu'])}")
    write_result("bench_gpu", result)


if __name__ == "__main__":
    main()
