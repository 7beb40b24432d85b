"""A modelled NVMe drive: what the disk tier's I/O costs in simulated time.

One operation runs at a time and takes `latency + bytes / bandwidth`. Which
operation runs next is the daemon's own I/O schedule (kvd.planner.io_schedule):
under "slack", removal journals first, then restores, and write-back only
in the gaps between reads (or its bounded share once the backlog is full);
under "fifo", arrival order. Which blocks move, and when a job is made, is
the engine's and the mover's decision (kvd.core.mover); this only says
how long each job takes.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvd.core.engine import Transfer
from kvd.planner.io_schedule import IoClass, IoJob, IoSchedule
from kvd.invariants import check

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class DiskSpec:
    # A PCIe 4 NVMe drive, roughly.
    read_bytes_per_s: float = 6.0 * GIB
    write_bytes_per_s: float = 3.0 * GIB
    read_latency_us: int = 100
    write_latency_us: int = 30
    # One manifest append made durable (an fdatasync).
    journal_latency_us: int = 200


# A middle memory tier (CXL-attached or another socket's DRAM, roughly):
# copies at memory speed, nothing to journal.
MEMORY_SPEC = DiskSpec(read_bytes_per_s=24.0 * GIB, write_bytes_per_s=24.0 * GIB, read_latency_us=2,
                       write_latency_us=2, journal_latency_us=0)


class DiskOpKind(enum.Enum):
    READ = "read"
    PREFETCH = "prefetch"  # a read ahead of a Get, queued behind restores
    WRITE = "write"
    JOURNAL = "journal"


READ_KINDS = (DiskOpKind.READ, DiskOpKind.PREFETCH)
_IO_CLASS = {DiskOpKind.READ: IoClass.RESTORE, DiskOpKind.PREFETCH: IoClass.PREFETCH, DiskOpKind.WRITE: IoClass.WRITE,
             DiskOpKind.JOURNAL: IoClass.CONTROL}


@dataclass(slots=True, eq=False)
class DiskOp:
    op_id: int
    kind: DiskOpKind
    payload_bytes: int
    submit_us: int
    loads: list[Transfer] = field(default_factory=list)
    writes: list[Transfer] = field(default_factory=list)
    # (namespace id, key, slot) whose REMOVE this operation journals.
    removals: list[tuple[bytes, bytes, int]] = field(default_factory=list)
    # The write-back batch this operation belongs to, if any (the simulator's).
    batch: object = None
    # The Get whose own reads these are (a kvd.core.get_life.GetLife), if any.
    reader: object = None
    # Its job in the schedule (a prefetch a Get waits for is promoted to a restore).
    job: IoJob | None = None
    # The modelled device it runs on.
    device: ModelledDisk | None = None
    start_us: int = -1
    done_us: int = -1


@dataclass(slots=True)
class DiskTraffic:
    read_ops: int = 0
    read_bytes: int = 0
    write_ops: int = 0
    write_bytes: int = 0
    journal_ops: int = 0
    busy_us: int = 0
    # Time reads spent queued behind other operations.
    read_wait_us: int = 0


class ModelledDisk:
    """One device under one tier (a drive; a middle tier's memory), one operation at a time."""

    def __init__(self, spec: DiskSpec, schedule: IoSchedule, ids: Iterator[int] | None = None) -> None:
        check(spec.read_bytes_per_s > 0 and spec.write_bytes_per_s > 0, "disk bandwidth must be positive")
        self.spec = spec
        self.schedule = schedule
        self.current: DiskOp | None = None
        self.traffic = DiskTraffic()
        # Operation ids, shared by every device of a simulation so each is unique.
        self._ids = ids if ids is not None else itertools.count(1)

    @property
    def idle(self) -> bool:
        return self.current is None and not len(self.schedule)

    def op(self, kind: DiskOpKind, payload_bytes: int, now_us: int) -> DiskOp:
        return DiskOp(next(self._ids), kind, payload_bytes, now_us, device=self)

    def submit(self, operation: DiskOp) -> None:
        operation.job = self.schedule.push(IoJob(_IO_CLASS[operation.kind], operation, operation.payload_bytes))

    def promote(self, op_ids: set[int]) -> bool:
        """Queued prefetch reads a Get now waits for become restores (the daemon's promote)."""
        return self.schedule.promote(lambda job: job.payload.op_id in op_ids, IoClass.RESTORE)

    def duration_us(self, operation: DiskOp) -> int:
        spec = self.spec
        if operation.kind in READ_KINDS:
            latency_us, bandwidth = spec.read_latency_us, spec.read_bytes_per_s
        else:
            latency_us, bandwidth = spec.write_latency_us, spec.write_bytes_per_s
        if operation.removals:
            latency_us += spec.journal_latency_us
        # Ceiling division in integers: the same on every machine.
        transfer_us = -(-operation.payload_bytes * 1_000_000 // int(bandwidth))
        return latency_us + transfer_us

    def start_next(self, now_us: int, backlog: int) -> DiskOp | None:
        """Start the job the schedule picks, if the drive is free; `backlog`:
        blocks waiting for write-back while memory needs them written."""
        if self.current is not None:
            return None
        job = self.schedule.pop(backlog)
        if job is None:
            return None
        operation = job.payload
        self.current = operation
        operation.start_us = now_us
        operation.done_us = now_us + self.duration_us(operation)
        traffic = self.traffic
        traffic.busy_us += operation.done_us - now_us
        if operation.kind in READ_KINDS:
            traffic.read_ops += 1
            traffic.read_bytes += operation.payload_bytes
            traffic.read_wait_us += now_us - operation.submit_us
        elif operation.kind == DiskOpKind.WRITE:
            traffic.write_ops += 1
            traffic.write_bytes += operation.payload_bytes
        else:
            traffic.journal_ops += 1
        return operation

    def complete(self, operation: DiskOp, now_us: int) -> None:
        check(self.current is operation and operation.done_us == now_us, "completion of an operation not running")
        self.current = None
        self.schedule.job_done(operation.job.io_class, (now_us - operation.start_us) / 1e6)
