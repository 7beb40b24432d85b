"""The deterministic simulator: the real engine, driven by a trace in simulated time.

One `Simulator` runs one configuration (kvd.sim.config: policy, host and
disk capacity, ...) over one trace. Time is an integer count of
microseconds that only the event queue moves (kvd.sim.events). No thread,
no wall clock, no unseeded randomness: a seed and a configuration give the
same run, event for event, on every machine.

The Simulator composes the parts of a run and passes events between them:

    world.py       the engine, its namespaces and the daemon's mover, built
                   from the configuration; time, fake bytes, stats
    clients.py     each request: lookup, Get, Put, prefill, decode, Delete
    drives.py      the modelled devices running the mover's write rounds,
                   journals, Gets' reads and prefetches
    durable.py     Puts acknowledged only once durable
    faults.py      writes that fail and reads that come back corrupt
    invariants.py  what must hold after a step
    results.py     what the run measured

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

from collections.abc import Callable

from kvd.invariants import check
from kvd.sim.clients import Clients
from kvd.sim.config import SimConfig
from kvd.sim.disk import READ_KINDS, DiskOp
from kvd.sim.drives import Drives
from kvd.sim.durable import DurablePuts
from kvd.sim.events import EventKind
from kvd.sim.faults import Faults
from kvd.sim.invariants import check_invariants, check_quiet, check_released
from kvd.sim.results import RunResult, RunStats, add_totals
from kvd.sim.traces import TraceGenerator
from kvd.sim.world import build_world


class SimFailure(Exception):
    """An invariant broke (or the engine raised) at a given step of a seeded run."""

    def __init__(self, config: SimConfig, step: int, event: str, cause: BaseException) -> None:
        super().__init__(f"seed {config.seed}, step {step} ({event}): {type(cause).__name__}: {cause}")
        self.config = config
        self.step = step
        self.event = event
        self.cause = cause


class Simulator:
    def __init__(self, config: SimConfig, *, progress: Callable[[int, int], None] | None = None) -> None:
        config.validate()
        self.config = config
        self.progress = progress
        self.world = world = build_world(config)
        self.engine = world.engine
        # Faults are drawn apart from the trace, which every policy shares.
        self.drives = Drives(world, Faults(config.fault_rate, config.seed))
        self.durable = DurablePuts(world)
        self.clients = Clients(world, self.drives, self.durable)
        self.trace = iter(TraceGenerator(config.seed, config.trace))
        self.step = 0
        self.arrivals = 0

    def run(self) -> RunResult:
        timeline = self.world.timeline
        self._schedule_next_arrival()
        while timeline:
            time_us, kind, payload = timeline.pop()
            self._run_step(kind.name.lower(), lambda: self.handle(time_us, kind, payload))
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

    def handle(self, time_us: int, kind: EventKind, payload: object) -> None:
        """One event at its time: the part it is for acts, then the devices take their next jobs."""
        self._advance(time_us)
        clients = self.clients
        if kind == EventKind.ARRIVAL:
            clients.arrive(payload)
            self._schedule_next_arrival()
        elif kind == EventKind.DISK_DONE:
            self._disk_done(payload)
        elif kind == EventKind.PREFILL_DONE:
            clients.prefill_done(payload)
        elif kind == EventKind.DECODE_DONE:
            clients.decode_done(payload)
        elif kind == EventKind.DURABLE_TIMEOUT:
            self.durable.timeout(payload)
        elif kind == EventKind.GET:
            clients.begin_get(payload, final=False)
        else:  # EventKind.STARVED_TIMEOUT
            clients.starved_timeout(payload)
        self.pump_devices()

    def _schedule_next_arrival(self) -> None:
        if self.arrivals < self.config.requests:
            request = next(self.trace)
            timeline = self.world.timeline
            timeline.schedule(max(request.arrival_us, timeline.now_us), EventKind.ARRIVAL, request)
            self.arrivals += 1
            if self.progress is not None:
                self.progress(self.arrivals, self.config.requests)

    def _advance(self, time_us: int) -> None:
        """Time moves on: the leases due expire, as many as the simulator expects."""
        world = self.world
        now_ms = world.timeline.advance(time_us)
        due = world.expected.leases_due(now_ms)
        expired = self.engine.expire(now_ms)
        check(expired == len(due), f"{expired} leases expired at {now_ms} ms, expected {len(due)}")
        for lease_id in due:
            del world.expected.leases[lease_id]
        world.stats.leases_expired += expired

    def pump_devices(self) -> None:
        """Give the mover its turn for each tier below host memory (reclaim, the next write round),
        then start each device's next job."""
        if self.drives.disk is None:
            return
        self.drives.start_rounds()
        self.durable.outcomes(self.world.mover.hopeless_waits())
        self.drives.start_jobs()

    def _disk_done(self, operation: DiskOp) -> None:
        operation.device.complete(operation, self.world.timeline.now_us)
        if operation.kind in READ_KINDS:
            waiting, outcomes = self.drives.read_done(operation)
            for flow in waiting:
                self.clients.read_done(flow, operation, outcomes)
            return
        outcomes = self.drives.write_done(operation)
        if outcomes is not None:  # a write round ended
            self.durable.outcomes(outcomes)
            self.clients.retry_starved()

    def check_invariants(self) -> None:
        check_invariants(self)

    def _finish(self) -> None:
        """Past every deadline: all leases gone, nothing pinned, nothing leaked."""
        check_quiet(self)
        self._advance(self.world.timeline.now_us + self.engine.limits.lease_ms_max * 1000 + 1000)
        check_released(self)

    def _summary(self) -> RunStats:
        world = self.world
        traffic = self.drives.disk.traffic if self.drives.disk is not None else None
        return add_totals(world.stats, self.engine, traffic, self.clients.ttft_us, steps=self.step,
                          simulated_us=world.timeline.now_us)
