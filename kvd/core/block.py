"""Blocks and block handles: the lifecycle every tier shares.

A block is the KV of `block_tokens` tokens for every layer. Its metadata
record (`Block`) lives in the prefix index for as long as some tier holds
its bytes. Lifecycle:

    (free slot) --reserve--> WRITABLE --seal--> SEALED --remove--> REMOVED
                                 \\                                  ^
                                  `---------------abort-------------'

* WRITABLE: reserved by exactly one writer, being filled; not discoverable
  (a Lookup stops before it) and never shared.
* SEALED: immutable, discoverable, shared by any number of readers.
  `ref_count` counts the handles pinning it. At ref_count 0 a sealed block
  with no children sits in its tier's reuse pool: still discoverable, and
  evicted only when its slot is taken for another block (after vLLM's
  cached-free blocks).
* REMOVED: out of the index; the record is dead and its slot is free.

`BlockHandle` is the RAII owner of one reference. Use it as a context
manager or call `release()` (idempotent). A handle that is garbage
collected while still holding its reference is a leak: it is released,
counted in the pool's `leaked_handles`, and fails the test suite.
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvd.invariants import check

if TYPE_CHECKING:
    from kvd.core.radix import PrefixIndex


class BlockState(enum.IntEnum):
    WRITABLE = 1
    SEALED = 2
    REMOVED = 3
    # A tombstone: the block's bytes were found corrupt (or its prefix was),
    # so it is no longer served; it stays in the index only while a lease
    # still pins it or a descendant still hangs under it.
    LOST = 4


NO_SLOT = -1


@dataclass(slots=True, eq=False)
class Block:
    """Metadata of one block. Identity-compared; keep it small (see bench)."""

    key: bytes
    index: PrefixIndex
    parent: Block | None
    state: BlockState = BlockState.WRITABLE
    ref_count: int = 0
    # The block's children in the index, as an intrusive doubly linked list
    # (kvd.core.radix owns the links): its newest child, and the siblings on
    # either side of this block (for a root block: the other roots, whose
    # list the index heads). A leaf has first_child None, an O(1) test the
    # hot paths make; walking a subtree costs its own size. A removed block
    # keeps its next_sibling, so a walk that holds it goes on past it.
    first_child: Block | None = None
    next_sibling: Block | None = None
    prev_sibling: Block | None = None
    # Where its copies are: the global slot id of its copy in the fastest
    # tier that has one, the head of a chain through the tiers' slot pools
    # (kvd.core.residency). One field however many tiers there are.
    slot: int = NO_SLOT
    # Intrusive links owned by the host tier's eviction policy; a block is
    # linked exactly while it is an eviction candidate.
    policy_prev: Block | None = None
    policy_next: Block | None = None
    # A small int the host policy keeps about the block (S3-FIFO: queue,
    # frequency), kept while the block is not a candidate so that a pin
    # does not make the policy forget it. Values stay below 256 (cached
    # ints). The record is 128 bytes (pymalloc size classes are 16 bytes
    # apart; 12 fields fill it): one more field costs 16 B per block.
    policy_state: int = 0

    def child_count(self) -> int:
        """Children in the index: a walk of the child list, O(children) (tests, repr)."""
        count = 0
        child = self.first_child
        while child is not None:
            count += 1
            child = child.next_sibling
        return count

    def __repr__(self) -> str:
        return (
            f"Block({self.key[:6].hex()}, {self.state.name}, refs={self.ref_count}, "
            f"children={self.child_count()}, slot={self.slot})"
        )


class HandleOwner(Protocol):
    """What a handle calls back into (the engine's block pool)."""

    def _seal(self, block: Block) -> None: ...

    def _drop_reference(self, block: Block, *, writer: bool) -> None: ...

    def _count_leak(self) -> None: ...


class BlockHandle:
    """One counted reference to a block, released exactly once."""

    __slots__ = ("_owner", "_block", "_writer", "_released")

    def __init__(self, owner: HandleOwner, block: Block, *, writer: bool) -> None:
        check(block.state != BlockState.REMOVED, "handle to a removed block")
        check(not writer or block.state == BlockState.WRITABLE, "writer handle to a non-writable block")
        self._owner = owner
        self._block = block
        self._writer = writer
        self._released = False

    @property
    def block(self) -> Block:
        check(not self._released, "use of a released handle")
        return self._block

    @property
    def key(self) -> bytes:
        return self._block.key

    @property
    def released(self) -> bool:
        return self._released

    @property
    def writable(self) -> bool:
        return self._writer and not self._released and self._block.state == BlockState.WRITABLE

    def seal(self) -> None:
        """WRITABLE -> SEALED. The handle keeps its (now shared) reference."""
        check(not self._released, "seal of a released handle")
        check(self._writer, "only the writer's handle can seal a block")
        check(self._block.state == BlockState.WRITABLE, "seal of a block in state {}", self._block.state.name)
        self._owner._seal(self._block)

    def release(self) -> None:
        """Drop the reference. Releasing an unsealed writer handle aborts the block."""
        if self._released:
            return
        self._released = True
        self._owner._drop_reference(self._block, writer=self._writer)

    def __enter__(self) -> BlockHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __del__(self) -> None:
        if not getattr(self, "_released", True):
            message = f"leaked block handle for {self._block!r}"
            self._owner._count_leak()
            # Release before warning: under -W error the warning raises, and
            # the reference must not stay pinned forever because of it.
            self.release()
            warnings.warn(message, ResourceWarning, stacklevel=1)
