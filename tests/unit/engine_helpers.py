"""Helpers of the engine API tests (tests/unit/test_engine*.py).

Keys come from a namespace with one token per block, so a string names a
chain: K("abc") are the keys of the blocks "a", "ab", "abc" and K("abx")[2]
is a sibling of K("abc")[2]. Every engine call goes through `Checked`, which
runs engine.verify() after it, whether the call succeeded or raised. Every
rejected call is made through `rejected`, which also asserts that the
engine's observable state is exactly what it was before. The fixtures that
build such engines (make, env, writing) are in tests/unit/conftest.py.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvd.core.engine import Engine, ReserveStatus
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.errors import KvdError
from kvd.testing.engine_snapshot import snapshot
from kvd.core.requests import CommitRequest, KeysRequest

R, E, F, N = ReserveStatus.RESERVED, ReserveStatus.EXISTS, ReserveStatus.IN_FLIGHT, ReserveStatus.NO_SPACE

SPEC = NamespaceSpec(model_id="engine-test", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
OTHER_SPEC = dataclasses.replace(SPEC, lora_id="adapter")
SLOT_BYTES = 64
LONG = 10_000  # a lease that does not expire within a test


def K(chain: str, spec: NamespaceSpec = SPEC) -> list[bytes]:
    return chain_keys(spec, [ord(ch) for ch in chain])


def k(chain: str) -> bytes:
    """The key of the last block of `chain`."""
    return K(chain)[-1]


class Checked:
    """Proxy that verifies the engine after every call, even a failed one."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __getattr__(self, name: str):
        attribute = getattr(self.engine, name)
        if not callable(attribute) or name == "verify":
            return attribute

        def call(*args, **kwargs):
            try:
                return attribute(*args, **kwargs)
            finally:
                self.engine.verify()

        return call


def rejected(engine: Checked, error: type[KvdError], method: str, *args, match: str | None = None) -> KvdError:
    before = snapshot(engine.engine)
    with pytest.raises(error, match=match) as raised:
        getattr(engine, method)(*args)
    assert type(raised.value) is error
    assert snapshot(engine.engine) == before
    return raised.value


def put(engine: Checked, ns: bytes, chain: str, *, client: str = "writer", now: int = 0):
    """Store `chain` (reserve + commit everything); returns the statuses."""
    result = engine.reserve(KeysRequest(ns, client, K(chain), LONG, now))
    if result.lease is not None:
        engine.commit(CommitRequest(ns, client, result.lease.lease_id, now))
    return result.statuses


def stored(engine: Checked, ns: bytes) -> set[bytes]:
    return set(engine.engine.namespace(ns).index.nodes)


def block(engine: Checked, ns: bytes, chain: str):
    return engine.engine.namespace(ns).index.get(k(chain))


def policy_order(engine: Checked) -> list[bytes]:
    return [b.key for b in engine.engine.host.policy.order()]


def owner_keys(engine: Checked) -> dict[int, bytes]:
    return {slot: owner.key for slot, owner in enumerate(engine.engine.host.pool.owners) if owner is not None}
