"""The deterministic simulator: the real engine, driven by a trace in simulated time.

One `Simulator` runs one configuration (policy, host and disk capacity)
over one trace. Time is an integer count of microseconds that only the
event queue moves; the engine sees it as the injected `ManualClock`. No
thread, no wall clock, no unseeded randomness: a seed and a configuration
give the same run, event for event, on every machine.

A request goes through the engine as a client of the daemon would:

    arrival        lookup the prompt's keys (records each block's tier),
                   begin_get: pin the stored prefix, plan its disk loads
    reads done     finish_loads, settle_get: the servable prefix, checked
                   against the fake bytes; then reserve the rest (Put)
    prefill done   write the reserved slots, commit, release the Get lease
    decode done    Put the reply's blocks (reserve + commit at once)

A client that crashes (the trace says which) stops after its reserve and
holds its leases until they expire. On request, some Puts wait to be
acknowledged durable, some prompts are prefetched before their Get, some
replies are Deleted, and tenants have host quotas.

When bytes move (write-back rounds, removals journalled first, starved
Gets, durable waits, prefetch jobs) is not decided here: the simulator
drives the daemon's own mover (kvd.core.mover) and only models how long
each of its jobs takes on the drive (kvd.sim.disk).

With `middle_blocks`, a third tier sits between host memory and the disk:
a volatile memory tier on a device of its own (kvd.sim.disk.MEMORY_SPEC),
written back and read from through the same mover and engine as the disk.

A step is one event. After every `verify_every`th step (1: every step, the
default here; the command line's is 16) and after the last, the engine's
own verify() runs, and so do the simulator's invariants (`check_invariants`).
Any failure is raised as SimFailure, which names the seed and the step.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from kvd.clock import ManualClock
from kvd.config import DiskSettings, HostConfig, LeaseConfig
from kvd.core.block import NO_SLOT, BlockState
from kvd.core.engine import Engine, EngineLimits, ReserveStatus, StorageSpec, TierId, Transfer
from kvd.core.get_life import GetLife, GetPhase
from kvd.core.reads import GetCut, LoadOutcome
from kvd.core.durable import NotDurable
from kvd.core.mover import WRITE_MODES, Mover, MoverSettings, WriteRound
from kvd.core.quota import QuotaExceeded, TenantQuota
from kvd.core.io_schedule import IoSchedule
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.policy import DiskPolicies
from kvd.errors import ResourceExhausted
from kvd.invariants import check
from kvd.core.tier import StorageTier
from kvd.sim.disk import MEMORY_SPEC, READ_KINDS, DiskOp, DiskOpKind, DiskSpec, ModelledDisk
from kvd.sim.plane import SlotContents
from kvd.sim.traces import Request, TraceConfig, TraceGenerator
from kvd.core.requests import CommitRequest, KeysRequest

_DISK_DEFAULTS = DiskSettings()
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
    write_mode: str = _DISK_DEFAULTS.write_mode
    # Host watermarks (fractions of host_blocks): reclaim from high to low.
    high_watermark: float = _HOST_DEFAULTS.high_watermark
    low_watermark: float = _HOST_DEFAULTS.low_watermark
    # Smaller than the daemon's default: the simulated host tiers are small.
    write_batch_blocks: int = 16
    io_schedule: str = _DISK_DEFAULTS.io_schedule
    write_chunk_blocks: int = _DISK_DEFAULTS.write_chunk_blocks
    write_share: int = _DISK_DEFAULTS.write_share
    write_backlog_blocks: int = _DISK_DEFAULTS.write_backlog_blocks
    # Write a block to disk only once it was seen this many times.
    admission_min_hits: int = _DISK_DEFAULTS.admission_min_hits
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


@dataclass(slots=True)
class RunStats:
    """What one run measured. Blocks count a prompt's full blocks; tokens
    count every prompt token, so the uncacheable tail is a miss."""

    block_tokens: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    prompt_blocks: int = 0
    host_hit_blocks: int = 0
    middle_hit_blocks: int = 0
    disk_hit_blocks: int = 0
    miss_blocks: int = 0
    # Gets cut short: no host slot to load into, a load failed, or a lease
    # table with no room.
    get_starved: int = 0
    # ... of which cut at a block that failed its checksum (told to the client as corrupt).
    get_cut_corrupt: int = 0
    get_refused: int = 0
    lost_blocks: int = 0
    # Puts: blocks reserved, being written by another request, without room.
    put_reserved: int = 0
    put_in_flight: int = 0
    put_no_space: int = 0
    put_refused: int = 0
    clients_crashed: int = 0
    # Puts that asked for durability: acknowledged durable, refused (with
    # why), and the longest wait for an acknowledgement.
    durable_acked: int = 0
    durable_failed: int = 0
    durable_wait_max_us: int = 0
    # Blocks Deleted, and Deletes refused because a block was pinned.
    deleted_blocks: int = 0
    deletes_pinned: int = 0
    # Puts refused for their tenant's host quota (also in put_refused).
    quota_refused: int = 0
    # Blocks prefetches read, and of those a Get used or that left first.
    prefetched_blocks: int = 0
    prefetch_used: int = 0
    prefetch_wasted: int = 0
    leases_expired: int = 0
    steps: int = 0
    simulated_us: int = 0
    ttft_mean_ms: float = 0.0
    ttft_p99_ms: float = 0.0
    host_evictions: int = 0
    host_demotions: int = 0
    disk_evictions: int = 0
    disk_written_blocks: int = 0
    disk_loaded_blocks: int = 0
    disk_read_bytes: int = 0
    disk_write_bytes: int = 0
    disk_busy_share: float = 0.0
    read_wait_mean_us: float = 0.0
    middle_evictions: int = 0
    middle_written_blocks: int = 0
    middle_loaded_blocks: int = 0

    def share(self, part: str, weight: str) -> float:
        """Share of the prompts' `weight` ("tokens" or "blocks") that was `part`
        ("host", "middle", "disk" or "miss")."""
        blocks = {"host": self.host_hit_blocks, "middle": self.middle_hit_blocks, "disk": self.disk_hit_blocks,
                  "miss": self.miss_blocks}[part]
        if weight == "blocks":
            return blocks / self.prompt_blocks if self.prompt_blocks else 0.0
        if not self.prompt_tokens:
            return 0.0
        if part == "miss":
            hit_blocks = self.host_hit_blocks + self.middle_hit_blocks + self.disk_hit_blocks
            return (self.prompt_tokens - hit_blocks * self.block_tokens) / self.prompt_tokens
        return blocks * self.block_tokens / self.prompt_tokens


@dataclass(slots=True)
class RunResult:
    config: SimConfig
    stats: RunStats

    def to_dict(self) -> dict:
        stats = asdict(self.stats)
        for weight in ("tokens", "blocks"):
            for part in ("host", "middle", "disk", "miss"):
                stats[f"{part}_share_{weight}"] = self.stats.share(part, weight)
        config = self.config
        return {
            "policy": config.policy,
            "host_blocks": config.host_blocks,
            "host_bytes": config.host_blocks * config.block_bytes,
            "disk_blocks": config.disk_blocks,
            "disk_bytes": config.disk_blocks * config.block_bytes,
            "middle_blocks": config.middle_blocks,
            "stats": stats,
        }


class SimFailure(Exception):
    """An invariant broke (or the engine raised) at a given step of a seeded run."""

    def __init__(self, config: SimConfig, step: int, event: str, cause: BaseException) -> None:
        super().__init__(f"seed {config.seed}, step {step} ({event}): {type(cause).__name__}: {cause}")
        self.config = config
        self.step = step
        self.event = event
        self.cause = cause


@dataclass(slots=True, eq=False)
class WriteBatch:
    """The mover's write round in flight on the modelled drive: its chunks, one job each."""

    round: WriteRound
    chunks: list[list[int]] = field(default_factory=list)
    next_chunk: int = 0


class EventKind(enum.IntEnum):
    ARRIVAL = 1
    DISK_DONE = 2
    PREFILL_DONE = 3
    DECODE_DONE = 4
    STARVED_TIMEOUT = 5
    DURABLE_TIMEOUT = 6
    GET = 7


@dataclass(slots=True, eq=False)
class Flow:
    """One request on its way through the engine."""

    request: Request
    namespace: int
    keys: list[bytes]
    client_id: str
    tiers: list[TierId] = field(default_factory=list)
    # Its Get (kvd.core.get_life), and the blocks it waits for others to read.
    life: GetLife | None = None
    waits: set = field(default_factory=set)
    # The read operations this request waits for (its own, another Get's, a prefetch's).
    wait_ops: set = field(default_factory=set)
    # Until when a starved Get may wait for write-back to make room.
    starved_deadline_us: int = 0
    waiting_write_back: bool = False
    hit_blocks: int = 0
    read_lease: int = 0
    write_lease: int = 0
    # (host slot, key) of each reserved block.
    reserved: list[tuple[int, bytes]] = field(default_factory=list)
    # A durable Put: the blocks it still waits for, the pins that hold
    # them meanwhile, why some are not durable, and when it began.
    durable: bool = False
    durable_pending: set = field(default_factory=set)
    durable_pins: list = field(default_factory=list)
    durable_failures: list = field(default_factory=list)
    durable_since_us: int = -1


class Simulator:
    def __init__(self, config: SimConfig, *, progress: Callable[[int, int], None] | None = None) -> None:
        config.validate()
        self.config = config
        self.progress = progress
        self.clock = ManualClock(0)
        self.now_us = 0
        block_bytes = config.block_bytes
        self.engine = Engine(
            host_slot_count=config.host_blocks,
            host_slot_bytes=block_bytes,
            policy=config.policy,
            limits=EngineLimits(lease_ms_default=config.lease_ms, lease_ms_max=max(config.lease_ms, 600_000)),
            disk_slot_count=config.disk_blocks,
            disk_slot_bytes=block_bytes,
            disk_policies=DiskPolicies(admission_min_hits=config.admission_min_hits),
            high_watermark=config.high_watermark,
            low_watermark=config.low_watermark,
            tenant_quotas=config.tenant_quotas(),
            lower_tiers=config.middle_tier(),
        )
        self.specs = [config.namespace_spec(tenant) for tenant in range(config.trace.tenants)]
        self.namespace_ids = [self.engine.register_namespace(spec).namespace_id for spec in self.specs]
        self.disk: ModelledDisk | None = None
        # One modelled device per tier below host memory, the disk's last.
        self.devices: dict[StorageTier, ModelledDisk] = {}
        if config.disk_blocks:
            ids = itertools.count(1)
            for tier in self.engine.lower_tiers:
                schedule = IoSchedule(config.io_schedule, write_share=config.write_share,
                                      backlog_limit=config.write_backlog_blocks)
                spec = config.disk if tier is self.engine.disk else config.middle
                self.devices[tier] = ModelledDisk(spec, schedule, ids)
            self.disk = self.devices[self.engine.disk]
            for namespace_id in self.namespace_ids:
                self.engine.enable_disk(namespace_id)
            # The daemon's rules for when bytes move (kvd.core.mover).
            self.mover = Mover(self.engine, MoverSettings(
                write_mode=config.write_mode, batch_blocks=config.write_batch_blocks,
                chunk_blocks=0 if config.io_schedule == "fifo" else config.write_chunk_blocks,
                prefetch_max_blocks=_DISK_DEFAULTS.prefetch_max_blocks,
                prefetch_chunk_blocks=_DISK_DEFAULTS.prefetch_chunk_blocks))
        self.contents = SlotContents(self.engine)
        # Faults and durability are drawn apart from the trace, which every policy shares.
        self.faults = random.Random(config.seed)
        self.durability = random.Random(config.seed + 1)
        self.deletions = random.Random(config.seed + 2)
        self.prefetches = random.Random(config.seed + 3)
        self.durable_flows: set[Flow] = set()
        self.unsettled: set[Flow] = set()  # Gets planned, not settled: each holds its own pins
        self.trace = iter(TraceGenerator(config.seed, config.trace))
        self.events: list[tuple[int, int, EventKind, object]] = []
        self._sequence = 0
        self.step = 0
        self.arrivals = 0
        # What the simulator expects of the engine, to compare after each step:
        # open lease id -> deadline, hit counters per namespace, keys loading
        # -> the read operation loading them, write-back in flight.
        self.leases: dict[int, int] = {}
        self.expected_counters = [[0, 0, 0, 0] for _ in self.specs]
        self.loading: dict[bytes, int] = {}
        # Read operation id -> the Gets waiting for it; prefetch reads in flight.
        self.read_waiters: dict[int, list[Flow]] = {}
        self.prefetch_reads: dict[int, DiskOp] = {}
        self.get_reads: dict[int, DiskOp] = {}
        # The mover's write round in flight to each tier below host memory.
        self.batches: dict[StorageTier, WriteBatch] = {}
        # Gets starved of host slots, waiting for a write-back batch.
        self.starved: list[Flow] = []
        self.ttft_us: list[int] = []
        self.stats = RunStats(block_tokens=config.block_tokens)

    # ------------------------------------------------------------------
    # The event loop

    def run(self) -> RunResult:
        self._schedule_next_arrival()
        while self.events:
            time_us, _, kind, payload = heapq.heappop(self.events)
            self._run_step(kind.name.lower(), lambda: self._handle(time_us, kind, payload))
        self._run_step("final expiry", self._finish)
        return RunResult(self.config, self._summary())

    def _run_step(self, event: str, action: Callable[[], None]) -> None:
        self.step += 1
        try:
            action()
            if self.step % self.config.verify_every == 0 or event == "final expiry":
                self.check_invariants()
        except Exception as error:
            # Deliberately broad: whatever broke, a simulator's report must
            # name the seed and the step that reproduce it. Nothing is
            # swallowed: the run ends here.
            raise SimFailure(self.config, self.step, event, error) from error

    def _handle(self, time_us: int, kind: EventKind, payload: object) -> None:
        self._advance(time_us)
        if kind == EventKind.ARRIVAL:
            self._arrive(payload)
            self._schedule_next_arrival()
        elif kind == EventKind.DISK_DONE:
            self._disk_done(payload)
        elif kind == EventKind.PREFILL_DONE:
            self._prefill_done(payload)
        elif kind == EventKind.DECODE_DONE:
            self._decode_done(payload)
        elif kind == EventKind.DURABLE_TIMEOUT:
            self._durable_timeout(payload)
        elif kind == EventKind.GET:
            self._begin_get(payload, final=False)
        elif payload.waiting_write_back:
            # Waited long enough: one last try, served with what it gets.
            self.starved.remove(payload)
            payload.waiting_write_back = False
            self._begin_get(payload, final=True)
        self._pump_devices()

    def _schedule(self, time_us: int, kind: EventKind, payload: object) -> None:
        check(time_us >= self.now_us, "an event scheduled in the past")
        # The sequence number breaks ties: events at one instant run in the
        # order they were scheduled.
        heapq.heappush(self.events, (time_us, self._sequence, kind, payload))
        self._sequence += 1

    def _schedule_next_arrival(self) -> None:
        if self.arrivals < self.config.requests:
            request = next(self.trace)
            self._schedule(max(request.arrival_us, self.now_us), EventKind.ARRIVAL, request)
            self.arrivals += 1
            if self.progress is not None:
                self.progress(self.arrivals, self.config.requests)

    def _advance(self, time_us: int) -> None:
        check(time_us >= self.now_us, "simulated time went back")
        self.now_us = time_us
        self.clock.advance(time_us // 1000 - self.clock.now_ms())
        now_ms = self.clock.now_ms()
        due = [lease_id for lease_id, deadline_ms in self.leases.items() if deadline_ms <= now_ms]
        expired = self.engine.expire(now_ms)
        check(expired == len(due), f"{expired} leases expired at {now_ms} ms, expected {len(due)}")
        for lease_id in due:
            del self.leases[lease_id]
        self.stats.leases_expired += expired

    # ------------------------------------------------------------------
    # A request

    def _arrive(self, request: Request) -> None:
        engine = self.engine
        namespace_id = self.namespace_ids[request.tenant]
        keys = chain_keys(self.specs[request.tenant], request.prompt)
        flow = Flow(request, request.tenant, keys, f"client-{request.request_id}")
        flow.durable = self.disk is not None and self.durability.random() < self.config.durable_share
        flow.starved_deadline_us = self.now_us + self.config.starved_get_wait_ms * 1000
        counters = self.expected_counters[request.tenant]
        matched = engine.lookup(namespace_id, keys)
        counters[0] += len(matched)
        counters[1] += len(keys) - len(matched)
        if self.disk is not None and self.prefetches.random() < self.config.prefetch_share:
            self._prefetch(flow)
            self._schedule(self.now_us + self.config.prefetch_lead_ms * 1000, EventKind.GET, flow)
        else:
            self._begin_get(flow, final=False)

    def _prefetch(self, flow: Flow) -> None:
        """A router's Prefetch, planned by the mover: PREFETCH read jobs behind restores."""
        plan, jobs = self.mover.prefetch(self.namespace_ids[flow.namespace], flow.keys)
        self.stats.prefetched_blocks += len(plan.loads)
        for job in jobs:
            for operation in self._submit_reads(DiskOpKind.PREFETCH, job):
                self.prefetch_reads[operation.op_id] = operation

    def _submit_reads(self, kind: DiskOpKind, loads: list[Transfer]) -> list[DiskOp]:
        """One read operation per device the loads come from."""
        by_source: dict[StorageTier, list[Transfer]] = {}
        for load in loads:
            by_source.setdefault(load.source, []).append(load)
        operations = []
        for source, group in by_source.items():
            device = self.devices[source]
            operation = device.op(kind, sum(load.block.index.block_bytes for load in group), self.now_us)
            operation.loads = group
            device.submit(operation)
            operations.append(operation)
            for load in group:
                self.loading[load.block.key] = operation.op_id
        return operations

    def _begin_get(self, flow: Flow, *, final: bool) -> None:
        """The Get planned, as the daemon's is (kvd.core.get_life): a plan starved of host slots
        by blocks waiting for write-back waits for the next write round, until
        `starved_get_wait_ms` has passed; then it takes what it can."""
        engine = self.engine
        namespace_id = self.namespace_ids[flow.namespace]
        keys = flow.keys
        # What a lookup would see now, without its side effects.
        matched = engine.namespace(namespace_id).index.match(keys)
        flow.tiers = [engine.tier_of(block) for block in matched]
        if flow.life is None:
            flow.life = GetLife(engine, self.mover if self.disk is not None else None, flow.starved_deadline_us)
        life = flow.life
        try:
            phase = life.begin(KeysRequest(namespace_id, flow.client_id, keys, self.config.lease_ms,
                                           self.clock.now_ms()), self.now_us, final=final)
        except ResourceExhausted:
            life.cancel()
            self.stats.get_refused += 1
            self._settle(flow)
            return
        if phase is GetPhase.WAITING_FOR_ROOM:  # what it took and counted is given back
            flow.waiting_write_back = True
            self.starved.append(flow)
            self._schedule(flow.starved_deadline_us, EventKind.STARVED_TIMEOUT, flow)
            return
        counters = self.expected_counters[flow.namespace]
        counters[2] += len(matched)
        counters[3] += len(keys) - len(matched)
        plan = life.plan
        # begin_get sees the index as it is at this instant, cut at most (no
        # host slot for a disk block, or a block the policy keeps on disk).
        check([block.key for block in plan.matched] == [block.key for block in matched[: len(plan.matched)]],
              "begin_get matched another prefix than the index holds")
        self.unsettled.add(flow)
        if plan.lease is not None:
            self.leases[plan.lease.lease_id] = plan.lease.deadline_ms
            flow.read_lease = plan.lease.lease_id
        for operation in self._submit_reads(DiskOpKind.READ, plan.loads):
            operation.reader = life
            self.get_reads[operation.op_id] = operation
            flow.wait_ops.add(operation.op_id)
        flow.waits = set(plan.waits)
        waited = {self.loading[block.key] for block in plan.waits}
        # A Get now waits for these prefetch reads: restores from here on (as the daemon promotes them).
        if waited & set(self.prefetch_reads):
            for device in self.devices.values():
                device.promote(waited & set(self.prefetch_reads))
        flow.wait_ops |= waited
        for op_id in flow.wait_ops:
            self.read_waiters.setdefault(op_id, []).append(flow)
        if not flow.wait_ops:
            self._settle(flow)

    def _settle(self, flow: Flow) -> None:
        """The Get is served (what could be); then the rest is reserved."""
        stats = self.stats
        request = flow.request
        life = flow.life
        served = []
        if life is not None and life.phase is GetPhase.READING:
            # Nothing, if the lease ran out while the loads were queued (kvd.core.get_life).
            answer = life.settle()
            served = answer.blocks
            self.unsettled.discard(flow)
            self.contents.check_served(served)
            if life.plan.lease is None and flow.read_lease:
                del self.leases[flow.read_lease]  # cut to nothing: closed
                flow.read_lease = 0
            if len(served) < len(flow.tiers):
                stats.get_starved += 1
            if answer.cut == GetCut.CORRUPT:
                stats.get_cut_corrupt += 1
        flow.hit_blocks = len(served)
        served_tiers = flow.tiers[: len(served)]
        host_hits = served_tiers.count(TierId.HOST)
        middle_hits = served_tiers.count(MIDDLE_TIER)
        stats.requests += 1
        stats.prompt_tokens += len(request.prompt)
        stats.prompt_blocks += len(flow.keys)
        stats.host_hit_blocks += host_hits
        stats.middle_hit_blocks += middle_hits
        stats.disk_hit_blocks += len(served) - host_hits - middle_hits
        stats.miss_blocks += len(flow.keys) - len(served)
        self._reserve(flow)
        if request.client_crashes:
            # Dies holding its leases; they expire.
            stats.clients_crashed += 1
            return
        missing_tokens = len(request.prompt) - flow.hit_blocks * self.config.block_tokens
        prefill_us = int(missing_tokens * 1_000_000 / self.config.prefill_tokens_per_s)
        self._schedule(self.now_us + prefill_us, EventKind.PREFILL_DONE, flow)

    def _reserve(self, flow: Flow) -> None:
        keys = flow.keys
        namespace_id = self.namespace_ids[flow.namespace]
        try:
            result = self.engine.reserve(KeysRequest(namespace_id, flow.client_id, keys, self.config.lease_ms,
                                                     self.clock.now_ms()))
        except ResourceExhausted as refusal:
            self.stats.put_refused += 1
            self.stats.quota_refused += isinstance(refusal, QuotaExceeded)
            return
        self.stats.put_reserved += result.statuses.count(ReserveStatus.RESERVED)
        self.stats.put_in_flight += result.statuses.count(ReserveStatus.IN_FLIGHT)
        self.stats.put_no_space += result.statuses.count(ReserveStatus.NO_SPACE)
        if result.lease is not None:
            self.leases[result.lease.lease_id] = result.lease.deadline_ms
            flow.write_lease = result.lease.lease_id
            flow.reserved = [(slot, key) for key, slot in zip(keys, result.slots) if slot != NO_SLOT]

    def _prefill_done(self, flow: Flow) -> None:
        engine = self.engine
        if flow.write_lease in self.leases:
            self._commit(flow)
            if flow.durable:
                self._wait_durable(flow)
        if flow.read_lease in self.leases:
            engine.release(flow.client_id, [flow.read_lease])
            del self.leases[flow.read_lease]
        self.ttft_us.append(self.now_us - flow.request.arrival_us)
        reply_us = len(flow.request.reply) * self.config.decode_us_per_token
        self._schedule(self.now_us + reply_us, EventKind.DECODE_DONE, flow)

    def _decode_done(self, flow: Flow) -> None:
        """Store the reply's full blocks too: a chat's next turn starts with them."""
        request = flow.request
        spec = self.specs[request.tenant]
        tokens = np.concatenate([request.prompt, request.reply])
        done = len(flow.keys) * spec.block_tokens
        parent = flow.keys[-1] if flow.keys else None
        flow.keys = flow.keys + chain_keys(spec, tokens[done:], parent=parent)
        flow.write_lease = 0
        self._reserve(flow)
        if flow.write_lease:
            self._commit(flow)
        if self.deletions.random() < self.config.delete_share:
            self._delete_reply(flow, done // spec.block_tokens)

    def _delete_reply(self, flow: Flow, prompt_blocks: int) -> None:
        """The client Deletes its reply's blocks (the chain from the first of
        them, and whatever hangs under it); as the daemon's Delete, their
        removals are journalled at once."""
        if len(flow.keys) <= prompt_blocks:
            return
        namespace_id = self.namespace_ids[flow.namespace]
        first = flow.keys[prompt_blocks]
        deleted, pinned = self.engine.delete(namespace_id, [first])
        self.stats.deleted_blocks += deleted
        self.stats.deletes_pinned += pinned
        check(pinned or self.engine.namespace(namespace_id).index.get(first) is None, "a Delete left its block")
        if self.disk is not None and self.engine.disk.pool.removals:
            self._submit_journal(self.mover.take_removals(), None)

    def _commit(self, flow: Flow) -> None:
        """The writer filled its reserved slots: seal them all."""
        # The client wrote into these slots all along, so they must still be
        # its blocks': a slot handed to another block meanwhile would hold
        # the bytes of two blocks at once.
        owners = self.engine.host.pool.owners
        for slot, key in flow.reserved:
            owner = owners[slot]
            check(owner is not None and owner.key == key,
                  f"host slot {slot} was reserved for a writer still writing it, and now belongs to {owner!r}")
        self.contents.fill([key for _, key in flow.reserved], [slot for slot, _ in flow.reserved])
        sealed, aborted = self.engine.commit(CommitRequest(self.namespace_ids[flow.namespace], flow.client_id,
                                                           flow.write_lease, self.clock.now_ms()))
        check((sealed, aborted) == (len(flow.reserved), 0), f"commit sealed {sealed} and aborted {aborted}")
        del self.leases[flow.write_lease]

    # ------------------------------------------------------------------
    # The drive

    def _pump_devices(self) -> None:
        """Give the mover its turn for each tier below host memory (reclaim, the
        next write round), then start each device's next job."""
        if self.disk is None:
            return
        mover = self.mover
        for tier, device in self.devices.items():
            round_ = mover.next_round(tier)
            if round_ is not None:
                batch = self.batches[tier] = WriteBatch(round_)
                # As the daemon must: journal the removals of evicted blocks
                # before new bytes go into their slots.
                if round_.removals:
                    self._submit_journal(round_.removals, batch)
                else:
                    self._removals_journalled(batch)
        self._durable_outcomes(mover.hopeless_waits())
        if self.disk.idle and self.engine.disk.pool.removals:
            # Removals of lost, deleted or evicted blocks, in slack time.
            self._submit_journal(mover.take_removals(), None)
        for tier, device in self.devices.items():
            operation = device.start_next(self.now_us, mover.backlog(tier))
            if operation is not None:
                self._schedule(operation.done_us, EventKind.DISK_DONE, operation)

    def _submit_journal(self, removals: list[tuple[bytes, bytes, int]], batch: WriteBatch | None) -> None:
        operation = self.disk.op(DiskOpKind.JOURNAL, 0, self.now_us)
        operation.removals = removals
        operation.batch = batch
        self.disk.submit(operation)

    def _removals_journalled(self, batch: WriteBatch) -> None:
        self.mover.removals_journalled(batch.round, ())
        batch.chunks = batch.round.chunks()
        self._submit_chunk(batch)

    def _submit_chunk(self, batch: WriteBatch) -> None:
        writes = [batch.round.writes[position] for position in batch.chunks[batch.next_chunk]]
        device = self.devices[batch.round.target]
        operation = device.op(DiskOpKind.WRITE, sum(w.block.index.block_bytes for w in writes), self.now_us)
        operation.writes = writes
        operation.batch = batch
        device.submit(operation)

    def _disk_done(self, operation: DiskOp) -> None:
        operation.device.complete(operation, self.now_us)
        if operation.kind in READ_KINDS:
            self._read_done(operation)
            return
        batch = operation.batch
        if operation.kind == DiskOpKind.JOURNAL:
            self.contents.drop(operation.removals)
            if batch is None:
                self.mover.removals_done(operation.removals, ())
            else:
                self._removals_journalled(batch)
            return
        failing = {write.block.key for write in operation.writes if self._fault()}
        self.mover.chunk_written(batch.round, batch.chunks[batch.next_chunk],
                                 self.contents.write(operation.writes, failing))
        batch.next_chunk += 1
        if batch.next_chunk < len(batch.chunks):
            self._submit_chunk(batch)
            return
        outcomes = self.mover.finish_round(batch.round)
        del self.batches[batch.round.target]
        self._durable_outcomes(outcomes)
        # Starved Gets try again once a round is on disk (after its demotions: kvd.core.get_life).
        if self.starved:
            waiting, self.starved = self.starved, []
            for flow in waiting:
                flow.waiting_write_back = False
                self._begin_get(flow, final=False)

    def _read_done(self, operation: DiskOp) -> None:
        corrupt = {load.source_slot for load in operation.loads if self._fault()}
        ok = self.contents.load(operation.loads, corrupt)
        outcomes = [LoadOutcome.OK if good else LoadOutcome.CORRUPT for good in ok]
        if operation.kind == DiskOpKind.PREFETCH:
            del self.prefetch_reads[operation.op_id]
            self.mover.prefetch_done(operation.loads, ok)
        else:
            del self.get_reads[operation.op_id]
            operation.reader.loads_done(operation.loads, outcomes)
        self.stats.lost_blocks += ok.count(False)
        for load in operation.loads:
            del self.loading[load.block.key]
        for flow in self.read_waiters.pop(operation.op_id, []):
            flow.wait_ops.discard(operation.op_id)
            for load, outcome in zip(operation.loads, outcomes):
                if load.block in flow.waits:
                    flow.life.wait_done(load.block, outcome)
            if not flow.wait_ops:
                self._settle(flow)

    # ------------------------------------------------------------------
    # Durable Puts (the daemon's ACK_DURABLE), through the mover's waits

    def _wait_durable(self, flow: Flow) -> None:
        blocks = self.engine.stored(self.namespace_ids[flow.namespace], flow.keys)
        started, failures, pins = self.mover.durable.start(blocks, "", lambda block: (flow, block))
        flow.durable_pending, flow.durable_pins, flow.durable_failures = set(started), pins, failures
        flow.durable_since_us = self.now_us
        self.durable_flows.add(flow)
        if started:
            self._schedule(self.now_us + self.config.durable_wait_ms * 1000, EventKind.DURABLE_TIMEOUT, flow)
        else:
            self._durable_done(flow)

    def _durable_outcomes(self, outcomes) -> None:
        for (flow, block), failure in outcomes:
            if flow not in self.durable_flows:
                continue  # it gave up at its deadline
            flow.durable_pending.discard(block)
            if failure is not None:
                flow.durable_failures.append(failure)
            if not flow.durable_pending:
                self._durable_done(flow)

    def _durable_timeout(self, flow: Flow) -> None:
        if flow in self.durable_flows:
            flow.durable_failures.extend(NotDurable(block, "DEADLINE_EXCEEDED", "not written in time")
                                         for block in flow.durable_pending)
            flow.durable_pending = set()
            self._durable_done(flow)

    def _durable_done(self, flow: Flow) -> None:
        """The Put is answered: acknowledged durable only if every block is on disk, with its own bytes."""
        self.durable_flows.discard(flow)
        for pin in flow.durable_pins:
            pin.release()
        flow.durable_pins = []
        stats = self.stats
        stats.durable_wait_max_us = max(stats.durable_wait_max_us, self.now_us - flow.durable_since_us)
        if flow.durable_failures:
            stats.durable_failed += 1
            return
        stats.durable_acked += 1
        engine = self.engine
        for block in engine.stored(self.namespace_ids[flow.namespace], flow.keys):
            slot = engine.disk_slot(block)
            check(slot != NO_SLOT and self.contents.disk.get(slot) == block.key,
                  "a Put acknowledged durable left {!r} off the disk", block)

    def _fault(self) -> bool:
        return self.config.fault_rate > 0 and self.faults.random() < self.config.fault_rate

    # ------------------------------------------------------------------
    # Invariants

    def check_invariants(self) -> None:
        """The engine's own checks, then what the simulator knows it must hold."""
        engine = self.engine
        engine.verify()
        check(engine.leaked_handles == 0, "{} block handles leaked", engine.leaked_handles)
        live = {lease.lease_id for lease in engine.leases}
        check(live == set(self.leases), "open leases {} but expected {}", sorted(live), sorted(self.leases))
        # Every reference is held by a lease or by a write in flight.
        held = sum(
            not handle.released
            for lease in engine.leases
            for handle in (*lease.handles, lease.parent_handle)
            if handle is not None
        )
        held += sum(not write.handle.released for batch in self.batches.values() for write in batch.round.writes)
        held += sum(not pin.released for flow in self.durable_flows for pin in flow.durable_pins)
        held += sum(not pin.released for flow in self.unsettled for pin in flow.life.plan.pins)
        # ... and by every disk read in flight (its own pin on the block it reads in).
        held += sum(not load.handle.released for reads in (self.prefetch_reads, self.get_reads)
                    for read in reads.values() for load in read.loads)
        check(held == engine.live_handles, "{} live handles, {} held by leases and writes", engine.live_handles, held)
        check({block.key for block in engine.loading} == set(self.loading), "blocks loading disagree with the reads")
        for tenant, namespace_id in enumerate(self.namespace_ids):
            state = engine.namespace(namespace_id)
            counters = [state.lookup_hits, state.lookup_misses, state.get_hits, state.get_misses]
            check(counters == self.expected_counters[tenant], "hit counters {} of tenant {} drifted", counters, tenant)
            self._check_contents(state.index)
        check(self.disk is None or self.mover.starved_gets == len(self.starved),
              "{} Gets counted as starved, {} waiting", self.mover.starved_gets if self.disk else 0, len(self.starved))
        stats = self.stats
        check(stats.host_hit_blocks + stats.middle_hit_blocks + stats.disk_hit_blocks + stats.miss_blocks
              == stats.prompt_blocks, "hits in each tier + misses is not every prompt block")

    def _check_contents(self, index) -> None:
        """May lose, never lie: every servable copy holds its own block's bytes."""
        host = self.contents.host
        engine = self.engine
        for block in index:
            if block.state != BlockState.SEALED:
                continue
            for tier, slot in engine.tiers.copies(block):
                if tier is engine.host:
                    check(block in engine.loading or host.get(slot) == block.key,
                          "host slot of {!r} holds another block", block)
                else:
                    check(self.contents.lower[tier].get(slot) == block.key, "{} slot of {!r} holds another block",
                          tier.name, block)

    def _finish(self) -> None:
        """Past every deadline: all leases gone, nothing pinned, nothing leaked."""
        engine = self.engine
        check(not self.read_waiters and not self.prefetch_reads and not self.get_reads and not self.batches
              and not self.starved
              and not self.durable_flows,
              "requests still waiting after the last event")
        self._advance(self.now_us + engine.limits.lease_ms_max * 1000 + 1000)
        check(not self.leases and engine.live_handles == 0 and engine.pinned_blocks == 0,
              "blocks still pinned after every lease expired")

    def _summary(self) -> RunStats:
        stats = self.stats
        engine = self.engine
        stats.steps = self.step
        stats.simulated_us = self.now_us
        if self.ttft_us:
            ttft = np.array(self.ttft_us, dtype=np.int64)
            stats.ttft_mean_ms = round(float(ttft.mean()) / 1000, 3)
            stats.ttft_p99_ms = round(float(np.percentile(ttft, 99)) / 1000, 3)
        stats.host_evictions = engine.host.counters.evictions
        stats.host_demotions = engine.host.counters.demotions
        if engine.disk is not None:
            stats.disk_evictions = engine.disk.counters.evictions
            stats.disk_written_blocks = engine.disk.counters.written
            stats.disk_loaded_blocks = engine.disk.counters.loaded
            stats.prefetch_used = engine.prefetch_counters.used
            stats.prefetch_wasted = engine.prefetch_counters.wasted
        for tier in engine.lower_tiers:
            if tier is not engine.disk:
                stats.middle_evictions += tier.counters.evictions
                stats.middle_written_blocks += tier.counters.written
                stats.middle_loaded_blocks += tier.counters.loaded
        if self.disk is not None:
            traffic = self.disk.traffic
            stats.disk_read_bytes = traffic.read_bytes
            stats.disk_write_bytes = traffic.write_bytes
            stats.disk_busy_share = round(traffic.busy_us / max(1, self.now_us), 6)
            stats.read_wait_mean_us = round(traffic.read_wait_us / max(1, traffic.read_ops), 3)
        return stats
