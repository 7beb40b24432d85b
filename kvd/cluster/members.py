"""Member records and the view of the cluster one daemon holds.

A member record is what a daemon publishes under its leased etcd key
(`<prefix>members/<node name>`): where to reach it, who it is this time
(`incarnation`, new on every start, so a peer tells a restarted node from
the process it used to talk to), what it can hold, and how a peer's NIXL
agent connects to its own (no memory: what a peer may READ is granted in a
PinBlocks answer, kvd.cluster.nixl_transport). The value is JSON, versioned, and
checked on the way in: a record a peer cannot parse is ignored and logged,
never trusted.

`MemberView` is the set of live members as this daemon last saw it. It is
rebuilt from a snapshot at every (re)join and then moved by watch events;
it calls `on_join` / `on_leave` with each change so that transports and the
directory follow membership without polling. A PUT with a new incarnation
is a leave of the old process followed by a join of the new one.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvd.config import NODE_NAME_RE  # node names become etcd key suffixes and label values
from kvd.invariants import check

log = logging.getLogger("kvd.cluster")

RECORD_VERSION = 1
MAX_RECORD_BYTES = 64 << 10


class RecordError(ValueError):
    """A member record that cannot be parsed or is not valid."""


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    # host:port of the node's cluster service (gRPC).
    address: str
    incarnation: int
    host_capacity_bytes: int = 0
    disk_capacity_bytes: int = 0
    # The NIXL agent's connection metadata (no memory described); b"" without NIXL.
    nixl_metadata: bytes = b""

    def encode(self) -> bytes:
        record = {
            "version": RECORD_VERSION,
            "name": self.name,
            "address": self.address,
            "incarnation": self.incarnation,
            "host_capacity_bytes": self.host_capacity_bytes,
            "disk_capacity_bytes": self.disk_capacity_bytes,
            "nixl_metadata": base64.b64encode(self.nixl_metadata).decode(),
        }
        return json.dumps(record, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Member:
        if len(data) > MAX_RECORD_BYTES:
            raise RecordError(f"record of {len(data)} bytes, at most {MAX_RECORD_BYTES}")
        try:
            record = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise RecordError(f"not JSON: {error}") from None
        if not isinstance(record, dict) or record.get("version") != RECORD_VERSION:
            raise RecordError(f"not a version {RECORD_VERSION} member record")
        try:
            member = cls(
                name=_typed(record, "name", str),
                address=_typed(record, "address", str),
                incarnation=_typed(record, "incarnation", int),
                host_capacity_bytes=_typed(record, "host_capacity_bytes", int),
                disk_capacity_bytes=_typed(record, "disk_capacity_bytes", int),
                nixl_metadata=base64.b64decode(_typed(record, "nixl_metadata", str), validate=True),
            )
        except (ValueError, TypeError) as error:
            raise RecordError(str(error)) from None
        member.validate()
        return member

    def validate(self) -> None:
        if not NODE_NAME_RE.match(self.name):
            raise RecordError(f"node name {self.name!r} is not 1-63 letters, digits, '.', '_' or '-'")
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise RecordError(f"address {self.address!r} is not host:port")
        if self.incarnation <= 0:
            raise RecordError(f"incarnation {self.incarnation} is not positive")
        if self.host_capacity_bytes < 0 or self.disk_capacity_bytes < 0:
            raise RecordError("capacities must not be negative")


def _typed(record: dict, name: str, kind: type):
    value = record.get(name)
    # bool is an int in Python; a record with true for a number is wrong.
    if not isinstance(value, kind) or isinstance(value, bool):
        raise RecordError(f"field {name!r} must be {kind.__name__}, got {value!r}")
    return value


Listener = Callable[[Member], None]


class MemberView:
    """The live members as last seen, with join/leave notifications."""

    def __init__(self, self_name: str, on_join: Listener | None = None, on_leave: Listener | None = None) -> None:
        self.self_name = self_name
        self._members: dict[str, Member] = {}
        self._on_join = on_join or (lambda member: None)
        self._on_leave = on_leave or (lambda member: None)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, name: str) -> bool:
        return name in self._members

    def get(self, name: str) -> Member | None:
        return self._members.get(name)

    def members(self) -> list[Member]:
        return sorted(self._members.values(), key=lambda member: member.name)

    def peers(self) -> list[Member]:
        """Every live member but this daemon."""
        return [member for member in self.members() if member.name != self.self_name]

    def replace(self, members: Iterable[Member]) -> None:
        """Adopt a snapshot: members missing from it leave, new ones join."""
        fresh = {member.name: member for member in members}
        for name in sorted(set(self._members) - set(fresh)):
            self._leave(name)
        for name in sorted(fresh):
            self.put(fresh[name])

    def put(self, member: Member) -> None:
        known = self._members.get(member.name)
        if known == member:
            return
        if known is not None and known.incarnation != member.incarnation:
            self._leave(member.name)
        self._members[member.name] = member
        if known is None or known.incarnation != member.incarnation:
            log.info("member joined", extra={"node": member.name, "address": member.address,
                                             "incarnation": member.incarnation})
            self._on_join(member)
        check(self._members[member.name] is member, "the view holds the member just put")

    def delete(self, name: str) -> None:
        if name in self._members:
            self._leave(name)

    def _leave(self, name: str) -> None:
        member = self._members.pop(name)
        log.info("member left", extra={"node": name, "incarnation": member.incarnation})
        self._on_leave(member)
