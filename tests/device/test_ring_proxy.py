"""The I/O ring end to end without a GPU: a producer process (C, threads, the ring's own header) receives
the ring's memfd over a Unix socket (SCM_RIGHTS) and publishes reads into it; kvd's native proxy drains
them through its io_uring engine from real files opened with O_DIRECT, checks each read's crc32c, copies
it into device memory and completes it per layer. The producer waits per layer with the wait kernel's own
code, bounded: OK, FAILED or TIMEOUT. Faults: damaged bytes on disk, reads past the end, unaligned O_DIRECT
reads, unknown files, oversized reads, layers the ring has no counter for, and nobody serving the ring."""

from __future__ import annotations

import ctypes
import mmap
import os
import socket
import subprocess
from pathlib import Path

import numpy as np
import pytest
from crc32c import crc32c

from kvd._native import RingProxy
from kvd.device.io_ring import (GRANT_FAILED, GRANT_OUT, GRANT_REVOKED, GRANT_VERIFIED, RingMemory, WaitState,
                                start_proxy)
from tests.device.staging import Staging

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "native" / "gpu"
FILE_BYTES = 4 << 20
PAGE = 4096


@pytest.fixture(scope="module")
def producer(tmp_path_factory) -> Path:
    binary = tmp_path_factory.mktemp("producer") / "io_ring_producer"
    subprocess.run(["gcc", "-std=c11", "-D_GNU_SOURCE", "-O2", "-Wall", "-Wextra", "-Werror", "-pthread", f"-I{GPU}",
                    str(GPU / "io_ring_producer.c"), "-o", str(binary)], check=True, capture_output=True)
    return binary


class Disk:
    """Two real files of random bytes, opened with O_DIRECT for the proxy."""

    def __init__(self, directory: Path) -> None:
        self.paths = [directory / f"blocks-{i}" for i in range(2)]
        self.data = []
        for path in self.paths:
            data = os.urandom(FILE_BYTES)
            path.write_bytes(data)
            self.data.append(data)
        self.fds = [os.open(path, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC) for path in self.paths]

    def read(self, file: int, offset: int, length: int) -> bytes:
        return self.data[file][offset:offset + length]

    def damage(self, file: int, offset: int) -> None:
        with open(self.paths[file], "r+b") as f:
            f.seek(offset)
            f.write(bytes([self.data[file][offset] ^ 0x5A]))
            f.flush()
            os.fsync(f.fileno())

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def disk(tmp_path):
    disk = Disk(tmp_path)
    yield disk
    disk.close()


def plan_of(reads: list[tuple[int, int, int, int, int, int]]) -> np.ndarray:
    """(file, offset, length, target, layer, checksum) records, as the producer reads them."""
    return np.array(reads, dtype=np.uint64).reshape(-1, 6)


def grant_plan(proxy, plan: np.ndarray) -> None:
    """Grants every read of the plan under the tag the producer publishes it with (its row)."""
    rows = np.hstack([plan, np.arange(len(plan), dtype=np.uint64)[:, None]])
    proxy.grant(rows, np.arange(1, len(plan) + 1, dtype=np.uint64))


def run_producer(producer: Path, ring: RingMemory, plan: np.ndarray, tmp_path: Path, threads: int,
                 wait_layers: int | None = None, timeout_s: float = 60, returncode: int = 0, proxy=None) -> dict:
    """Runs the producer on `plan` (every read granted first, when a proxy is given), handing it the
    ring's descriptor over a socket; {layer: (state, done, failed)} as its waits saw them when they ended."""
    if proxy is not None:
        grant_plan(proxy, plan)
    plan_path = tmp_path / "plan"
    plan.tofile(plan_path)
    extra = [str(wait_layers)] if wait_layers is not None else []
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        child = subprocess.Popen([str(producer), str(theirs.fileno()), str(plan_path), str(threads), str(timeout_s),
                                  *extra], pass_fds=[theirs.fileno()], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True)
        ring.send(ours)
        stdout, stderr = child.communicate(timeout=timeout_s + 60)
    assert child.returncode == returncode, (child.returncode, stdout, stderr)
    waits = {}
    for line in stdout.splitlines():
        _, layer, _, state, _, done, _, failed = line.split()
        waits[int(layer)] = (WaitState(int(state)), int(done), int(failed))
    return waits


def random_reads(disk: Disk, count: int, layers: int, lengths: list[int], seed: int):
    """Reads at random aligned offsets, with the checksums of what is on disk."""
    rng = np.random.default_rng(seed)
    reads = []
    for n in range(count):
        file = int(rng.integers(2))
        length = int(rng.choice(lengths))
        offset = int(rng.integers((FILE_BYTES - length) // PAGE)) * PAGE
        reads.append((file, offset, length, n % layers, crc32c(disk.read(file, offset, length))))
    return reads


def with_targets(memory, reads, slot_bytes: int) -> np.ndarray:
    return plan_of([(f, o, n, memory.address + i * slot_bytes, layer, c)
                    for i, (f, o, n, layer, c) in enumerate(reads)])


@pytest.mark.parametrize("capacity, threads, lengths, staging_kib, batch", [
    (4, 4, [PAGE], 64, 64),                 # a ring of 4 wrapping ~500 times under 4 producers
    (64, 1, [PAGE, 4 * PAGE], 256, 16),     # mixed lengths, small batches
    (16, 8, [12 * PAGE], 128, 64),          # each half of staging fits one read: every batch carries one over
])
def test_reads_published_by_a_producer_process_land_in_device_memory_exactly(device, disk, producer, tmp_path,
                                                                              capacity, threads, lengths,
                                                                              staging_kib, batch):
    layers, count, slot = 8, 2000, max(lengths)
    reads = random_reads(disk, count, layers, lengths, seed=capacity)
    memory = device.alloc(count * slot)
    ring = RingMemory(capacity, layers)
    proxy = start_proxy(device, ring, disk.fds, [memory], staging_bytes=staging_kib << 10, batch_entries=batch)
    try:
        waits = run_producer(producer, ring, with_targets(memory, reads, slot), tmp_path, threads, proxy=proxy)
    finally:
        stats = proxy.stop()
    assert waits == {layer: (WaitState.OK, count // layers, 0) for layer in range(layers)}
    assert ring.record(0).state is WaitState.OK and ring.record(0).until == count // layers  # the producer's record
    assert stats["reads"] == count and stats["failed"] == 0 and stats["bytes"] == sum(r[2] for r in reads)
    assert stats["batches"] > 1
    staging = Staging(device, count * slot)
    landed = staging.get(device.stream(), memory, 0, count * slot)
    for i, (file, offset, length, _, _) in enumerate(reads):
        assert landed[i * slot:i * slot + length].tobytes() == disk.read(file, offset, length), f"read {i}"
    ring.close()


def test_faulty_reads_fail_in_their_layer_and_leave_their_targets_untouched(device, disk, producer, tmp_path):
    layers, slot = 4, 2 * PAGE
    good = random_reads(disk, 400, layers, [PAGE, 2 * PAGE], seed=7)
    disk.damage(1, 5 * PAGE + 100)
    bad = [
        (1, 5 * PAGE, PAGE, 0, crc32c(disk.read(1, 5 * PAGE, PAGE))),        # the bytes on disk were damaged
        (0, 3 * PAGE, PAGE, 1, crc32c(disk.read(0, 3 * PAGE, PAGE)) ^ 1),    # checksum that does not match
        (0, FILE_BYTES - PAGE, 2 * PAGE, 2, 0),                               # past the end: a short read
        (0, PAGE + 1, PAGE, 3, crc32c(disk.read(0, PAGE + 1, PAGE))),        # unaligned: O_DIRECT refuses it
        (7, 0, PAGE, 0, 0),                                                   # no such file
        (0, 0, 64 * PAGE, 1, 0),                                              # larger than half of staging
    ]
    reads = good[:100] + bad + good[100:]
    memory = device.alloc(len(reads) * slot)
    ring = RingMemory(8, layers)
    proxy = start_proxy(device, ring, disk.fds, [memory], staging_bytes=64 << 10, batch_entries=32)
    plan = with_targets(memory, reads, slot)
    plan = np.vstack([plan, plan_of([(0, 0, PAGE, memory.address, layers + 3, 0)])])  # a layer with no counter
    per_layer = {layer: sum(1 for r in reads if r[3] == layer) for layer in range(layers)}
    failed_per_layer = {layer: sum(1 for r in bad if r[3] == layer) for layer in range(layers)}
    try:
        waits = run_producer(producer, ring, plan, tmp_path, threads=3, returncode=1, proxy=proxy)
        # every layer had a bad read: its wait ended FAILED, maybe before the rest of the layer was done
        assert {layer: wait[0] for layer, wait in waits.items()} == dict.fromkeys(range(layers), WaitState.FAILED)
        settled = [ring.settle(layer, per_layer[layer], timeout_s=60) for layer in range(layers)]
    finally:
        stats = proxy.stop()
    assert [(r.state, r.done, r.failed) for r in settled] == [(WaitState.OK, per_layer[layer], failed_per_layer[layer])
                                                               for layer in range(layers)]
    assert stats["failed"] == len(bad) and stats["checksum_mismatches"] == 2 and stats["rejected"] == 2
    assert stats["dropped"] == 1 and stats["reads"] == len(reads)
    landed = Staging(device, len(reads) * slot).get(device.stream(), memory, 0, len(reads) * slot)
    for i, (file, offset, length, _, _) in enumerate(reads):
        length = min(length, slot)
        want = bytes(length) if reads[i] in bad else disk.read(file, offset, length)
        assert landed[i * slot:i * slot + length].tobytes() == want, f"read {i}"
    ring.close()


def test_a_producer_cannot_steer_reads_outside_the_target_regions_or_the_ring(device, disk, producer, tmp_path):
    """The ring is shared with its producers, so nothing in it is trusted: reads aimed outside the
    regions the proxy was started with (another allocation of this process, or running past the end
    of the region) fail without touching anything, and a layer count rewritten in the header after
    the start changes nothing the proxy does."""
    layers = 2
    memory, elsewhere = device.alloc(4 * PAGE), device.alloc(4 * PAGE)
    good = (0, 0, PAGE, memory.address, 0, crc32c(disk.read(0, 0, PAGE)))
    aimed_elsewhere = (0, 0, PAGE, elsewhere.address, 1, crc32c(disk.read(0, 0, PAGE)))
    past_the_end = (0, 0, 2 * PAGE, memory.address + 3 * PAGE, 1, crc32c(disk.read(0, 0, 2 * PAGE)))
    ring = RingMemory(8, layers)
    proxy = start_proxy(device, ring, disk.fds, [memory], staging_bytes=64 << 10)
    header = np.frombuffer(ring.buffer, dtype=np.uint64, count=3)
    header[2] = 200  # the layer count, rewritten by a producer after the proxy started
    unknown_layer = (0, 0, PAGE, memory.address + PAGE, 150, crc32c(disk.read(0, 0, PAGE)))
    plan = plan_of([good, aimed_elsewhere, past_the_end, unknown_layer])
    try:
        run_producer(producer, ring, plan, tmp_path, threads=1, wait_layers=layers, returncode=1,
                     proxy=proxy)  # layer 1: FAILED
        assert ring.settle(1, 2, timeout_s=60).state is WaitState.OK
    finally:
        stats = proxy.stop()
    assert (ring.done(0), ring.failed(0), ring.done(1), ring.failed(1)) == (1, 0, 2, 2)
    assert ring.done(150) == 0 and stats["dropped"] == 1  # layer 150 is past the layers the proxy checked
    assert stats["rejected"] == 2
    staging = Staging(device, 4 * PAGE)
    assert staging.get(device.stream(), memory, 0, PAGE).tobytes() == disk.read(0, 0, PAGE)
    assert not staging.get(device.stream(), memory, PAGE, 3 * PAGE).any()
    assert not staging.get(device.stream(), elsewhere, 0, 4 * PAGE).any()
    del header
    ring.close()


def test_a_ring_or_staging_the_proxy_cannot_use_is_refused_precisely(device, disk):
    ring = RingMemory(8, 2)
    ring.buffer[0:8] = (99).to_bytes(8, "little")
    memory = device.alloc(1 << 16)
    with pytest.raises(ValueError, match="not a kvd_io_ring"):
        start_proxy(device, ring, disk.fds, [memory])
    ring.close()
    ring = RingMemory(8, 2)
    with pytest.raises(ValueError, match="batch_entries must be"):
        start_proxy(device, ring, disk.fds, [memory], batch_entries=0)
    with pytest.raises(ValueError, match="targets 1.."):
        start_proxy(device, ring, disk.fds, [])
    with pytest.raises(ValueError, match="capacity must be a power of two"):
        RingMemory(6, 2)
    proxy = start_proxy(device, ring, disk.fds, [memory])
    assert proxy.native.running
    proxy.stop()
    proxy.stop()
    assert not proxy.native.running and proxy.native.stats()["reads"] == 0
    ring.close()


def test_a_layer_wait_ends_ok_or_failed_as_its_reads_do(device, disk, producer, tmp_path):
    """The wait kernel's wait on the host (RingMemory.wait, the same C code): OK once the layer's reads
    are done, FAILED as soon as one of them did not match its checksum; failures the caller already
    knew of (failed_before) do not end a wait again."""
    layers = 2
    good = random_reads(disk, 40, layers, [PAGE], seed=11)
    bad_checksum = (0, 3 * PAGE, PAGE, 1, crc32c(disk.read(0, 3 * PAGE, PAGE)) ^ 1)
    reads = good + [bad_checksum]
    memory = device.alloc(len(reads) * PAGE)
    ring = RingMemory(16, layers)
    proxy = start_proxy(device, ring, disk.fds, [memory], staging_bytes=64 << 10)
    try:
        waits = run_producer(producer, ring, with_targets(memory, reads, PAGE), tmp_path, threads=2, returncode=1,
                             proxy=proxy)
        assert waits[0] == (WaitState.OK, 20, 0)
        assert waits[1][0] is WaitState.FAILED and waits[1][2] == 1
        ok, failed = (ring.wait(layer, 20 + layer, timeout_s=60, slot=layer) for layer in range(layers))
        known = ring.wait(1, 21, failed_before=1, timeout_s=60, slot=2)
    finally:
        stats = proxy.stop()
    assert (ok.state, ok.layer, ok.until, ok.done, ok.failed) == (WaitState.OK, 0, 20, 20, 0)
    assert (failed.state, failed.failed) == (WaitState.FAILED, 1) and failed.ok is False
    assert (known.state, known.done, known.failed) == (WaitState.OK, 21, 1)
    assert stats["checksum_mismatches"] == 1 and ring.record(1) == failed


def test_the_proxy_reads_only_what_was_granted_once_each_and_says_how_each_grant_ended(device, disk):
    """Grants: a read published without one, or differing from its grant in any field, fails without
    I/O and leaves the grant armed; a grant is read once (a replay fails); settle() tells a verified
    read from a failed one, and revoking disarms a grant no read took. Published from this process
    with RingMemory.publish (the host producer: the submit kernel's reserve and publish)."""
    layers = 2
    memory = device.alloc(8 * PAGE)
    ring = RingMemory(16, layers)
    proxy = start_proxy(device, ring, disk.fds, [memory], staging_bytes=64 << 10)

    def read(tag, file, offset, target, layer, damage=0):
        return (file, offset, PAGE, memory.address + target * PAGE, layer, crc32c(disk.read(file, offset, PAGE)) ^ damage,
                tag)
    granted = np.array([read(10, 0, 0, 0, 0), read(11, 1, 8 * PAGE, 1, 0), read(12, 0, PAGE, 2, 1, damage=1),
                        read(13, 1, 0, 3, 1)], dtype=np.uint64)
    stamps = np.array([101, 102, 103, 104], dtype=np.uint64)
    proxy.grant(granted, stamps)
    forged = np.array([read(20, 0, 2 * PAGE, 4, 0),       # no grant 20
                       read(13, 1, PAGE, 3, 1)],           # grant 13's tag, another offset
                      dtype=np.uint64)
    try:
        assert ring.publish(forged, timeout_s=10) == 2
        assert ring.settle(0, 1, timeout_s=60).ok and ring.settle(1, 1, timeout_s=60).ok
        assert (ring.failed(0), ring.failed(1)) == (1, 1)
        assert ring.publish(granted[:3], timeout_s=10) == 3
        assert ring.publish(granted[:1], timeout_s=10) == 1    # a replay of grant 10
        assert ring.settle(0, 4, timeout_s=60).ok and ring.settle(1, 2, timeout_s=60).ok
        states = proxy.settle(granted[:, 6], stamps, revoke=False)
        assert states.tolist() == [GRANT_VERIFIED, GRANT_VERIFIED, GRANT_FAILED, GRANT_OUT]
        assert proxy.settle(granted[:, 6], stamps, revoke=True)[3] == GRANT_REVOKED
        assert ring.publish(granted[3:], timeout_s=10) == 1    # grant 13, revoked
        assert ring.settle(1, 3, timeout_s=60).ok and ring.failed(1) == 3
        proxy.grant(granted[:1], stamps[:1] + 10)  # grant 10 was read: its tag may be armed again
        with pytest.raises(ValueError, match="grant 10: armed already"):
            proxy.grant(granted[:1], stamps[:1] + 20)
    finally:
        stats = proxy.stop()
    assert stats["rejected"] == 4 and stats["ungranted"] == 4 and stats["checksum_mismatches"] == 1
    landed = Staging(device, 8 * PAGE).get(device.stream(), memory, 0, 8 * PAGE)
    assert landed[:PAGE].tobytes() == disk.read(0, 0, PAGE)
    assert landed[PAGE:2 * PAGE].tobytes() == disk.read(1, 8 * PAGE, PAGE)
    assert not landed[2 * PAGE:].any()  # the damaged read, the revoked grant and every forgery: nothing
    ring.close()


def test_a_split_page_lands_as_its_two_halves(device, disk):
    """Pages kept as a K half and a V half apart (vLLM's layout): one read of a layer is checked whole
    and copied as two parts, the second split_to bytes after the first; a read whose second part
    would land outside the target regions fails without I/O."""
    half, v_offset = 2 * PAGE, 16 * PAGE
    memory = device.alloc(32 * PAGE)
    ring = RingMemory(8, 1)
    proxy = start_proxy(device, ring, disk.fds, [memory], staging_bytes=64 << 10, split=(half, v_offset))
    whole = disk.read(0, 4 * PAGE, 2 * half)
    reads = np.array([(0, 4 * PAGE, 2 * half, memory.address + PAGE, 0, crc32c(whole), 0),
                      (0, 4 * PAGE, 2 * half, memory.address + 20 * PAGE, 0, crc32c(whole), 1)], dtype=np.uint64)
    proxy.grant(reads, np.array([1, 2], dtype=np.uint64))
    try:
        ring.publish(reads, timeout_s=10)
        assert ring.settle(0, 2, timeout_s=60).ok
    finally:
        stats = proxy.stop()
    assert ring.failed(0) == 1 and stats["rejected"] == 1 and stats["ungranted"] == 0
    want = bytearray(32 * PAGE)
    want[PAGE:PAGE + half] = whole[:half]
    want[PAGE + v_offset:PAGE + v_offset + half] = whole[half:]
    assert Staging(device, 32 * PAGE).get(device.stream(), memory, 0, 32 * PAGE).tobytes() == bytes(want)
    ring.close()


def test_a_layer_wait_times_out_when_nobody_serves_the_ring(producer, tmp_path):
    """No proxy: a wait ends TIMEOUT at its deadline (not before), reads that fit the ring are published
    and wait there, and reads that do not fit are abandoned by their producer at its deadline, which
    ends their layer's wait FAILED at once: nothing waits forever. A layer past the ring's: INVALID."""
    ring = RingMemory(4, 2)
    # one producer thread, in order: layer 1's 3 reads and 1 of layer 0's fill the ring; 4 are left over
    plan = plan_of([(0, n * PAGE, PAGE, 0, 1, 0) for n in range(3)] + [(0, 0, PAGE, 0, 0, 0)] * 5)
    waits = run_producer(producer, ring, plan, tmp_path, threads=1, timeout_s=0.2, returncode=1)
    assert waits == {0: (WaitState.FAILED, 4, 4), 1: (WaitState.TIMEOUT, 0, 0)}
    assert (ring.abandoned(0), ring.abandoned(1), ring.done(0), ring.done(1)) == (4, 0, 0, 0)
    result = ring.wait(1, 3, timeout_s=0.05)
    assert result.state is WaitState.TIMEOUT and result.waited_ns >= 50_000_000 and result.done == 0
    assert ring.wait(0, 5, timeout_s=0).state is WaitState.FAILED
    assert ring.wait(2, 1, timeout_s=0).state is WaitState.INVALID
    assert ring.wait(1, 0, timeout_s=0).state is WaitState.OK  # nothing asked, nothing to wait for
    ring.close()


def test_the_ring_is_anonymous_memory_shared_by_descriptor():
    """The ring is a memfd (no path names it); the process it is sent to maps the same memory."""
    ring = RingMemory(8, 3)
    assert os.readlink(f"/proc/self/fd/{ring.fd}").startswith("/memfd:kvd-io-ring")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        ring.send(ours)
        mapped = RingMemory.receive(theirs)
    assert (mapped.capacity, mapped.layers) == (8, 3)
    mapped.arm(5)
    ring.wait(2, 0, timeout_s=0, slot=5)
    assert mapped.record(5).state is WaitState.OK and mapped.record(5).layer == 2
    with pytest.raises(ValueError, match="slot must be below 512"):
        ring.wait(0, 0, timeout_s=0, slot=512)
    with pytest.raises(ValueError, match="wait slot 512"):
        ring.arm(512)
    mapped.close()
    ring.close()
    with pytest.raises(ValueError, match="not a kvd_io_ring"):
        fd = os.memfd_create("not-a-ring", os.MFD_CLOEXEC)
        os.ftruncate(fd, 1 << 16)
        try:
            RingMemory.from_fd(fd)
        finally:
            os.close(fd)


def test_the_cuda_copy_hook_opens_only_where_a_driver_and_device_are(disk):
    ring = RingMemory(8, 2)
    fds = np.asarray(disk.fds, dtype=np.int32)
    if CUDA_DEVICES == 0:
        with pytest.raises(OSError, match="CUDA device 0: no driver"):
            RingProxy(ring.buffer, fds, mmap.mmap(-1, 1 << 16), TARGETS, device=0)
    else:
        RingProxy(ring.buffer, fds, mmap.mmap(-1, 1 << 16), TARGETS, device=0).stop()
    with pytest.raises(OSError, match=f"CUDA device {CUDA_DEVICES}: no driver"):
        RingProxy(ring.buffer, fds, mmap.mmap(-1, 1 << 16), TARGETS, device=CUDA_DEVICES)
    ring.close()


def _cuda_devices() -> int:
    """GPUs the driver reports (0 without a driver), asked through ctypes, independently of kvd."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


CUDA_DEVICES = _cuda_devices()
TARGETS = np.array([1 << 40, 1 << 20], dtype=np.uint64)  # one region; nothing is read in these tests
