"""Recovery: index what the disk tier found at start.

The disk tier replays its journal (kvd.tiers.disk) and hands over, per
namespace, (key, parent key, slot) records. Parents are indexed before
children whatever the record order; a block whose parent is not on disk,
or whose slot is invalid or taken, is dropped and its slot queued for a
REMOVE, so recovery never leaves an orphan that a replay could pair with
other bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvd.core.block import BlockState
from kvd.core.blocks import BlockLifecycle
from kvd.core.namespaces import NamespaceTable
from kvd.core.slot_pool import NO_CLASS
from kvd.core.tier import TierId
from kvd.invariants import check


class Recovery:
    def __init__(self, namespaces: NamespaceTable, blocks: BlockLifecycle) -> None:
        self.namespaces = namespaces
        self.blocks = blocks
        self.disk = blocks.disk

    def recover(self, namespace_id: bytes, records: Iterable[tuple[bytes, bytes, int]]) -> int:
        """Index blocks found on disk: (key, parent key or b"", disk slot).

        Parents are inserted before children whatever the record order. A
        block whose parent is not on disk, or whose slot is invalid or taken,
        is dropped: its slot is queued for a REMOVE. Returns blocks indexed.
        """
        state = self.namespaces.namespace(namespace_id)
        disk = self.disk
        check(disk is not None, "recover without a disk tier")
        index = state.index
        pending = {key: (parent_key, slot) for key, parent_key, slot in records}
        recovered = 0

        def drop(key: bytes, slot: int) -> None:
            disk.counters.recovery_dropped += 1
            if 0 <= slot < disk.slot_count and disk.pool.owners[slot] is None and slot not in disk.pool.retired:
                disk.pool.forget(slot, namespace_id, key)

        for start in list(pending):
            # Walk up to the first ancestor already indexed (or a root), then
            # insert downwards: iterative, chains can be thousands long.
            chain = []
            key = start
            while key in pending and key not in index.nodes:
                chain.append(key)
                parent_key = pending[key][0]
                if not parent_key or parent_key in index.nodes:
                    break
                key = parent_key
            for key in reversed(chain):
                parent_key, slot = pending.pop(key)
                parent = index.nodes.get(parent_key) if parent_key else None
                if (parent_key and (parent is None or parent.state != BlockState.SEALED)) or not self._place(slot):
                    drop(key, slot)
                    continue
                block = index.insert(key, parent)
                block.state = BlockState.SEALED
                disk.pool.assign(slot, block)
                self.blocks.tiers.add_copy(block, disk, slot)
                disk.pool.used_bytes += state.block_bytes
                if state.quota is not None:
                    state.quota.disk_used_bytes += disk.pool.slot_bytes_of(slot)
                recovered += 1
                self.blocks.events.stored(namespace_id, [key], parent_key, TierId.DISK)
            if start in pending:
                # Its chain reached a key neither indexed nor recorded.
                parent_key, slot = pending.pop(start)
                drop(start, slot)
        disk.counters.recovered += recovered
        disk.pool.rebuild_free()
        return recovered

    def _place(self, slot: int) -> bool:
        """Whether a recovered block may take disk `slot`: in range, free, and
        in a page of its class (an unassigned page is given to that class)."""
        pool = self.disk.pool
        if not (0 <= slot < pool.slot_count and pool.owners[slot] is None
                and slot not in pool.quarantine and slot not in pool.retired):
            return False
        if len(pool.classes) == 1:
            return True
        page, wanted = pool.page_of(slot), pool.class_of(slot)
        if pool.page_class[page] == NO_CLASS and page not in pool.retired_pages:
            pool.assign_page(page, wanted)
        return pool.page_class[page] == wanted.index

    def retire_disk_pages(self, pages: Sequence[int]) -> None:
        """Never use these disk pages (a drive out of service); call before recover."""
        check(self.disk is not None, "retire_disk_pages without a disk tier")
        self.disk.pool.retire_pages(pages)

