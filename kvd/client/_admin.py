"""Namespaces and the operators' calls: RegisterNamespace, Stats (kvd status), Demote
(kvd demote), ListNamespaces (kvd namespaces) and DeleteNamespace (kvd delete --namespace), with
a namespace found by name or id (kvd.client.namespaces). See kvd.client._ops for how an
operation runs."""

from __future__ import annotations

from kvd.client import _wire
from kvd.client._ops import Op, Session
from kvd.client.namespaces import (NamespaceDeleted, NamespaceInfo, NamespaceReference, namespace_infos,
                                   resolve_namespace)
from kvd.core.keys import NamespaceSpec
from kvd.v1 import kvd_pb2


def register_namespace(session: Session, spec: NamespaceSpec) -> Op:
    response = yield ("RegisterNamespace", kvd_pb2.RegisterNamespaceRequest(spec=_wire.spec_message(spec)))
    return _wire.namespace_from(spec, response)


def stats(session: Session) -> Op:
    return (yield ("Stats", kvd_pb2.StatsRequest()))


def demote(session: Session) -> Op:
    return (yield ("Demote", kvd_pb2.DemoteRequest()))


def namespaces(session: Session, tenant: str = "") -> Op:
    response = yield ("ListNamespaces", kvd_pb2.ListNamespacesRequest(tenant=tenant))
    return namespace_infos(response)


def find_namespace(session: Session, name_or_id: str, tenant: str = "") -> Op:
    # Checked before any call: a malformed one is refused without asking the daemon.
    reference = NamespaceReference.parse(name_or_id)
    return resolve_namespace((yield from namespaces(session, tenant)), reference, tenant)


def delete_namespace(session: Session, namespace: str | NamespaceInfo, tenant: str = "") -> Op:
    """DeleteNamespace of the namespace `namespace` names (kvd.client.namespaces), or of that very one."""
    if not isinstance(namespace, NamespaceInfo):
        namespace = yield from find_namespace(session, namespace, tenant)
    response = yield ("DeleteNamespace", kvd_pb2.DeleteNamespaceRequest(daemon_namespace_id=namespace.namespace_id))
    return NamespaceDeleted(namespace, response.deleted, response.pinned)
