"""The prefix index of one namespace: a tree over chained block keys.

Each node is one block (`kvd.core.block.Block`); an edge from a parent to a
child is labelled by the child's key. Because a chained key already commits
to its whole prefix (key[i] = H(key[i-1], tokens[i], ...)), the children of
every node can share one flat dict from key to node: finding the child of
`parent` labelled `key` is `nodes[key]` plus a check that the node's parent
is `parent`. That check is what makes the dict a tree and not a set: a
client that sends keys out of order, or a collision, never matches through
a node that is not on its path.

Path compression (the "radix" part of a radix tree) would buy nothing here:
every block carries its own state (slot, pins, policy links), so a node per
block is needed anyway, and with the flat dict a longest-prefix match is one
dict probe per key, O(prefix length), independent of how many blocks are
stored.

Child links. Besides the dict, every node heads the list of its children
(`first_child`, then `next_sibling` / `prev_sibling`), and the index heads
the list of root blocks (`first_root`), so a subtree (Delete, a loss) or
the whole tree (an EventSnapshot, kvd.core.event_snapshot) is walked in
time proportional to what it holds. A new node goes at the head of its
list and never moves; a removed node is unlinked in O(1) and keeps its
`next_sibling`, so a walk that stopped on it between two event-loop steps
goes on along the nodes after it (those still linked, and those removed
after it, which again lead on).

Invariants (checked by `verify`):
  * every node in `nodes` is WRITABLE, SEALED or LOST and its parent is
    either None (a root block) or another node in `nodes`;
  * a node's child list holds exactly the nodes whose parent it is, and
    the root list exactly those without a parent, each once, with
    `prev_sibling` the mirror of `next_sibling`;
  * a SEALED node never has a WRITABLE ancestor (blocks are sealed after
    their parent, or the whole subtree is aborted together).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from kvd.core.block import Block, BlockState
from kvd.core.keys import KEY_BYTES, PackedKeys
from kvd.invariants import check

try:
    from kvd._native import match_chain as _native_match_chain
except ImportError:  # not built: the same walk in Python (match's loop)
    _native_match_chain = None

if TYPE_CHECKING:
    from kvd.core.quota import TenantQuota


class PrefixIndex:
    __slots__ = ("nodes", "first_root", "name", "block_bytes", "namespace_id", "host_class", "disk_enabled", "quota",
                 "tenant")

    def __init__(self, name: str = "", block_bytes: int = 0, namespace_id: bytes = b"",
                 quota: TenantQuota | None = None) -> None:
        self.nodes: dict[bytes, Block] = {}
        # The newest root block; the others follow through next_sibling.
        self.first_root: Block | None = None
        self.name = name
        self.block_bytes = block_bytes
        self.namespace_id = namespace_id
        # Whether this namespace's blocks are written to the disk tier.
        # The host pool's slot class its blocks take (kvd.core.slot_pool).
        self.host_class = 0
        self.disk_enabled = False
        # The usage and quota of the tenant whose namespace this is; None
        # without tenants (kvd.core.quota).
        self.quota = quota
        # Its tenant's name ("": none), whose host memory its blocks go in.
        self.tenant = quota.name if quota is not None else ""

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self) -> Iterator[Block]:
        return iter(self.nodes.values())

    def get(self, key: bytes) -> Block | None:
        return self.nodes.get(key)

    def match(self, keys: Sequence[bytes], parent: Block | None = None) -> list[Block]:
        """Longest prefix of `keys` stored as sealed blocks under `parent`.

        The hot path of Lookup and Get: one dict probe and two identity
        checks per key. Packed keys (a long Lookup) are walked in native
        code, which stops at the same key with the same result.
        """
        if _native_match_chain is not None and isinstance(keys, PackedKeys):
            return _native_match_chain(self.nodes, keys.data, KEY_BYTES, parent, BlockState.SEALED)
        # map() probes the dict at C speed; the loop only checks links.
        found = list(map(self.nodes.get, keys))
        sealed = BlockState.SEALED
        count = 0
        for node in found:
            if node is None or node.parent is not parent or node.state is not sealed:
                break
            parent = node
            count += 1
        del found[count:]
        return found  # type: ignore[return-value]

    def insert(self, key: bytes, parent: Block | None) -> Block:
        """Add a WRITABLE node for `key` under `parent` (None: a root block)."""
        check(key not in self.nodes, "insert of a key already in the index")
        check(parent is None or self.nodes.get(parent.key) is parent, "insert under a parent not in the index")
        node = Block(key=key, index=self, parent=parent)
        self.nodes[key] = node
        # At the head of its list: a walk already past the head never meets it.
        head = self.first_root if parent is None else parent.first_child
        node.next_sibling = head
        if head is not None:
            head.prev_sibling = node
        if parent is None:
            self.first_root = node
        else:
            parent.first_child = node
        return node

    def remove(self, node: Block) -> Block | None:
        """Remove a leaf node; returns its parent (which may have become a leaf)."""
        check(node.first_child is None, "removal of a node that still has children")
        check(self.nodes.get(node.key) is node, "removal of a node not in the index")
        del self.nodes[node.key]
        node.state = BlockState.REMOVED
        parent = node.parent
        before, after = node.prev_sibling, node.next_sibling
        if before is not None:
            before.next_sibling = after
        elif parent is None:
            check(self.first_root is node, "a root without a predecessor does not head the roots")
            self.first_root = after
        else:
            check(parent.first_child is node, "a child without a predecessor does not head its siblings")
            parent.first_child = after
        if after is not None:
            after.prev_sibling = before
        # next_sibling stays: see the module docstring (a walk may hold this node).
        node.prev_sibling = None
        node.parent = None
        return parent

    def subtree(self, node: Block) -> list[Block]:
        """`node` and all its descendants, leaves first (a removal order).

        A walk of the child lists: O(size of the subtree), whatever the
        index holds (Delete, aborts and losses pay for what they remove).
        """
        order: list[Block] = []
        pending = [node]
        while pending:
            current = pending.pop()
            order.append(current)
            child = current.first_child
            while child is not None:
                pending.append(child)
                child = child.next_sibling
        # Preorder puts every node before its descendants; reversed, after them.
        order.reverse()
        check(order[-1] is node, "a subtree's walk ends at its own root")
        return order

    def verify(self) -> None:
        counts: dict[int, int] = {}
        roots = 0
        for key, node in self.nodes.items():
            check(node.key == key, "node stored under a different key")
            check(node.index is self, "node of another index")
            check(node.state in (BlockState.WRITABLE, BlockState.SEALED, BlockState.LOST), "{!r} in the index", node)
            check(node.ref_count >= 0, "{!r} has a negative ref count", node)
            parent = node.parent
            if parent is None:
                roots += 1
                continue
            check(self.nodes.get(parent.key) is parent, "{!r} has a parent outside the index", node)
            counts[id(parent)] = counts.get(id(parent), 0) + 1
            if node.state == BlockState.SEALED:
                check(parent.state == BlockState.SEALED, "sealed {!r} under writable {!r}", node, parent)
        check(self._verify_list(self.first_root, None) == roots, "the root list misses roots")
        for node in self.nodes.values():
            check(self._verify_list(node.first_child, node) == counts.get(id(node), 0),
                  "{!r}: its child list misses children", node)

    def _verify_list(self, head: Block | None, parent: Block | None) -> int:
        """The length of a sibling list whose members must all be in the index
        under `parent`, linked both ways."""
        length = 0
        before = None
        node = head
        while node is not None:
            length += 1
            check(length <= len(self.nodes), "a sibling list loops")
            check(self.nodes.get(node.key) is node, "{!r} is linked but not in the index", node)
            check(node.parent is parent, "{!r} is linked under another parent", node)
            check(node.prev_sibling is before, "{!r}: prev_sibling disagrees with next_sibling", node)
            before, node = node, node.next_sibling
        return length
