"""S3-FIFO eviction (Yang et al., "FIFO queues are all you need for cache
eviction", SOSP '23): scan-resistant, built from FIFO queues only.

    small (S)  ~10% of the candidates; new blocks enter here
    main  (M)  the rest: blocks used while in S, and blocks whose key was
               evicted from S a short while ago (a ghost hit)
    ghost (G)  keys recently evicted from S; no blocks, no slots

Every candidate has a 2-bit use count (0..3), raised by `touch`. A use
never moves a block. To find a victim:

  * if S holds at least 10% of the candidates (or M is empty), look at
    S's oldest block: used since it entered S -> it moves to M's newest end
    with its count cleared, look again; never used -> it is the victim, and
    its key enters G when it is evicted;
  * otherwise look at M's oldest block: count > 0 -> it goes back to M's
    newest end with count - 1, look again; count 0 -> it is the victim.

So a block used once and never again (one pass of a scan, a prompt nobody
repeats) leaves from S without displacing anything M holds, which LRU
cannot do: under LRU every new block pushes out the least recently used
one, hot or not. S -> M needs one use while in S, and the count is cleared
on the move (libCacheSim's defaults for the SOSP paper).

Fitting kvd's candidate protocol (kvd.core.policy), the choices made:

1. Queue and count outlive candidacy. They live in `Block.policy_state`,
   which `remove` keeps: a Get pins the prefix it serves (its leaf stops
   being a candidate) and the release admits it again into the queue it
   left, at that queue's newest end, count intact. Otherwise every Get
   would reset what the policy learned and a block read again and again
   would look new each time. The newest end, not its old place: the pin
   was a use.
2. Eviction is told apart from other removals by sequence: the `remove`
   that directly follows `victim()` for the block it returned (no admit,
   touch or other remove in between, which is how the engine evicts) is an
   eviction. The block's state is cleared (it is new again if it ever comes
   back) and, if it left from S, its key enters G. Any other `remove`
   (pinned, got a child, deleted, lost) keeps the state.
3. A new block (state 0: never a candidate, or evicted since) enters S,
   or M if its key is in G. In kvd the ghost matters most for demoted
   blocks: a Get soon after a block's host copy was dropped reads it back
   from disk, and it goes straight to M.
4. `cold=True` (the parent of a leaf just evicted: prefixes leave from the
   tail inward) puts the block at S's oldest end, count 0, marked cold;
   `victim()` takes a cold block at S's oldest end before anything else,
   as LRU takes its head. Cold blocks therefore always sit together at
   S's oldest end (verified). A touch of a cold block clears the mark and
   moves it to S's newest end with count 1: it was used after all.
5. The 10% is of the current candidates, not of the host slots. Only
   index leaves are candidates, so with long chains they are a small part
   of the slots; measured against the slots, S would always be under its
   share and M (the hot blocks) would be evicted first.
6. `victim()` does the promotion and reinsertion work and returns without
   removing: asked twice, it returns the same block and moves nothing the
   second time. Work is amortized O(1): every step either moves a block
   out of S or spends one unit of a count, and counts only grow by touches.

Memory: no per-block cost. The state is one small int (< 32, a cached int
object) in a slot that fills the Block record to exactly its pymalloc size
class (bench/bench_index_memory.py). The ghost is an insertion-ordered dict
of key objects to their namespace's id (both shared with the block while it
is still indexed, as a demoted block is; a key alone is not unique, as two
tenants' namespaces hold their clients' identical keys), bounded to 90% of the host slots as in the paper: its
size follows the tier's capacity, not the number of indexed blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from kvd.core.block import Block
from kvd.core.policy.links import BlockList
from kvd.invariants import check

# Layout of Block.policy_state.
FREQUENCY = 0b00011  # uses, saturating at FREQUENCY_MAX
MAIN = 0b00100  # in M (or was, when last a candidate)
LINKED = 0b01000  # a candidate: linked into S or M
COLD = 0b10000  # admitted cold: at S's oldest end, evicted first
FREQUENCY_MAX = 3

SMALL_PERCENT = 10
GHOST_PERCENT = 90


class S3FifoPolicy:
    name = "s3fifo"

    def __init__(self, slot_count: int) -> None:
        check(slot_count > 0, "S3-FIFO needs the host slot count")
        self._small = BlockList()
        self._main = BlockList()
        # Keys evicted from S, oldest first, each with its namespace's id:
        # keys are unique within a namespace only (tenants' namespaces share
        # their clients' keys), and a ghost hit is one of the same namespace.
        self._ghost: OrderedDict[bytes, bytes] = OrderedDict()
        self.ghost_limit = max(1, slot_count * GHOST_PERCENT // 100)
        # What victim() last returned, until the next call of any other kind.
        self._victim: Block | None = None

    def __len__(self) -> int:
        return self._small.length + self._main.length

    def __contains__(self, block: Block) -> bool:
        return bool(block.policy_state & LINKED)

    def admit(self, block: Block, *, cold: bool = False) -> None:
        state = block.policy_state
        check(not state & LINKED, "block admitted twice")
        self._victim = None
        recalled = self._ghost.get(block.key) == block.index.namespace_id
        if recalled:
            del self._ghost[block.key]
        if cold:
            block.policy_state = LINKED | COLD
            self._small.push_head(block)
        elif state & MAIN:
            block.policy_state = state | LINKED
            self._main.push_tail(block)
        elif recalled:
            block.policy_state = MAIN | LINKED
            self._main.push_tail(block)
        else:
            block.policy_state = state | LINKED
            self._small.push_tail(block)

    def remove(self, block: Block) -> None:
        state = block.policy_state
        check(state & LINKED, "removal of a block that is not a candidate")
        (self._main if state & MAIN else self._small).unlink(block)
        if block is self._victim:
            if not state & MAIN:
                self._remember(block)
            block.policy_state = 0
        else:
            block.policy_state = state & (FREQUENCY | MAIN)
        self._victim = None

    def touch(self, block: Block) -> None:
        state = block.policy_state
        check(state & LINKED, "touch of a block that is not a candidate")
        self._victim = None
        if state & COLD:
            self._small.unlink(block)
            block.policy_state = LINKED | 1
            self._small.push_tail(block)
        elif state & FREQUENCY < FREQUENCY_MAX:
            block.policy_state = state + 1

    def victim(self) -> Block | None:
        small, main = self._small, self._main
        while True:
            head = small.head
            if head is not None and (
                head.policy_state & COLD
                or main.length == 0
                or small.length * 100 >= SMALL_PERCENT * (small.length + main.length)
            ):
                if head.policy_state & FREQUENCY:
                    small.unlink(head)
                    head.policy_state = MAIN | LINKED
                    main.push_tail(head)
                    continue
                self._victim = head
                return head
            head = main.head
            if head is None:
                return None
            state = head.policy_state
            if state & FREQUENCY:
                main.unlink(head)
                head.policy_state = state - 1
                main.push_tail(head)
                continue
            self._victim = head
            return head

    def victim_near(self, prefer: Callable[[Block], bool], window: int, weight: Callable[[Block], int]) -> Block | None:
        """Only blocks no Get has used since they entered their queue qualify:
        a used one would be moved on, not evicted, when it came to the head."""
        victim = self.victim()
        block = victim
        while block is not None and window > 0:
            if prefer(block) and not block.policy_state & FREQUENCY:
                self._victim = block  # evicted as the victim: S's go to the ghost queue
                return block
            window -= weight(block)
            block = block.policy_next
        return victim

    def _remember(self, block: Block) -> None:
        ghost = self._ghost
        ghost[block.key] = block.index.namespace_id
        if len(ghost) > self.ghost_limit:
            ghost.popitem(last=False)

    # ------------------------------------------------------------------
    # For tests and verify

    def order(self) -> list[Block]:
        """Candidates: S then M, each oldest first. Not exactly the eviction
        order (victim() may move blocks from S to M, or around M, first)."""
        return [*self._small, *self._main]

    def queues(self) -> tuple[list[Block], list[Block]]:
        """(S, M), each oldest first."""
        return list(self._small), list(self._main)

    def verify(self) -> None:
        small = self._small.verify("S3-FIFO small")
        main = self._main.verify("S3-FIFO main")
        ghost = self._ghost
        warm_seen = False
        for block in small:
            state = block.policy_state
            check(state & (LINKED | MAIN) == LINKED, "{!r} in S with state {:#x}", block, state)
            if state & COLD:
                check(not warm_seen, "cold {!r} behind a warm block in S", block)
                check(not state & FREQUENCY, "cold {!r} has uses", block)
            else:
                warm_seen = True
        for block in main:
            state = block.policy_state
            check(state & (LINKED | MAIN | COLD) == LINKED | MAIN, "{!r} in M with state {:#x}", block, state)
        for block in (*small, *main):
            check(ghost.get(block.key) != block.index.namespace_id, "candidate {!r} is also a ghost", block)
        check(len(ghost) <= self.ghost_limit, "ghost holds {} keys, limit {}", len(ghost), self.ghost_limit)
