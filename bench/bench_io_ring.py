#!/usr/bin/env python3
"""A restore through the GPU-initiated I/O ring vs the same restore submitted by the CPU.

What: `--reads` reads of `--read-kib` KiB at random aligned offsets of a
file written once (`--file-mib`), in `--layers` layers, land checksummed in
device memory. On this machine the device is the CPU one (kvd.device.cpu);
`make gpu-check`'s machine would pass `--device cuda`. Contenders,
interleaved round by round:

* cpu: what kvd does without the ring. Per layer, one kvd.io batch reads
  into staging with a crc32c per read, the checksums are compared, and one
  batched copy (Stream.copy_blocks, on the stream's own thread) moves the
  layer to its targets; two layers' batches are in the kernel at a time.
  Both contenders read into staging on transparent huge pages (measured
  here: 4 KiB-page staging made the same reads up to 3x slower).
* ring: a producer process (native/gpu/io_ring_producer.c, one thread in
  place of the GPU's) publishes every read into the ring and waits per layer;
  kvd's proxy (kvd._native.RingProxy) reads, checks, copies and completes.
  The time includes the producer process's start (about a millisecond).

Printed: GiB/s per contender (median of rounds) and ring / cpu. The point on
a CPU-only machine is the proxy's cost against kvd's own path, not a GPU
number: none is measured here. Targets are checked bit-exact after every
round.

Run: .venv/bin/python bench/bench_io_ring.py [--reads 4096] [--read-kib 64] [--layers 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_ratio, progress, ratio, report, warn_if_busy, write_result  # noqa: E402

from kvd.device import open_device  # noqa: E402
from kvd.device.io_ring import RingMemory, start_proxy  # noqa: E402
from kvd.pages import huge_page_memory  # noqa: E402
from kvd.io import Op, address_of, open_engine  # noqa: E402
from kvd.io.checksum import crc32c_of_buffers  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class Workload:
    def __init__(self, directory: Path, args: argparse.Namespace) -> None:
        self.read_bytes = args.read_kib << 10
        self.layers = args.layers
        self.count = args.reads - args.reads % args.layers
        self.path = directory / "blocks"
        data = np.random.default_rng(3).integers(0, 256, args.file_mib << 20, dtype=np.uint8)
        data.tofile(self.path)
        self.data = data
        slots = (args.file_mib << 20) // self.read_bytes
        self.offsets = np.random.default_rng(4).choice(slots, self.count, replace=False).astype(np.int64) \
            * self.read_bytes
        reads = [data[o:o + self.read_bytes] for o in self.offsets]
        self.checksums = crc32c_of_buffers(reads, self.read_bytes, 1).reshape(-1)
        self.fd = os.open(self.path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)

    def layer(self, layer: int) -> np.ndarray:
        """Read numbers of one layer (reads are dealt to layers round-robin)."""
        return np.arange(layer, self.count, self.layers)

    def check(self, landed: np.ndarray) -> None:
        view = landed.reshape(self.count, self.read_bytes)
        for i in np.random.default_rng().choice(self.count, 64, replace=False):
            offset = int(self.offsets[i])
            if not np.array_equal(view[i], self.data[offset:offset + self.read_bytes]):
                raise RuntimeError(f"read {i} landed wrong")


class CpuRestore:
    """kvd's own path: a kvd.io batch per layer into staging, crc compare, one batched copy per layer."""

    def __init__(self, device, memory, work: Workload) -> None:
        self.work, self.memory, self.device = work, memory, device
        self.engine = open_engine("uring", 64, max_batch_entries=work.count)
        self.engine.register_files([work.fd])
        per_layer = work.count // work.layers
        self.staging = [np.frombuffer(huge_page_memory(per_layer * work.read_bytes), dtype=np.uint8)
                        for _ in range(2)]
        self.staging_memory = [device.register_host(address_of(s), s.size) for s in self.staging]
        self.stream = device.stream()

    def _submit(self, layer: int):
        reads = self.work.layer(layer)
        staging = self.staging[layer % 2]
        cells = np.zeros(len(reads), dtype=np.uint32)
        address = np.uint64(address_of(staging)) + np.arange(len(reads), dtype=np.uint64) * self.work.read_bytes
        batch = self.engine.submit(Op.READ, np.zeros(len(reads), dtype=np.int32), self.work.offsets[reads],
                                   np.full(len(reads), self.work.read_bytes, dtype=np.uint32), address,
                                   checksums=cells, checksum_chunk=self.work.read_bytes)
        return batch, reads, cells

    def run(self) -> None:
        rb = self.work.read_bytes
        current = self._submit(0)
        for layer in range(self.work.layers):
            if layer + 1 < self.work.layers:
                self.stream.synchronize()  # the copy out of the staging the next layer reads into is done
                following = self._submit(layer + 1)
            batch, reads, cells = current
            results = self.engine.wait(batch)
            if not (np.all(results == rb) and np.array_equal(cells, self.work.checksums[reads])):
                raise RuntimeError("a read failed or did not match its checksum")
            self.stream.copy_blocks(self.memory, reads * rb, self.staging_memory[layer % 2],
                                    np.arange(len(reads)) * rb, rb)
            current = following
        self.stream.synchronize()

    def close(self) -> None:
        self.engine.close()
        for memory in self.staging_memory:
            self.device.unregister_host(memory)


class RingRestore:
    """The ring: a producer process publishes, kvd's proxy reads, checks, copies, completes."""

    def __init__(self, device, memory, work: Workload, directory: Path, producer: Path) -> None:
        self.work, self.directory, self.producer = work, directory, producer
        self.ring = RingMemory(1024, work.layers)
        self.proxy = start_proxy(device, self.ring, [work.fd], [memory], staging_bytes=16 << 20, batch_entries=128,
                                 queue_depth=256)
        targets = memory.address + np.arange(work.count, dtype=np.uint64) * work.read_bytes
        plan = np.stack([np.zeros(work.count, dtype=np.uint64), work.offsets.astype(np.uint64),
                         np.full(work.count, work.read_bytes, dtype=np.uint64), targets,
                         np.arange(work.count, dtype=np.uint64) % work.layers,
                         work.checksums.astype(np.uint64)], axis=1)
        order = np.argsort(plan[:, 4], kind="stable")  # layer by layer, as a model would ask
        plan[order].tofile(directory / "plan")
        self.rounds = 0

    def run(self) -> None:
        self.ring.reset()  # counters back to zero between rounds
        # The producer gets the ring's memfd over a socket (SCM_RIGHTS); its exit status is 0 only when
        # every layer's wait ended OK (a failed read or the 120 s deadline: 1).
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with ours, theirs:
            child = subprocess.Popen([str(self.producer), str(theirs.fileno()), str(self.directory / "plan"), "1",
                                      "120"], pass_fds=[theirs.fileno()], stdout=subprocess.DEVNULL)
            self.ring.send(ours)
            if child.wait() != 0:
                raise RuntimeError(f"ring reads failed or timed out (producer exit {child.returncode})")

    def close(self) -> dict:
        stats = self.proxy.stop()
        self.ring.close()
        return stats


def build_producer(directory: Path) -> Path:
    binary = directory / "io_ring_producer"
    gpu = ROOT / "native" / "gpu"
    subprocess.run(["gcc", "-std=c11", "-D_GNU_SOURCE", "-O2", "-pthread", f"-I{gpu}",
                    str(gpu / "io_ring_producer.c"), "-o", str(binary)], check=True)
    return binary


def measure(args: argparse.Namespace, directory: Path) -> dict:
    device = open_device(args.device)
    work = Workload(directory, args)
    memory = device.alloc(work.count * work.read_bytes)
    landed = np.zeros(work.count * work.read_bytes, dtype=np.uint8)
    readback = device.register_host(address_of(landed), landed.size)
    contenders = {"cpu": CpuRestore(device, memory, work),
                  "ring": RingRestore(device, memory, work, directory, build_producer(directory))}
    seconds = {name: [] for name in contenders}
    for round_number in range(args.rounds):
        names = list(contenders) if round_number % 2 == 0 else list(reversed(contenders))
        for name in names:
            started = time.perf_counter()
            contenders[name].run()
            seconds[name].append(time.perf_counter() - started)
            stream = device.stream()
            stream.copy_blocks(readback, [0], memory, [0], landed.size)
            stream.synchronize()
            work.check(landed)
        progress(f"round {round_number + 1}/{args.rounds}: " +
                 ", ".join(f"{n} {work.count * work.read_bytes / s[-1] / (1 << 30):.2f} GiB/s"
                           for n, s in seconds.items()))
    contenders["cpu"].close()
    proxy_stats = contenders["ring"].close()
    total = work.count * work.read_bytes
    rates = {name: statistics.median(total / s / (1 << 30) for s in values) for name, values in seconds.items()}
    return {"device": args.device, "reads": work.count, "read_bytes": work.read_bytes, "layers": work.layers,
            "rounds": args.rounds, "gib_s": rates, "seconds": seconds, "ring_over_cpu": ratio(rates["ring"],
                                                                                              rates["cpu"]),
            "proxy_stats": proxy_stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reads", type=int, default=4096)
    parser.add_argument("--read-kib", type=int, default=64)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--file-mib", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dir", default=str(ROOT / "build"))
    args = parser.parse_args()
    warn_if_busy()
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench-io-ring-") as directory:
        result = measure(args, Path(directory))
    report(f"restore of {result['reads']} x {result['read_bytes'] >> 10} KiB reads in {result['layers']} layers "
           f"into {result['device']} memory, median of {result['rounds']} rounds:")
    for name, rate in result["gib_s"].items():
        report(f"  {name:<5} {rate:6.2f} GiB/s")
    report(f"  ring / cpu: {fmt_ratio(result['ring_over_cpu'])}")
    write_result("bench_io_ring", result)


if __name__ == "__main__":
    main()
