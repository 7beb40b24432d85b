"""Durable waits: when a block a client asked to be durable may be acknowledged, without I/O.

A block is durable once its data and the record that points to it have
both been synced on the drive. When that happens depends on disk.fsync:

* strict: every write chunk is synced before its outcome is known, so a
  block with a disk copy is durable, and a written block at once;
* group: writes are synced by the group commit. The blocks written since
  the last commit are kept here with the sync epoch they were written in;
  a client waiting on one waits for a commit that covers that epoch, and
  asks for it to run now (`commit_due`) rather than at the next tick;
* none: nothing is synced unless a client waits. Nothing is tracked: a
  block with a disk copy may be unsynced, so a wait on it asks for a
  commit, and is answered by the first one that begins after it.

A commit is `begin_sync` (the epoch it covers: every write finished
before it began), then the driver's sync, then `end_sync` with the
drives whose sync failed. The driver runs at most one at a time.

Every waited block is pinned by the wait until it is answered, so its
disk copy cannot move meanwhile: only a Delete or a loss removes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, NamedTuple, TypeVar

from kvd.core.block import NO_SLOT, Block, BlockHandle, BlockState
from kvd.core.transfer import Transfer
from kvd.invariants import check

if TYPE_CHECKING:
    from kvd.core.engine import Engine

SYNC_POLICIES = ("strict", "group", "none")
Token = TypeVar("Token")


@dataclass(frozen=True, slots=True)
class NotDurable:
    """Why one block a client wants durable is not: a gRPC status name and words."""

    block: Block
    code: str
    reason: str


@dataclass(frozen=True, slots=True)
class SyncWait(Generic[Token]):
    """A token waiting for the commit that covers `epoch`; the block's disk slot when it began."""

    token: Token
    epoch: int
    slot: int


class Started(NamedTuple, Generic[Token]):
    """Durable waits begun: each block's token, the failures known at once, the pins to release
    when the call is over, and whether a client now waits for a commit (run one now)."""

    waiting: dict[Block, Token]
    failures: list[NotDurable]
    pins: list[BlockHandle]
    commit_due: bool


class DurableWaits(Generic[Token]):
    """The blocks clients wait on to be durable; one token (a future, a simulated request) per wait and block."""

    def __init__(self, engine: Engine, admission_reason: Callable[[Block], str], sync: str = "strict") -> None:
        check(sync in SYNC_POLICIES, "sync policy must be one of {}, got {!r}", SYNC_POLICIES, sync)
        self.engine = engine
        # Why the disk tier does not take a block's namespace (its data plane knows).
        self.admission_reason = admission_reason
        self.sync = sync
        # Blocks not on disk yet -> their tokens.
        self.waiting: dict[Block, list[Token]] = {}
        # Blocks on disk, not yet covered by a commit -> their tokens.
        self.syncing: dict[Block, list[SyncWait[Token]]] = {}
        # group: blocks written since the commit that covered them began -> their epoch.
        self.unsynced: dict[Block, int] = {}
        # Commits begun so far; a write finished now belongs to epoch `epoch`.
        self.epoch = 0
        self.sync_in_flight = False

    def __len__(self) -> int:
        return len(self.waiting) + len(self.syncing)

    def start(self, blocks: Iterable[Block], drives_down: str, token: Callable[[Block], Token]) -> Started[Token]:
        """Wait on the blocks not yet durable (see Started).

        The blocks waited for stay pinned until the caller releases the
        pins: otherwise host eviction could drop one before the writer
        reaches it. Their chains' missing ancestors are queued for writing
        (engine.require_durable). `drives_down` says why no drive takes
        writes ("" when one does): then every wait fails at once.
        """
        engine = self.engine
        started: dict[Block, Token] = {}
        failures: list[NotDurable] = []
        pins: list[BlockHandle] = []
        unwritten: list[Block] = []
        for block in blocks:
            slot = engine.disk_slot(block)
            epoch = self._epoch_of(block) if slot != NO_SLOT else None
            if block in started or (slot != NO_SLOT and epoch is None):
                continue
            if drives_down:
                failures.append(NotDurable(block, "UNAVAILABLE", drives_down))
                continue
            if slot == NO_SLOT and (block.state != BlockState.SEALED or not block.index.disk_enabled):
                failures.append(self.why_not(block))
                continue
            pins.append(engine.pin(block))
            started[block] = token(block)
            if slot == NO_SLOT:
                self.waiting.setdefault(block, []).append(started[block])
                unwritten.append(block)
            else:
                self.syncing.setdefault(block, []).append(SyncWait(started[block], epoch, slot))
        engine.require_durable(unwritten)
        return Started(started, failures, pins, self.commit_due())

    def finish(self, pins: Sequence[BlockHandle]) -> None:
        """A durable call is over (answered, timed out or cancelled): the pins start gave it end."""
        for pin in pins:
            pin.release()

    def _epoch_of(self, block: Block) -> int | None:
        """The epoch a commit must cover for `block`'s disk copy to be durable; None: it is."""
        if self.sync == "strict":
            return None
        if self.sync == "group":
            return self.unsynced.get(block)
        return self.epoch  # none: unknown, so the next commit to begin

    def written(self, writes: Sequence[Transfer], ok: Sequence[bool]) -> list[tuple[Token, NotDurable | None]]:
        """After a round: the outcome for each token waiting on one of its blocks
        (under group and none, written blocks wait on for their commit)."""
        outcomes = []
        for write, good in zip(writes, ok, strict=True):
            landed = self.engine.disk_slot(write.block) == write.target_slot
            if landed and self.sync == "group":
                self.unsynced[write.block] = self.epoch
            tokens = self.waiting.pop(write.block, [])
            if not tokens:
                continue
            if landed and self.sync != "strict":
                waits = [SyncWait(token, self.epoch, write.target_slot) for token in tokens]
                self.syncing.setdefault(write.block, []).extend(waits)
                continue
            if landed:
                failure = None
            elif good:
                failure = self.why_not(write.block)  # written, then lost (its parent, a Delete)
            else:
                failure = NotDurable(write.block, "UNAVAILABLE", "the disk write failed (an I/O error on the drive; "
                                     "see kvd_disk_failures_total and the daemon log)")
            outcomes.extend((token, failure) for token in tokens)
        return outcomes

    # -- commits -------------------------------------------------------------

    def commit_due(self) -> bool:
        """Whether a client waits for a commit (run one now, not at the next tick)."""
        return bool(self.syncing)

    def begin_sync(self) -> int:
        """A commit begins: it covers every write finished before now (the epoch it returns)."""
        check(not self.sync_in_flight, "a commit begun while another is in flight")
        self.sync_in_flight = True
        self.epoch += 1
        return self.epoch - 1

    def end_sync(self, covered: int, failed: Callable[[int], str]) -> list[tuple[Token, NotDurable | None]]:
        """The commit of epoch `covered` is over; `failed(slot)` says why a disk slot's drive
        did not sync ("" when it did). The outcome for each wait it answers."""
        check(self.sync_in_flight and covered == self.epoch - 1, "the end of a commit that is not in flight")
        self.sync_in_flight = False
        engine = self.engine
        for block in [block for block, epoch in self.unsynced.items() if epoch <= covered]:
            slot = engine.disk_slot(block)
            if slot == NO_SLOT or not failed(slot):
                del self.unsynced[block]
        outcomes = []
        for block in list(self.syncing):
            waits = self.syncing[block]
            answered = [wait for wait in waits if wait.epoch <= covered]
            if not answered:
                continue
            self.syncing[block] = [wait for wait in waits if wait.epoch > covered]
            if not self.syncing[block]:
                del self.syncing[block]
            for wait in answered:
                outcomes.append((wait.token, self._synced(block, wait.slot, failed)))
        return outcomes

    def _synced(self, block: Block, slot: int, failed: Callable[[int], str]) -> NotDurable | None:
        if self.engine.disk_slot(block) != slot:
            return NotDurable(block, "UNAVAILABLE", "its disk copy was removed (deleted or lost) before it was synced")
        reason = failed(slot)
        return NotDurable(block, "UNAVAILABLE", f"the drive's sync failed: {reason}") if reason else None

    # -- failures --------------------------------------------------------------

    def unwritable(self, picked: Sequence[Transfer]) -> list[tuple[Token, NotDurable]]:
        """Waits on blocks that will never be written, failed now rather than
        at their deadline: neither picked for this round nor still queued
        (dropped because their parent has no durable copy, lost, never queued)."""
        if not self.waiting:
            return []
        engine = self.engine
        picked_blocks = {write.block for write in picked}
        queued = engine.write_queue  # (membership in O(1): kvd.core.write_queue)
        outcomes = []
        for block in [block for block in self.waiting if engine.disk_slot(block) == NO_SLOT]:
            if block not in picked_blocks and block not in queued:
                failure = self.why_not(block)
                outcomes.extend((token, failure) for token in self.waiting.pop(block))
        return outcomes

    def why_not(self, block: Block) -> NotDurable:
        """Why a block that is not on disk never will be, from what the engine holds now."""
        engine = self.engine
        parent = block.parent
        quota = block.index.quota
        if block.state != BlockState.SEALED:
            return NotDurable(block, "UNAVAILABLE", "it was deleted or lost before it reached disk")
        if not block.index.disk_enabled:
            return NotDurable(block, "FAILED_PRECONDITION",
                              f"its namespace cannot go to disk: {self.admission_reason(block)}")
        if parent is not None and engine.disk_slot(parent) == NO_SLOT:
            return NotDurable(block, "UNAVAILABLE", "its parent block could not be made durable (a block is only "
                              "ever on disk with its whole prefix)")
        if quota is not None and quota.disk_full(engine.disk.pool.class_for(block.index.block_bytes).slot_bytes):
            return NotDurable(block, "RESOURCE_EXHAUSTED", f"tenant {quota.name!r} is at its disk quota")
        if engine.host_slot(block) == NO_SLOT:
            return NotDurable(block, "UNAVAILABLE", "it left host memory before it was written")
        return NotDurable(block, "RESOURCE_EXHAUSTED", "no disk slot could be freed for it (the disk tier is "
                          "full of blocks being read or written)")

    def verify(self) -> None:
        for block, tokens in self.waiting.items():
            check(bool(tokens), "{!r} is waited on by nobody", block)
        for block, waits in self.syncing.items():
            check(bool(waits), "{!r} waits for a commit for nobody", block)
            check(all(wait.epoch <= self.epoch for wait in waits), "{!r} waits for a commit of the future", block)
            check(block.ref_count > 0, "{!r} waits for its commit unpinned", block)
        check(all(epoch <= self.epoch for epoch in self.unsynced.values()), "a block written in a future epoch")
