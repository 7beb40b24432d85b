"""Engine operations that only tests and benchmarks need, composed of the engine's own.

The `Engine` facade (kvd.core.engine) carries what the daemon and the
simulator call. A test often wants a shorter spelling of a common sequence
of those calls (a Get of blocks all in host memory, a read handle on every
block of a prefix, a Demote of everything): each is here, made of public
engine calls only, so it runs exactly the rules the daemon runs and a
proxy that checks the engine after every call (tests/unit/engine_helpers.py's
`Checked`) sees each step.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvd.core.block import Block, BlockHandle
from kvd.core.engine import Engine
from kvd.core.lease import Lease, LeaseTable
from kvd.core.requests import KeysRequest
from kvd.invariants import check


def get(engine: Engine, request: KeysRequest) -> tuple[Lease | None, list[Block]]:
    """A Get of a prefix held in host memory: its read lease (None when nothing
    matched) and the pinned blocks. A prefix with blocks below host memory
    needs the daemon's reads (begin_get, finish_loads, settle_get)."""
    plan = engine.begin_get(request)
    check(not plan.loads and not plan.waits, "get() of a prefix on disk: use begin_get")
    return plan.lease, plan.matched


def acquire(engine: Engine, namespace_id: bytes, keys: Sequence[bytes]) -> list[BlockHandle]:
    """Read handles on the stored prefix of `keys`, no lease and nothing counted;
    the caller releases them."""
    return [engine.pin(block) for block in engine.namespace(namespace_id).index.match(keys)]


def demote_all(engine: Engine) -> tuple[int, int]:
    """Demote every host eviction candidate now, as the Demote RPC does: (blocks, payload bytes)."""
    return engine.demote(engine.host_candidates())


def prefetched(engine: Engine) -> set[Block]:
    """The blocks prefetched into host memory that no Get has used yet (the prefetch ledger's)."""
    return engine.blocks.ledger.blocks


def next_deadline_ms(leases: LeaseTable) -> int | None:
    """The earliest deadline of an open lease (one not closing), None when there is none: the
    deadline expire() would next act on."""
    return min((lease.deadline_ms for lease in leases if not lease.closing), default=None)
