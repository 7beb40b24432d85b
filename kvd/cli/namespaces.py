"""`kvd namespaces` and `kvd delete --namespace`: an operator finds an engine's namespace and deletes it.

Both ask the daemon through the client library (kvd.client: ListNamespaces
and DeleteNamespace, admin calls) with `kvd status`'s connection options;
which namespace a NAME_OR_ID names is kvd.client.namespaces's one rule.

Exit codes, as the other commands': 0 done; 1 the daemon could not be
reached or refused the call (a token that is not an admin's, a drive that
could not record the removals), or the deletion was not confirmed at the
prompt; 2 the command line names no namespace, several, or none validly,
or asks to delete without --yes where nobody can confirm (stdin is not a
terminal).
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import grpc

from kvd.cli.status import human_bytes, text_table
from kvd.client import Client, NamespaceDeleted, NamespaceInfo, TlsConfig
from kvd.errors import KvdError

# Exit codes (see the module docstring).
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


@contextlib.contextmanager
def admin_client(target: str, token: str | None, tls_ca_file: str | None, timeout_s: float) -> Iterator[Client]:
    """A client for admin calls; a call the daemon refuses or cannot take is a ConnectionError
    naming its status (main's exit 1), as for `kvd status`."""
    tls = TlsConfig(ca_file=tls_ca_file) if tls_ca_file else None
    with Client(target, token=token, tls=tls, use_shared_memory=False, timeout_s=timeout_s) as client:
        try:
            yield client
        except grpc.RpcError as error:
            raise ConnectionError(f"kvd at {target}: {error.code().name}: {error.details()}") from None


def namespaces_data(target: str, namespaces: list[NamespaceInfo]) -> dict[str, Any]:
    """What `kvd namespaces --json` prints."""
    return {"target": target, "namespaces": [info.to_dict() for info in namespaces]}


def _tier_cell(info: NamespaceInfo, tier: str) -> str:
    usage = info.tier(tier)
    return "-" if usage is None else f"{usage.blocks} ({human_bytes(usage.used_bytes)})"


def render_namespaces(namespaces: list[NamespaceInfo]) -> str:
    """One row per namespace: id prefix, tenant (if any has one), model_id, blocks and bytes per
    tier, hits and misses, and last the identity its engine's connector recorded, in full."""
    if not namespaces:
        return "no namespaces registered"
    tenant_column = any(info.tenant for info in namespaces)
    tiers = list(dict.fromkeys(usage.tier for info in namespaces for usage in info.tiers))
    rows = []
    for info in namespaces:
        requests = info.hits + info.misses
        rows.append([
            info.short_id,
            *([info.tenant or "-"] if tenant_column else []),
            info.name,
            str(info.blocks),
            *(_tier_cell(info, tier) for tier in tiers),
            str(info.hits),
            str(info.misses),
            f"{100.0 * info.hits / requests:.1f}%" if requests else "-",
            info.identity or "-",
        ])
    headers = ["namespace", *(["tenant"] if tenant_column else []), "model_id", "blocks", *tiers, "hits", "misses",
               "hit rate", "identity (model_revision)"]
    return text_table(headers, rows)


def describe_deletion(info: NamespaceInfo) -> str:
    """What a deletion will remove, for the prompt."""
    tiers = ", ".join(f"{usage.tier} {usage.blocks} ({human_bytes(usage.used_bytes)})" for usage in info.tiers)
    return f"namespace {info.describe()}: {info.blocks} blocks; {tiers}"


def confirmed(info: NamespaceInfo, answers: TextIO, prompts: TextIO) -> bool:
    """Whether the person at the terminal says yes to deleting `info`."""
    print(f"delete every block of {describe_deletion(info)}? [y/N] ", end="", file=prompts, flush=True)
    return answers.readline().strip().lower() in ("y", "yes")


def run_delete(client: Client, name_or_id: str, tenant: str, yes: bool, as_json: bool,
               stdin: TextIO = sys.stdin) -> int:
    """`kvd delete --namespace`: find it, confirm unless `yes`, delete; the exit code."""
    try:
        info = client.find_namespace(name_or_id, tenant)
    except KvdError as error:  # malformed, unknown or ambiguous: the command line's fault
        print(f"kvd: {error.message}", file=sys.stderr)
        return EXIT_USAGE
    if not yes:
        if not stdin.isatty():
            print(f"kvd: not deleting {describe_deletion(info)}: pass --yes (stdin is not a terminal to confirm on)",
                  file=sys.stderr)
            return EXIT_USAGE
        if not confirmed(info, stdin, sys.stderr):
            print("kvd: nothing deleted", file=sys.stderr)
            return EXIT_FAILED
    result = client.delete_namespace(info)
    print(deletion_text(result, as_json))
    return EXIT_OK


def deletion_text(result: NamespaceDeleted, as_json: bool) -> str:
    info = result.namespace
    if as_json:
        return json.dumps({"namespace_id": info.namespace_id.hex(), "tenant": info.tenant, "model_id": info.name,
                           "deleted": result.deleted, "pinned": result.pinned})
    kept = (f"; {result.pinned} kept: pinned by a lease, a Get or a write in progress, or stored while it ran "
            "(run it again)" if result.pinned else "")
    return f"deleted {result.deleted} blocks of namespace {info.describe()}{kept}"
