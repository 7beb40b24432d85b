"""Blocks removed on request: Delete's chains by key, and DeleteNamespace's every block.

One rule for both (`deletable`): a block goes only when nothing pins it (no
lease, no Get, no write to a lower tier in flight: its ref_count is 0) and
it is SEALED (a block being written belongs to its writer; a LOST
tombstone goes by itself when its last pin does), and only after every
block chained under it, so the index never holds a child without its
parent. Every removal is `BlockLifecycle.remove`: the block's copies leave
every tier, a persistent tier's slot waits for its REMOVE record, a REMOVED
event is logged; and each is counted in the host tier's `deleted`.

Making the removals durable on disk is the caller's: the daemon's disk
plane journals them right after each call, before any await
(kvd.planes.disk_writes, journal_deletions).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd.core.block import Block, BlockState
from kvd.core.component import EngineComponent
from kvd.core.namespaces import NamespaceState
from kvd.core.requests import check_keys
from kvd.invariants import check


def deletable(block: Block) -> bool:
    """Whether a Delete may remove `block` (once nothing is chained under it)."""
    return block.ref_count == 0 and block.state == BlockState.SEALED


class Deletes(EngineComponent):
    def delete(self, namespace_id: bytes, keys: Sequence[bytes]) -> tuple[int, int]:
        """Remove blocks and their descendants. Returns (deleted, pinned): pinned counts
        the keys left whole because a block of their subtree is not deletable."""
        state = self.namespaces.namespace(namespace_id)
        check_keys(self.limits, keys, "keys")
        deleted = pinned = 0
        for key in keys:
            node = state.index.get(key)
            if node is None:
                continue
            subtree = state.index.subtree(node)  # leaves first
            if not all(map(deletable, subtree)):
                pinned += 1
                continue
            self.remove(subtree)
            deleted += len(subtree)
        return deleted, pinned

    def delete_namespace(self, namespace_id: bytes) -> NamespaceDeletion:
        """Every block of the namespace now, to be removed a step at a time (NamespaceDeletion)."""
        return NamespaceDeletion(self.namespaces.namespace(namespace_id), self)

    def remove(self, blocks: Sequence[Block]) -> None:
        """Remove deletable blocks, each after every block chained under it."""
        for block in blocks:
            self.blocks.remove(block, cold_parent=False)
        self.host.counters.deleted += len(blocks)


class NamespaceDeletion:
    """The blocks a namespace held when it began, removed leaves first, a bounded step at a time.

    The index lists every block after its parent (a block is inserted only
    under a parent already there, and a parent outlives its children), so
    the blocks taken from the end of that order come leaves first: when a
    block's turn comes, every block of the snapshot under it has had its
    turn. It goes if it is deletable and nothing is chained under it any
    more; otherwise it stays and counts as pinned (a pinned block below
    it, or a block stored under it since the deletion began). Blocks stored
    after it began are not touched. The engine may change between steps:
    a block removed meanwhile (by eviction, a Delete) is skipped.
    """

    def __init__(self, state: NamespaceState, deletes: Deletes) -> None:
        self.state = state
        self._deletes = deletes
        self._pending: list[Block] = list(state.index.nodes.values())
        self.deleted = 0
        self.pinned = 0

    @property
    def done(self) -> bool:
        return not self._pending

    def step(self, step_blocks: int) -> int:
        """Take the next `step_blocks` blocks (at most) and remove those that may go; how many went."""
        check(step_blocks > 0, "a deletion step of {} blocks", step_blocks)
        index = self.state.index
        deleted = 0
        for _ in range(min(step_blocks, len(self._pending))):
            block = self._pending.pop()  # and the list's reference with it
            if block.state == BlockState.REMOVED:
                continue
            check(block.index is index, "{!r} of another namespace in a namespace's deletion", block)
            if block.first_child is not None or not deletable(block):
                self.pinned += 1
                continue
            self._deletes.remove((block,))
            deleted += 1
        self.deleted += deleted
        return deleted
