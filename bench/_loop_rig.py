"""The rig and the timed operations of bench_loop_time.py (not a benchmark itself).

Rig: an engine with a host and a disk tier, the Mover, the durable waits
and the simulator's fake slot contents, filled as a daemon that has run a
while (Rig.fill); no I/O happens. Each operation (op_get, op_put, ...) runs
the engine calls of one request through a Stopwatch, which times them
(wall and this thread's CPU time, and wall time per call by name), and
returns it, or None when it could not run. bench_loop_time.py's docstring
says what each operation does and how they are measured.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import random
import time
import types
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from _common import progress

from kvd.core.block import NO_SLOT
from kvd.core.engine import CommitRequest, Engine, KeysRequest
from kvd.core.keys import NamespaceSpec
from kvd.core.mover import Mover, MoverSettings, WriteRound
from kvd.core.quota import TenantQuota
from kvd.sim.plane import SlotContents
from kvd.invariants import check

OPERATIONS = ("get", "put", "put_tenant", "delete", "writer_turn", "durable", "snapshot")
CLIENT = "bench-loop"
TENANT = "bench-tenant"
DELETE_TAIL_BLOCKS = 4
FILL_ROUND_BLOCKS = 4096


def _spec(model_id: str, tenant: str = "") -> NamespaceSpec:
    # Tiny blocks (1 layer, 1 head): the engine never touches payload bytes.
    return NamespaceSpec(model_id=model_id, num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=16, tenant=tenant)


class Stopwatch:
    """Time spent in the calls made through it: wall (what the loop waits), this thread's CPU
    time, and the wall time of each call by name (to see where a slow sample went)."""

    __slots__ = ("wall_ns", "cpu_ns", "parts")

    def __init__(self) -> None:
        self.wall_ns = 0
        self.cpu_ns = 0
        self.parts: dict[str, int] = {}

    def __call__(self, call: Callable, *arguments):
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return call(*arguments)
        finally:
            self.cpu_ns += time.thread_time_ns() - cpu
            spent = time.perf_counter_ns() - wall
            self.wall_ns += spent
            name = getattr(call, "__qualname__", "call")
            self.parts[name] = self.parts.get(name, 0) + spent


class Keys:
    """32-byte keys, like the chained SHA-256 keys clients send (opaque to the engine)."""

    def __init__(self) -> None:
        self.counter = 0

    def chain(self, length: int) -> list[bytes]:
        start, self.counter = self.counter, self.counter + length
        return [hashlib.blake2b(value.to_bytes(8, "little"), digest_size=32).digest()
                for value in range(start, start + length)]


@dataclass
class Waits:
    """The durable waits in flight: tokens not yet answered, and the pins of each call."""

    calls: dict[int, tuple[set[object], list]] = field(default_factory=dict)
    call_of: dict[object, int] = field(default_factory=dict)
    answered: int = 0
    failed: int = 0

    def add(self, call: int, started: dict, pins: list) -> None:
        if not started:
            for pin in pins:
                pin.release()
            return
        self.calls[call] = (set(started.values()), pins)
        self.call_of.update({token: call for token in started.values()})

    def resolve(self, outcomes) -> None:
        for token, failure in outcomes:
            self.answered += 1
            self.failed += failure is not None
            call = self.call_of.pop(token)
            tokens, pins = self.calls[call]
            tokens.discard(token)
            if not tokens:
                del self.calls[call]
                for pin in pins:
                    pin.release()


class Rig:
    """An engine holding `blocks` blocks, host and disk tiers, a mover, fake slot contents; no I/O."""

    def __init__(self, blocks: int, args: argparse.Namespace) -> None:
        spec = _spec("bench-loop")
        self.blocks = blocks
        self.args = args
        self.host_slots = max(64, int(blocks * args.host_share))
        tenant_bytes = max(4 * args.put_blocks, int(self.host_slots * args.tenant_share)) * spec.block_bytes
        self.engine = Engine(host_slot_count=self.host_slots, host_slot_bytes=spec.block_bytes,
                             disk_slot_count=blocks, disk_slot_bytes=spec.block_bytes,
                             tenant_quotas=[TenantQuota(TENANT, host_limit_bytes=tenant_bytes)])
        self.ns = self._namespace(spec)
        self.tenant_ns = self._namespace(_spec("bench-loop-tenant", TENANT))
        self.mover = Mover(self.engine, MoverSettings(write_mode="through", batch_blocks=FILL_ROUND_BLOCKS,
                                                      chunk_blocks=0))
        self.contents = SlotContents(self.engine)
        self.keys = Keys()
        self.random = random.Random(args.seed)
        self.now_ms = 0
        # Every chain Put, for Gets and Deletes to pick from; those not yet written, oldest first.
        self.chains: list[list[bytes]] = []
        self.unwritten: deque[list[bytes]] = deque()
        self.waits = Waits()
        self.backlog = 0
        self.service = None

    def _namespace(self, spec: NamespaceSpec) -> bytes:
        namespace_id = self.engine.register_namespace(spec).namespace_id
        self.engine.enable_disk(namespace_id)
        return namespace_id

    def tick(self) -> int:
        self.now_ms += 1
        return self.now_ms

    # -- the fill (untimed) ------------------------------------------------------

    def put_chain(self, namespace_id: bytes, length: int, watch: Stopwatch | None = None) -> list[bytes]:
        """Reserve + commit a new chain (timed on `watch`, if given); its keys."""
        watch = watch or Stopwatch()
        keys = self.keys.chain(length)
        reserved = watch(self.engine.reserve, KeysRequest(namespace_id, CLIENT, keys, 0, self.tick()))
        self.contents.fill(keys, reserved.slots)  # the client writes its slots
        if reserved.lease is not None:
            watch(self.engine.commit, CommitRequest(namespace_id, CLIENT, reserved.lease.lease_id, self.now_ms))
        return keys

    def drain(self) -> None:
        """Fill rounds until nothing is left to write."""
        while (round_ := self.mover.next_round()) is not None:
            self.mover.round_removals_journalled(round_, ())
            self.contents.drop(round_.removals)
            for positions in round_.chunks():
                writes = [round_.writes[position] for position in positions]
                self.mover.chunk_written(round_, positions, self.contents.write(writes))
            self.waits.resolve(self.mover.finish_round(round_))

    def fill(self) -> dict:
        """The disk full of durable chains, then the unwritten backlog and the tenant at its quota."""
        started = time.perf_counter()
        engine, args, last = self.engine, self.args, time.perf_counter()
        while self.keys.counter < self.blocks:
            keys = self.put_chain(self.ns, min(args.chain, self.blocks - self.keys.counter))
            self.chains.append(keys)
            if len(engine.write_queue) >= FILL_ROUND_BLOCKS or engine.host_reclaiming():
                self.drain()
            if time.perf_counter() - last > 10:
                last = time.perf_counter()
                progress(f"  N={self.blocks:,}: {self.keys.counter:,} blocks Put and written")
        self.drain()
        disk_seconds = time.perf_counter() - started
        # From here on the daemon's own writer settings; "through": every turn writes (see --write-mode).
        self.mover.settings = MoverSettings(write_mode=args.write_mode)
        self.mover.reclaim()
        self.backlog = int(self.host_slots * args.backlog_share)
        while len(engine.write_queue) < self.backlog:
            keys = self.put_chain(self.ns, args.chain)
            self.chains.append(keys)
            self.unwritten.append(keys)
        quota = engine.tenant_quota(TENANT)
        while quota.host_used_bytes + args.put_blocks * self.engine.host.slot_bytes <= quota.host_limit_bytes:
            self.put_chain(self.tenant_ns, args.put_blocks)
        self.mover.reclaim()
        engine.verify()
        gc.collect()
        return {"seconds": time.perf_counter() - started, "disk_fill_seconds": disk_seconds}

    def state(self) -> dict:
        engine = self.engine
        disk = engine.disk.pool
        return {
            "blocks_indexed": sum(len(state.index) for state in engine.namespaces()),
            "host_slots": self.host_slots,
            "host_resident": engine.host.pool.resident_blocks,
            "disk_slots": disk.slot_count,
            "disk_used": disk.slot_count - disk.owners.count(None),
            "write_queue": len(engine.write_queue),
            "backlog_target": self.backlog,
        }


# -- the timed operations: each returns its Stopwatch, or None when it did not run


def _journal_removals(rig: Rig, watch: Stopwatch) -> None:
    """As the disk plane after a Get's reads or a Delete: removals taken, journalled (untimed), confirmed."""
    removals = watch(rig.mover.take_removals)
    if removals:
        rig.contents.drop(removals)
        watch(rig.mover.removals_journalled, removals, ())


def _stored_chain(rig: Rig, blocks: int) -> tuple[int, list] | None:
    """A random chain with at least `blocks` blocks stored (its position, those blocks); looked up
    without side effects, untimed: every size then times the same work per request."""
    for _ in range(200):
        position = rig.random.randrange(len(rig.chains))
        stored = rig.engine.stored(rig.ns, rig.chains[position])
        if len(stored) >= blocks:
            return position, stored
    return None


def op_get(rig: Rig) -> Stopwatch | None:
    engine, watch = rig.engine, Stopwatch()
    found = _stored_chain(rig, rig.args.get_blocks)
    if found is None:
        return None
    keys = rig.chains[found[0]][:rig.args.get_blocks]
    plan = watch(engine.begin_get, KeysRequest(rig.ns, CLIENT, keys, 0, rig.tick()))
    if plan.loads:
        ok = rig.contents.load(plan.loads)  # the I/O thread's reads
        watch(engine.finish_loads, plan.loads, ok)
        _journal_removals(rig, watch)
    blocks = watch(engine.settle_get, plan)
    rig.contents.check_served(blocks)
    if plan.lease is not None:
        watch(engine.release, CLIENT, [plan.lease.lease_id])
    return watch


def op_put(rig: Rig) -> Stopwatch | None:
    watch = Stopwatch()
    keys = rig.put_chain(rig.ns, rig.args.put_blocks, watch)
    rig.chains.append(keys)
    rig.unwritten.append(keys)
    return watch


def op_put_tenant(rig: Rig) -> Stopwatch | None:
    watch = Stopwatch()
    rig.put_chain(rig.tenant_ns, rig.args.put_blocks, watch)
    return watch


def op_delete(rig: Rig) -> Stopwatch | None:
    engine, watch = rig.engine, Stopwatch()
    found = _stored_chain(rig, DELETE_TAIL_BLOCKS + 1)
    if found is None:
        return None
    position, stored = found
    deleted, _ = watch(engine.delete, rig.ns, [stored[-DELETE_TAIL_BLOCKS].key])
    if deleted:
        _journal_removals(rig, watch)
        rig.chains[position] = rig.chains[position][:len(stored) - DELETE_TAIL_BLOCKS]
    return watch


def _write_round(rig: Rig, round_: WriteRound, watch: Stopwatch) -> None:
    mover = rig.mover
    rig.contents.drop(round_.removals)  # journalled by the I/O thread
    watch(mover.round_removals_journalled, round_, ())
    for positions in watch(round_.chunks):
        ok = rig.contents.write([round_.writes[position] for position in positions])
        watch(mover.chunk_written, round_, positions, ok)
    rig.waits.resolve(watch(mover.finish_round, round_))


def op_writer_turn(rig: Rig) -> Stopwatch | None:
    """One turn of the daemon's writer (DiskPlane._writer), when the backlog is at its level."""
    mover, watch = rig.mover, Stopwatch()
    if len(rig.engine.write_queue) < rig.backlog:
        return None
    # next_round reclaims first; called apart here (the same work) to tell its time from the picks'.
    watch(mover.reclaim)
    round_ = watch(mover.next_round)
    watch(mover.backlog)
    rig.waits.resolve(watch(mover.hopeless_waits))
    if round_ is None:
        return None
    _write_round(rig, round_, watch)
    return watch


def op_durable(rig: Rig) -> Stopwatch | None:
    engine, watch = rig.engine, Stopwatch()
    if len(rig.waits.calls) >= rig.args.waiters:
        return None
    while rig.unwritten:
        blocks = engine.stored(rig.ns, rig.unwritten[0])
        if any(engine.disk_slot(block) == NO_SLOT for block in blocks):
            break
        rig.unwritten.popleft()
    else:
        return None
    started, failures, pins, _ = watch(rig.mover.durable.start, blocks, "", lambda block: object())
    rig.unwritten.popleft()
    rig.waits.failed += len(failures)
    rig.waits.add(rig.tick(), started, pins)
    return watch


def _snapshot_service(rig: Rig):
    """The daemon's EventSnapshot handler, bound to what it reads of its service."""
    from kvd.server.service import KvdService
    from kvd.v1 import kvd_pb2

    handler = KvdService.EventSnapshot.__wrapped__
    service = types.SimpleNamespace(engine=rig.engine, arena=types.SimpleNamespace(instance_id="bench-loop"))
    request = kvd_pb2.EventSnapshotRequest(namespace_id=rig.ns)
    return lambda: handler(service, request, None)


async def _consume(stream) -> None:
    """Read a server stream as gRPC does: the loop turns between two messages."""
    async for _ in stream:
        await asyncio.sleep(0)


def op_snapshot(rig: Rig) -> Stopwatch | None:
    """The longest loop step of one EventSnapshot (wall and CPU time, each its longest).

    The handler's coroutine is stepped by hand, as the loop would step it:
    a step ends at each message sent and at each bare yield to the loop
    (asyncio.sleep(0)); a handler that awaits a real future is not driven here."""
    if rig.service is None:
        rig.service = _snapshot_service(rig)
    coroutine = _consume(rig.service())
    longest = Stopwatch()
    while True:
        step = Stopwatch()
        try:
            waited = step(coroutine.send, None)
        except StopIteration:
            waited = None
            coroutine = None
        check(waited is None, "EventSnapshot awaited {!r}: step it on an event loop", waited)
        longest.wall_ns, longest.cpu_ns = max(longest.wall_ns, step.wall_ns), max(longest.cpu_ns, step.cpu_ns)
        if coroutine is None:
            longest.parts = {"KvdService.EventSnapshot (its longest step)": longest.wall_ns}
            return longest


OPERATION_CALLS: dict[str, Callable[[Rig], Stopwatch | None]] = {
    "get": op_get, "put": op_put, "put_tenant": op_put_tenant, "delete": op_delete,
    "writer_turn": op_writer_turn, "durable": op_durable, "snapshot": op_snapshot,
}
