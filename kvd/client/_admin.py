"""Namespaces and the operators' calls: RegisterNamespace, Stats (kvd status) and Demote
(kvd demote). See kvd.client._ops for how an operation runs."""

from __future__ import annotations

from kvd.client import _wire
from kvd.client._ops import Op, Session
from kvd.core.keys import NamespaceSpec
from kvd.v1 import kvd_pb2


def register_namespace(session: Session, spec: NamespaceSpec) -> Op:
    response = yield ("RegisterNamespace", kvd_pb2.RegisterNamespaceRequest(spec=_wire.spec_message(spec)))
    return _wire.namespace_from(spec, response)


def stats(session: Session) -> Op:
    return (yield ("Stats", kvd_pb2.StatsRequest()))


def demote(session: Session) -> Op:
    return (yield ("Demote", kvd_pb2.DemoteRequest()))
