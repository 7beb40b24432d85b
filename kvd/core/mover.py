"""The mover: when bytes move between host memory and the disk, written once, without I/O.

The engine decides *which* block goes where; the mover decides *when*, and
in what order the pieces of a move must happen. It does no I/O, holds no
clock and no futures: it hands its driver plain work (a `WriteRound`:
removals to journal, then chunks of writes) and takes back plain outcomes.
Two drivers run it: the daemon's disk plane (kvd.planes.disk), from
its event loop with the I/O thread doing the work, and the simulator
(kvd.sim), in simulated time against a modelled drive. Both therefore
follow the same rules:

* write-behind (the default) and write-through write every block the
  admission filter queued, at once; write-back writes only while host
  memory is being reclaimed (high watermark down to the low one), while a
  client waits for durability, while a Get is starved of host slots, or
  while the daemon drains. Write-behind differs from write-through in
  urgency only: its queue counts as a backlog (writes that may take
  drive time from reads, kvd.planner.io_schedule) only for those same
  reasons, so otherwise it is written in the reads' gaps, the lowest
  priority there is, and a crash loses only what the gaps have not yet
  reached (`oldest unwritten`, in seconds, by the driver's clock);
* before a round: above the high watermark, durable blocks are demoted
  down to the low one;
* a round journals the REMOVE records of the slots it reuses *before* any
  of its bytes are written (no replay may pair an old record with new
  bytes); a write into a slot whose REMOVE failed is never attempted;
  the removals are confirmed before the writes' outcomes are recorded, so
  a slot a failed write quarantines is not freed again by them;
* a Get starved of host slots waits for write-back only while write-back
  is pending (queued, or a round in flight) and its wait has not run out,
  and tries again after each round, once the round's demotions are done;
* a Prefetch reads at most `prefetch_max_blocks` blocks ahead of Gets at
  a time, in jobs of `prefetch_chunk_blocks` queued behind restores, and
  each job's blocks are finished (kept if verified, then unpinned) as soon
  as that job is over, so a Get waits for its own blocks' job only;
* a client waiting for durability (`DurableWaits`) pins its blocks, has
  their chains queued, and gets an outcome per block as soon as one is
  known: durable (written, and synced as disk.fsync says: kvd.core.durable),
  or why it never will be (its parent failed, it was lost, its namespace or
  tenant cannot go to disk, ...), not only at its deadline.

Invariants are checked on every transition (`check`), and `verify()` holds
between any two calls.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvd.core.block import Block, BlockState
from kvd.core.durable import SYNC_POLICIES, DurableWaits, NotDurable
from kvd.core.prefetch import PrefetchPlan
from kvd.core.tier import StorageTier
from kvd.core.transfer import Transfer
from kvd.invariants import check

if TYPE_CHECKING:
    from kvd.core.engine import Engine

WRITE_MODES = ("behind", "back", "through")
# Modes that write whatever is queued, without waiting for a reason to.
WRITE_EAGER = ("behind", "through")


@dataclass(frozen=True, slots=True)
class MoverSettings:
    write_mode: str = "behind"
    # Blocks picked for one write-back round.
    batch_blocks: int = 64
    # Blocks per write job of a round; 0: the whole round in one job (the
    # fifo schedule's behaviour, kept as a baseline).
    chunk_blocks: int = 8
    # Prefetch reads in flight at most, and blocks per prefetch job.
    prefetch_max_blocks: int = 256
    prefetch_chunk_blocks: int = 16
    # disk.fsync: when a written block is durable (kvd.core.durable).
    sync: str = "strict"

    def __post_init__(self) -> None:
        check(self.sync in SYNC_POLICIES, "sync must be one of {}, got {!r}", SYNC_POLICIES, self.sync)
        check(self.write_mode in WRITE_MODES, "write_mode must be one of {}, got {!r}", WRITE_MODES, self.write_mode)
        check(self.batch_blocks > 0 and self.chunk_blocks >= 0, "write batches need blocks")
        check(self.prefetch_max_blocks > 0 and self.prefetch_chunk_blocks > 0, "prefetch jobs need blocks")


@dataclass(slots=True, eq=False)
class WriteRound:
    """One round of write-back: `removals` journalled first, then the writes in `chunks`."""

    writes: list[Transfer]
    # (namespace id, key, slot) whose REMOVE must be durable before any write.
    removals: list[tuple[bytes, bytes, int]]
    chunk_blocks: int
    # Per write: durable. Filled as chunks finish.
    ok: list[bool] = field(default_factory=list)
    # Slots whose REMOVE failed: never written (set by round_removals_journalled).
    unusable: frozenset[int] = frozenset()
    journalled: bool = False

    def __post_init__(self) -> None:
        check(bool(self.writes), "a write round without writes")
        target = self.writes[0].target
        check(all(write.target is target for write in self.writes), "a write round goes to one tier")
        self.ok = [False] * len(self.writes)

    @property
    def target(self) -> StorageTier:
        return self.writes[0].target  # type: ignore[return-value]

    def chunks(self) -> list[list[int]]:
        """Positions of the writes, one list per write job: grouped by
        namespace (a job writes one namespace's layout), at most
        `chunk_blocks` each, without the writes into unusable slots."""
        check(self.journalled, "write chunks asked for before the round's removals were journalled")
        groups: dict[bytes, list[int]] = {}
        for position, write in enumerate(self.writes):
            if write.target_slot not in self.unusable:
                groups.setdefault(write.block.index.namespace_id, []).append(position)
        jobs = []
        for positions in groups.values():
            step = self.chunk_blocks or len(positions)
            jobs.extend(positions[start:start + step] for start in range(0, len(positions), step))
        return jobs


class Mover:
    def __init__(self, engine: Engine, settings: MoverSettings,
                 admission_reason: Callable[[Block], str] = lambda block: "the disk tier does not take it") -> None:
        check(bool(engine.lower_tiers), "the mover moves blocks to and from tiers below host memory")
        self.engine = engine
        self.settings = settings
        # The write round in flight to each lower tier, at most one each.
        self.in_flight: dict[StorageTier, WriteRound] = {}
        self.durable: DurableWaits = DurableWaits(engine, admission_reason, settings.sync)
        # Gets waiting for write-back to make room: a reason to write now.
        self.starved_gets = 0
        self.draining = False
        self.rounds = 0
        # Tiers whose last turn picked nothing because its slot searches ran out of budget.
        self.searches_cut_short: set[StorageTier] = set()

    @property
    def round(self) -> WriteRound | None:
        """The round in flight to the durable tier (the disk)."""
        return self.in_flight.get(self.engine.disk) if self.engine.disk is not None else None

    def _target(self, tier: StorageTier | None) -> StorageTier:
        tier = tier or self.engine.disk or self.engine.lower_tiers[0]
        check(tier in self.engine.lower_tiers, "{} is no tier below host memory", tier.name)
        return tier

    # -- write-back ------------------------------------------------------------

    def should_write(self) -> bool:
        return self.settings.write_mode in WRITE_EAGER or self.write_urgent()

    def write_urgent(self) -> bool:
        """Whether something waits for write-back: durability, a starved Get, the drain, host memory
        (under write-through, always: its writes are the point)."""
        if self.settings.write_mode == "through" or self.durable.waiting or self.starved_gets or self.draining:
            return True
        return self.engine.host_reclaiming()

    def reclaim(self) -> int:
        """Above the high watermark: demote blocks with a copy below down to the low one; how many."""
        engine = self.engine
        return engine.demote_to_low_watermark() if engine.host_reclaiming() else 0

    def backlog(self, tier: StorageTier | None = None) -> int:
        """Blocks waiting for write-back to `tier` (default: the disk) while something waits for
        them (for the I/O schedule: a full backlog takes a share of the drive from reads)."""
        return len(self.engine.write_queue_of(self._target(tier))) if self.write_urgent() else 0

    def next_round(self, tier: StorageTier | None = None) -> WriteRound | None:
        """A turn of the writer to `tier` (default: the disk): reclaim if due,
        then the next round of write-back if none is in flight to that tier,
        one is due, and there is something to write."""
        tier = self._target(tier)
        self.reclaim()
        self.searches_cut_short.discard(tier)
        if tier in self.in_flight or not self.should_write():
            return None
        writes = self.engine.pick_writes(self.settings.batch_blocks, tier)
        if not writes:
            if self.engine.writes_cut_short(tier):
                self.searches_cut_short.add(tier)
            return None
        # Taken after the picks: they include the removals of the slots
        # those writes take over from evicted blocks (persistent tiers).
        round_ = WriteRound(writes, self.engine.take_removals(tier), self.settings.chunk_blocks)
        self.in_flight[tier] = round_
        return round_

    def searching(self, tier: StorageTier | None = None) -> bool:
        """Whether the last turn to `tier` (default: the disk) picked nothing
        only because its slot searches used up their budget: the next turn
        goes on with them, and should come at once, not after a wait."""
        return self._target(tier) in self.searches_cut_short

    def _check_in_flight(self, round_: WriteRound, journalled: bool, what: str) -> None:
        check(self.in_flight.get(round_.target) is round_ and round_.journalled == journalled,
              "{} of a round not in flight", what)

    def round_removals_journalled(self, round_: WriteRound, failed: Collection[int]) -> None:
        """The round's removals are journalled (durable), but those of the `failed` slots."""
        self._check_in_flight(round_, False, "removals")
        failed = frozenset(failed)
        self.engine.removals_journalled(round_.target, [slot for _, _, slot in round_.removals if slot not in failed])
        round_.unusable = failed
        round_.journalled = True

    def chunk_written(self, round_: WriteRound, positions: Sequence[int], ok: Sequence[bool]) -> None:
        self._check_in_flight(round_, True, "a write chunk")
        check(len(positions) == len(ok), "one outcome per write")
        for position, good in zip(positions, ok):
            round_.ok[position] = bool(good)

    def finish_round(self, round_: WriteRound) -> list[tuple[object, NotDurable | None]]:
        """Every chunk of the round has been written (or failed): record what
        landed; the outcome for each durable wait on one of its blocks."""
        self._check_in_flight(round_, True, "finish")
        self.engine.finish_writes(round_.writes, round_.ok)
        del self.in_flight[round_.target]
        self.rounds += 1
        if round_.target is not self.engine.disk:
            return []
        return self.durable.written(round_.writes, round_.ok)

    def hopeless_waits(self) -> list[tuple[object, NotDurable]]:
        """Durable waits that can never succeed, to fail now: on blocks neither
        in the round in flight nor queued for writing (call after next_round)."""
        return self.durable.unwritable(self.round.writes if self.round is not None else [])

    # -- prefetch ----------------------------------------------------------------

    def prefetch(self, namespace_id: bytes, keys: Sequence[bytes], parent_key: bytes = b""
                 ) -> tuple[PrefetchPlan, list[list[Transfer]]]:
        """Plan a Prefetch: what it found, and its reads as jobs (each one read job, behind restores)."""
        check(not self.draining, "no prefetch while draining")
        plan = self.engine.begin_prefetch(namespace_id, keys, parent_key, self.settings.prefetch_max_blocks)
        step = self.settings.prefetch_chunk_blocks
        return plan, [plan.loads[start:start + step] for start in range(0, len(plan.loads), step)]

    def prefetch_done(self, loads: Sequence[Transfer], ok: Sequence[bool] | None) -> int:
        """One prefetch job is over (`ok` None: it never ran, its blocks stay on disk only);
        how many of its blocks are now in host memory, verified."""
        engine = self.engine
        if ok is None:
            engine.abandon_prefetch(loads)
            return 0
        engine.finish_prefetch(loads, ok)
        # Still stored: a good read under a corrupt parent is lost too.
        return sum(load.block.state == BlockState.SEALED and engine.host_slot(load.block) == load.target_slot
                   for load in loads)

    # -- removals outside write rounds -----------------------------------------

    def take_removals(self) -> list[tuple[bytes, bytes, int]]:
        """Removals of lost, deleted or evicted blocks, to journal now."""
        return self.engine.take_disk_removals()

    def removals_journalled(self, removals: Sequence[tuple[bytes, bytes, int]], failed: Collection[int]) -> None:
        """Removals taken outside a round (take_removals) are journalled, but those of the `failed` slots."""
        self.engine.disk_removals_journalled([slot for _, _, slot in removals if slot not in failed])

    # -- Gets starved of host slots --------------------------------------------

    def write_back_pending(self) -> bool:
        """Whether a write to any tier below is queued or in flight (its end may free host slots)."""
        return bool(self.in_flight) or any(self.engine.write_queue_of(tier) for tier in self.engine.lower_tiers)

    def starved_get_waits(self, now: float, deadline: float) -> bool:
        """Whether a starved Get should wait for the next round (else it takes what it can now)."""
        return now < deadline and not self.draining and self.write_back_pending()

    def after_round(self) -> None:
        """A round reached disk: its blocks' host copies may now make room (starved Gets try again next)."""
        self.reclaim()

    def verify(self) -> None:
        check(self.starved_gets >= 0, "a negative count of starved Gets")
        check(all(tier not in self.in_flight for tier in self.searches_cut_short),
              "a tier with a round in flight is still searching for slots")
        self.durable.verify()
        for tier, round_ in self.in_flight.items():
            check(round_.target is tier, "a round in flight to {} is filed under another tier", tier.name)
            check(all(write.target_slot in tier.pool.incoming for write in round_.writes),
                  "a write of the round in flight lost its incoming slot")
            check(len(round_.ok) == len(round_.writes), "one outcome per write of the round")
