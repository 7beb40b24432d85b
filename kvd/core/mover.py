"""The mover: when bytes move between host memory and the disk, written once, without I/O.

The engine decides *which* block goes where; the mover decides *when*, and
in what order the pieces of a move must happen. It does no I/O, holds no
clock and no futures: it hands its driver plain work (a `WriteRound`:
removals to journal, then chunks of writes) and takes back plain outcomes.
Two drivers run it: the daemon's disk plane (kvd.server.disk_plane), from
its event loop with the I/O thread doing the work, and the simulator
(kvd.sim), in simulated time against a modelled drive. Both therefore
follow the same rules:

* write-through writes every sealed block; write-back writes only while
  host memory is being reclaimed (high watermark down to the low one),
  while a client waits for durability, while a Get is starved of host
  slots, or while the daemon drains;
* before a round: above the high watermark, durable blocks are demoted
  down to the low one;
* a round journals the REMOVE records of the slots it reuses *before* any
  of its bytes are written (no replay may pair an old record with new
  bytes); a write into a slot whose REMOVE failed is never attempted;
  the removals are confirmed before the writes' outcomes are recorded, so
  a slot a failed write quarantines is not freed again by them;
* a Get starved of host slots waits for write-back only while write-back
  is pending (queued, or a round in flight) and its wait has not run out,
  and tries again after each round, once the round's demotions are done.

Invariants are checked on every transition (`check`), and `verify()` holds
between any two calls.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvd.core.writeback import DiskWrite
from kvd.invariants import check

if TYPE_CHECKING:
    from kvd.core.engine import Engine

WRITE_MODES = ("back", "through")


@dataclass(frozen=True, slots=True)
class MoverSettings:
    write_mode: str = "back"
    # Blocks picked for one write-back round.
    batch_blocks: int = 64
    # Blocks per write job of a round; 0: the whole round in one job (the
    # fifo schedule's behaviour, kept as a baseline).
    chunk_blocks: int = 8

    def __post_init__(self) -> None:
        check(self.write_mode in WRITE_MODES, "write_mode must be back or through, got {!r}", self.write_mode)
        check(self.batch_blocks > 0 and self.chunk_blocks >= 0, "write batches need blocks")


@dataclass(slots=True, eq=False)
class WriteRound:
    """One round of write-back: `removals` journalled first, then the writes in `chunks`."""

    writes: list[DiskWrite]
    # (namespace id, key, slot) whose REMOVE must be durable before any write.
    removals: list[tuple[bytes, bytes, int]]
    chunk_blocks: int
    # Per write: durable. Filled as chunks finish.
    ok: list[bool] = field(default_factory=list)
    # Slots whose REMOVE failed: never written (set by removals_journalled).
    unusable: frozenset[int] = frozenset()
    journalled: bool = False

    def __post_init__(self) -> None:
        self.ok = [False] * len(self.writes)

    def chunks(self) -> list[list[int]]:
        """Positions of the writes, one list per write job: grouped by
        namespace (a job writes one namespace's layout), at most
        `chunk_blocks` each, without the writes into unusable slots."""
        check(self.journalled, "write chunks asked for before the round's removals were journalled")
        groups: dict[bytes, list[int]] = {}
        for position, write in enumerate(self.writes):
            if write.disk_slot not in self.unusable:
                groups.setdefault(write.block.index.namespace_id, []).append(position)
        jobs = []
        for positions in groups.values():
            step = self.chunk_blocks or len(positions)
            jobs.extend(positions[start:start + step] for start in range(0, len(positions), step))
        return jobs


class Mover:
    def __init__(self, engine: Engine, settings: MoverSettings) -> None:
        check(engine.disk is not None, "the mover moves blocks to and from a disk tier")
        self.engine = engine
        self.settings = settings
        self.round: WriteRound | None = None
        # Reasons to write back now, whatever the watermarks say.
        self.durable_waits = 0
        self.starved_gets = 0
        self.draining = False
        self.rounds = 0

    # -- write-back ------------------------------------------------------------

    def should_write(self) -> bool:
        if self.settings.write_mode == "through" or self.durable_waits or self.starved_gets or self.draining:
            return True
        return self.engine.host_reclaiming()

    def reclaim(self) -> int:
        """Above the high watermark: demote durable blocks down to the low one; how many."""
        engine = self.engine
        return engine.demote_to_low_watermark() if engine.host_reclaiming() else 0

    def backlog(self) -> int:
        """Blocks waiting for write-back while memory needs them written (for the I/O schedule)."""
        return len(self.engine.write_queue) if self.should_write() else 0

    def next_round(self) -> WriteRound | None:
        """A turn of the writer: reclaim if due, then the next round of
        write-back if none is in flight, one is due, and there is something
        to write."""
        self.reclaim()
        if self.round is not None or not self.should_write():
            return None
        writes = self.engine.pick_writes(self.settings.batch_blocks)
        if not writes:
            return None
        # Taken after the picks: they include the removals of the disk
        # slots those writes take over from evicted blocks.
        self.round = WriteRound(writes, self.engine.take_disk_removals(), self.settings.chunk_blocks)
        return self.round

    def removals_journalled(self, round_: WriteRound, failed: Collection[int]) -> None:
        """The round's removals are journalled (durable), but those of the `failed` slots."""
        check(round_ is self.round and not round_.journalled, "removals of a round not in flight")
        failed = frozenset(failed)
        self.engine.confirm_disk_removals([slot for _, _, slot in round_.removals if slot not in failed])
        round_.unusable = failed
        round_.journalled = True

    def chunk_written(self, round_: WriteRound, positions: Sequence[int], ok: Sequence[bool]) -> None:
        check(round_ is self.round and round_.journalled, "a write chunk of a round not in flight")
        check(len(positions) == len(ok), "one outcome per write")
        for position, good in zip(positions, ok):
            round_.ok[position] = bool(good)

    def finish_round(self, round_: WriteRound) -> None:
        """Every chunk of the round has been written (or failed): record what is durable."""
        check(round_ is self.round and round_.journalled, "finish of a round not in flight")
        self.engine.finish_writes(round_.writes, round_.ok)
        self.round = None
        self.rounds += 1

    def abandon_round(self, round_: WriteRound) -> None:
        """The round's I/O could not run at all (shutdown): nothing was written."""
        if not round_.journalled:
            self.removals_journalled(round_, {slot for _, _, slot in round_.removals})
        self.finish_round(round_)

    # -- removals outside write rounds -----------------------------------------

    def take_removals(self) -> list[tuple[bytes, bytes, int]]:
        """Removals of lost, deleted or evicted blocks, to journal now."""
        return self.engine.take_disk_removals()

    def removals_done(self, removals: Sequence[tuple[bytes, bytes, int]], failed: Collection[int]) -> None:
        self.engine.confirm_disk_removals([slot for _, _, slot in removals if slot not in failed])

    # -- Gets starved of host slots --------------------------------------------

    def write_back_pending(self) -> bool:
        return bool(self.engine.write_queue) or self.round is not None

    def starved_get_waits(self, now: float, deadline: float) -> bool:
        """Whether a starved Get should wait for the next round (else it takes what it can now)."""
        return now < deadline and not self.draining and self.write_back_pending()

    def after_round(self) -> None:
        """A round reached disk: its blocks' host copies may now make room (starved Gets try again next)."""
        self.reclaim()

    def verify(self) -> None:
        check(self.durable_waits >= 0 and self.starved_gets >= 0, "negative wait counts")
        round_ = self.round
        if round_ is not None:
            disk = self.engine.disk
            check(all(write.disk_slot in disk.pool.incoming for write in round_.writes),
                  "a write of the round in flight lost its incoming slot")
            check(len(round_.ok) == len(round_.writes), "one outcome per write of the round")
