"""What the scheduler side tells the workers each step, and what workers tell it once.

Everything here crosses a process boundary (pickled by vLLM), so it is
plain data: keys are bytes, block ids are lists of ints. The classes
derive from vLLM's when vLLM is installed; without it (kvd's own tests of
the data path) from stand-ins.
"""

from __future__ import annotations

from dataclasses import dataclass, field

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorHandshakeMetadata,
        KVConnectorMetadata,
    )
except ImportError:
    class KVConnectorMetadata:  # type: ignore[no-redef]
        pass

    class KVConnectorHandshakeMetadata:  # type: ignore[no-redef]
        pass

from kvd.core.keys import NamespaceSpec

# vLLM's null block: the block pool's first block, which no request owns (BlockPool.null_block). A
# windowed KV cache group's table holds it where the window has moved on (kvd.connectors.vllm.layout).
NULL_BLOCK = 0


def check_groups(block_ids: list[list[int]], order: str) -> None:
    """block_ids is one list of engine blocks per KV cache group (a flat list is a caller's bug)."""
    if not block_ids or not all(isinstance(group, list) for group in block_ids):
        raise TypeError(f"{order}.block_ids must be one list of block ids per KV cache group, "
                        f"got {type(block_ids[0]).__name__ if block_ids else 'no group'}")


@dataclass(slots=True)
class LoadOrder:
    """Load blocks [first, first + len(block_ids[0])) of a request's chain.

    keys[shard] is the request's chain from the root up to the last block
    to load, in the namespace of that worker shard; block_ids[group] are
    the engine blocks of each KV cache group (one, unless the model is
    hybrid) that receive positions first, first + 1, ... budget_s:
    with a prefill profile, the seconds after which loading them can no
    longer beat computing them: a load not done by then is cut, and vLLM
    computes them (None: no budget, only load_timeout_s).
    """

    req_id: str
    keys: list[list[bytes]]
    first: int
    block_ids: list[list[int]]
    asynchronous: bool
    budget_s: float | None = None

    def __post_init__(self) -> None:
        check_groups(self.block_ids, "LoadOrder")


@dataclass(slots=True)
class SaveOrder:
    """Store the full blocks of a request's chain that kvd lacks.

    keys[shard] is the chain from the root up to the last full block
    computed by the end of this step; block_ids[group][i] holds position i
    in the layers of that KV cache group (one, unless the model is hybrid). The
    worker's Reserve says which of them kvd lacks (the new blocks, and any
    older one kvd lost meanwhile): only those are copied. distance: the
    placement plan's offload distance for the request (-1: every layer),
    which kvd's device tier follows (kvd.connectors.vllm.placement).
    """

    req_id: str
    keys: list[list[bytes]]
    block_ids: list[list[int]]
    distance: int = -1

    def __post_init__(self) -> None:
        check_groups(self.block_ids, "SaveOrder")


@dataclass
class KvdConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadOrder] = field(default_factory=list)
    saves: list[SaveOrder] = field(default_factory=list)
    declined_blocks: int = 0  # hit blocks the load rule left to vLLM since the last step (counted)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


@dataclass
class KvdHandshake(KVConnectorHandshakeMetadata):
    """A worker's namespace, as its registered KV cache defines it.

    The scheduler side looks blocks up in exactly the namespaces the
    workers write, so the identity (layout, ISA, dtype, ...) is decided
    once, where the tensors are seen.
    """

    spec: NamespaceSpec
