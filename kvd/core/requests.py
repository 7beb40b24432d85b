"""What a client asks of the engine, the checks made on it before any state changes, and prefix matching.

`KeysRequest` (a Get, a Put's reserve) and `CommitRequest` carry a call's
arguments by name, so no caller depends on their order. Each check raises a
KvdError subclass (kvd.errors) naming the field that was wrong, so a
rejected request leaves every structure exactly as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvd.core.block import Block, BlockState
from kvd.core.keys import KEY_BYTES, PackedKeys
from kvd.core.lease import LeaseTable
from kvd.core.limits import MAX_CLIENT_ID_CHARS, EngineLimits
from kvd.core.namespaces import NamespaceState
from kvd.core.radix import PrefixIndex
from kvd.errors import FailedPrecondition, InvalidArgument, ResourceExhausted


@dataclass(frozen=True, slots=True)
class KeysRequest:
    """A chain of keys to pin under a lease: a Get's read lease, a reserve's write lease.

    `keys` continue the chain ending at `parent_key` (b"": from the root);
    `lease_ms` asks for a lease length (0: the default), granted within
    the engine's limits from `now_ms`.
    """

    namespace_id: bytes
    client_id: str
    keys: Sequence[bytes]
    lease_ms: int
    now_ms: int
    parent_key: bytes = b""


@dataclass(frozen=True, slots=True)
class CommitRequest:
    """Seal `keys` of a write lease and abort `abort_keys` (both empty: seal all it reserved)."""

    namespace_id: bytes
    client_id: str
    lease_id: int
    now_ms: int
    keys: Sequence[bytes] = ()
    abort_keys: Sequence[bytes] = ()


def check_keys(limits: EngineLimits, keys: Sequence[bytes], field_name: str) -> None:
    packed = isinstance(keys, PackedKeys)  # whole keys by construction; only their count to check
    if len(keys) > limits.max_batch_keys:
        name = "packed_keys" if packed else field_name
        raise InvalidArgument(f"{name} has {len(keys)} keys; at most {limits.max_batch_keys} per call")
    if packed:
        return
    if keys and set(map(len, keys)) == {KEY_BYTES}:
        return
    for position, key in enumerate(keys):
        if len(key) != KEY_BYTES:
            raise InvalidArgument(f"{field_name}[{position}] is {len(key)} bytes; keys are {KEY_BYTES} bytes")


def check_client(client_id: str) -> None:
    if not client_id or len(client_id) > MAX_CLIENT_ID_CHARS:
        raise InvalidArgument(f"client_id must be 1..{MAX_CLIENT_ID_CHARS} characters")


def granted_lease_ms(limits: EngineLimits, requested_ms: int) -> int:
    """The lease a request gets: the default for 0, else what it asked within the limit."""
    if requested_ms == 0:
        return limits.lease_ms_default
    if not 0 < requested_ms <= limits.lease_ms_max:
        raise InvalidArgument(f"lease_ms {requested_ms} is outside (0, {limits.lease_ms_max}]")
    return requested_ms


def check_lease_room(leases: LeaseTable) -> None:
    if leases.full():
        raise ResourceExhausted(f"too many open leases (max {leases.max_leases}); release some first")


def check_parent_key(parent_key: bytes) -> None:
    if parent_key and len(parent_key) != KEY_BYTES:
        raise InvalidArgument(f"parent_key must be empty or {KEY_BYTES} bytes, got {len(parent_key)}")


def match(state: NamespaceState, keys: Sequence[bytes], parent_key: bytes) -> list[Block]:
    """The longest stored prefix of `keys`, a chain continuing `parent_key` (an unknown parent matches nothing)."""
    if not parent_key:
        return state.index.match(keys)
    check_parent_key(parent_key)
    parent = state.index.get(parent_key)
    if parent is None or parent.state != BlockState.SEALED:
        return []
    return state.index.match(keys, parent)


def parent_block(index: PrefixIndex, parent_key: bytes) -> Block | None:
    """The stored block a Put continues (None for a chain from the root)."""
    if not parent_key:
        return None
    check_parent_key(parent_key)
    parent = index.get(parent_key)
    if parent is None or parent.state != BlockState.SEALED:
        raise FailedPrecondition("parent_key is not a stored block; Put the prefix from an earlier point")
    return parent
