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

Invariants (checked by `verify`):
  * every node in `nodes` is WRITABLE or SEALED and its parent is either
    None (a root block) or another node in `nodes`;
  * `children` of a node equals the number of nodes whose parent it is;
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
    __slots__ = ("nodes", "name", "block_bytes", "namespace_id", "host_class", "disk_enabled", "quota", "tenant")

    def __init__(self, name: str = "", block_bytes: int = 0, namespace_id: bytes = b"",
                 quota: TenantQuota | None = None) -> None:
        self.nodes: dict[bytes, Block] = {}
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
        if parent is not None:
            parent.children += 1
        return node

    def remove(self, node: Block) -> Block | None:
        """Remove a leaf node; returns its parent (whose child count dropped)."""
        check(node.children == 0, "removal of a node that still has children")
        check(self.nodes.get(node.key) is node, "removal of a node not in the index")
        del self.nodes[node.key]
        node.state = BlockState.REMOVED
        parent = node.parent
        if parent is not None:
            check(parent.children > 0, "child count underflow")
            parent.children -= 1
        node.parent = None
        return parent

    def subtree(self, node: Block) -> list[Block]:
        """`node` and all its descendants, leaves first (a removal order).

        O(size of the index): used only by Delete and aborts, which are rare;
        the hot paths never walk subtrees.
        """
        if node.children == 0:
            return [node]
        children_of: dict[int, list[Block]] = {}
        for candidate in self.nodes.values():
            if candidate.parent is not None:
                children_of.setdefault(id(candidate.parent), []).append(candidate)
        order: list[Block] = []
        stack = [node]
        while stack:
            current = stack.pop()
            order.append(current)
            stack.extend(children_of.get(id(current), ()))
        order.reverse()
        return order

    def verify(self) -> None:
        counts: dict[int, int] = {}
        for key, node in self.nodes.items():
            check(node.key == key, "node stored under a different key")
            check(node.index is self, "node of another index")
            check(node.state in (BlockState.WRITABLE, BlockState.SEALED, BlockState.LOST), "{!r} in the index", node)
            check(node.ref_count >= 0, "{!r} has a negative ref count", node)
            parent = node.parent
            if parent is not None:
                check(self.nodes.get(parent.key) is parent, "{!r} has a parent outside the index", node)
                counts[id(parent)] = counts.get(id(parent), 0) + 1
                if node.state == BlockState.SEALED:
                    check(parent.state == BlockState.SEALED, "sealed {!r} under writable {!r}", node, parent)
        for node in self.nodes.values():
            check(node.children == counts.get(id(node), 0), "{!r} child count is wrong", node)
