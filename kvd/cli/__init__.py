"""The `kvd` command: serve, status, demote, namespaces, delete, health, config, token, inspect, fsck."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from kvd import __version__
from kvd.errors import ConfigError, KvdError


def _parse_sets(pairs: list[str]) -> dict[str, str]:
    overrides = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise ConfigError(pair, "--set takes name=value, e.g. --set host.capacity_bytes=4GiB")
        overrides[name.strip()] = value
    return overrides


def _load_config(args: argparse.Namespace):
    from kvd import config

    overrides = _parse_sets(args.set or [])
    if getattr(args, "state_dir", None):
        overrides["state_dir"] = args.state_dir
    for flag, name in (("unix_socket", "server.unix_socket"), ("tcp_address", "server.tcp_address"),
                       ("metrics_address", "metrics.address"), ("capacity", "host.capacity_bytes")):
        value = getattr(args, flag, None)
        if value is not None:
            overrides[name] = value
    return config.load(args.config, overrides=overrides)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvd.daemon.lifecycle import serve

    return serve(_load_config(args))


def cmd_config(args: argparse.Namespace) -> int:
    from kvd.config import to_dict

    print(json.dumps(to_dict(_load_config(args)), indent=2))
    return 0


def _admin_token(args: argparse.Namespace) -> str | None:
    """The bearer token of --token-file, else $KVD_TOKEN, else none."""
    token = None
    if args.token_file:
        try:
            token = args.token_file.read_text().strip()
        except OSError as error:
            raise ConnectionError(f"cannot read the token file {args.token_file}: {error.strerror}") from None
    return token or os.environ.get("KVD_TOKEN") or None


def cmd_status(args: argparse.Namespace) -> int:
    from kvd.cli.status import fetch_status, render_status, resolve_target

    target = resolve_target(args.target, args.state_dir)
    status = fetch_status(target, timeout_s=args.timeout, token=_admin_token(args), tls_ca_file=args.tls_ca_file)
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(render_status(status))
    return 0


def cmd_demote(args: argparse.Namespace) -> int:
    """Drop the host copies the disk also holds (the Demote RPC)."""
    from kvd.cli.status import demote, resolve_target

    target = resolve_target(args.target, args.state_dir)
    result = demote(target, timeout_s=args.timeout, token=_admin_token(args), tls_ca_file=args.tls_ca_file)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"demoted {result['blocks_demoted']} blocks ({result['bytes_demoted']} bytes) from host memory; "
              f"{result['blocks_kept']} kept (pinned, in use, or not yet on disk)")
    return 0


def cmd_namespaces(args: argparse.Namespace) -> int:
    """Every namespace, its identity and its blocks per tier (the ListNamespaces RPC)."""
    from kvd.cli.namespaces import admin_client, namespaces_data, render_namespaces
    from kvd.cli.status import resolve_target

    target = resolve_target(args.target, args.state_dir)
    with admin_client(target, _admin_token(args), args.tls_ca_file, args.timeout) as client:
        namespaces = client.namespaces(args.tenant)
    print(json.dumps(namespaces_data(target, namespaces), indent=2) if args.json else render_namespaces(namespaces))
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    """Every block of one namespace, deleted from every tier (the DeleteNamespace RPC)."""
    from kvd.cli.namespaces import admin_client, run_delete
    from kvd.cli.status import resolve_target

    target = resolve_target(args.target, args.state_dir)
    with admin_client(target, _admin_token(args), args.tls_ca_file, args.timeout) as client:
        return run_delete(client, args.namespace, args.tenant, args.yes, args.json)


def cmd_health(args: argparse.Namespace) -> int:
    """Exit 0 when the daemon's gRPC health service says SERVING (no token needed): for exec probes."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvd.cli.status import open_channel, resolve_target

    target = resolve_target(args.target, args.state_dir)
    with open_channel(target, args.tls_ca_file) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="kvd.v1.Kvd"), timeout=args.timeout)
        except grpc.RpcError as error:
            raise ConnectionError(f"cannot reach kvd at {target}: {error.code().name}: {error.details()}") from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    print(status)
    return 0 if response.status == health_pb2.HealthCheckResponse.SERVING else 1


def cmd_token(args: argparse.Namespace) -> int:
    """A new random bearer token, and the SHA-256 the tenants file takes."""
    import hashlib
    import secrets

    token = secrets.token_urlsafe(32)
    digest = hashlib.sha256(token.encode()).hexdigest()
    if args.json:
        print(json.dumps({"token": token, "token_sha256": digest}))
    else:
        print(f"token        {token}")
        print(f"token_sha256 {digest}")
    return 0


def cmd_disk(args: argparse.Namespace) -> int:
    from kvd.tiers.disk.fsck import main

    return main(args.command, args.directories, repair=getattr(args, "repair", False))


def _add_admin_flags(sub: argparse.ArgumentParser, timeout_s: float = 5.0) -> None:
    """The options of the commands that ask a running daemon: where it is, how to authenticate, --json."""
    sub.add_argument("--target", help="unix:///path/kvd.sock or host:port (default: from --state-dir)")
    sub.add_argument("--state-dir", default="state", help="state_dir of the daemon (default: state)")
    sub.add_argument("--timeout", type=float, default=timeout_s,
                     help=f"seconds to wait for the daemon's answer (default: {timeout_s:g})")
    sub.add_argument("--json", action="store_true", help="print JSON instead of text")
    sub.add_argument("--token-file", type=Path,
                     help="file holding an admin tenant's bearer token (auth.mode = token; default: $KVD_TOKEN)")
    sub.add_argument("--tls-ca-file", help="PEM CAs to trust, for a TCP --target with TLS")


def _add_namespace_commands(commands) -> None:
    """`kvd namespaces` and `kvd delete --namespace` (kvd.cli.namespaces)."""
    namespaces = commands.add_parser(
        "namespaces", help="list a running daemon's namespaces: id, tenant, model_id, the identity the engine's "
        "connector recorded, blocks and bytes per tier, hit rate",
        description="List every namespace of a running daemon, one row each: the start of its id, its tenant (when "
        "any has one), its model_id (its name), its blocks in all and per tier (with the bytes of the slots they "
        "take), its hits and misses, and the identity its engine's connector recorded (the spec's model_revision). "
        "--json also gives the full ids and spec. With auth.mode = token it needs an admin's token.")
    _add_admin_flags(namespaces)
    namespaces.add_argument("--tenant", default="", help="only this tenant's namespaces (auth.mode = token)")
    namespaces.set_defaults(handler=cmd_namespaces)

    delete = commands.add_parser(
        "delete", help="delete every block of one namespace from every tier of a running daemon, durably",
        description="Delete every block of one namespace from every tier, as Delete does: answered once no restart "
        "can bring them back. Blocks a lease or a read pins stay (the answer counts them). The namespace stays "
        "registered: engines using it keep working and miss. Without --yes it asks on the terminal, and refuses "
        "(exit 2) when stdin is not one. Exit 1: the daemon refused or could not be reached, or the answer was no.")
    _add_admin_flags(delete, timeout_s=300.0)
    delete.add_argument("--namespace", required=True, metavar="NAME_OR_ID",
                        help="its model_id, its id (64 hex digits) or an id prefix of at least 8, as `kvd namespaces` "
                        "shows them; id:HEX matches ids only. Several matches are an error listing them")
    delete.add_argument("--tenant", default="", help="look only among this tenant's namespaces")
    delete.add_argument("--yes", action="store_true", help="delete without asking")
    delete.set_defaults(handler=cmd_delete)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvd", description="kvd: a per-node KV-cache store for LLM inference.")
    parser.add_argument("--version", action="version", version=f"kvd {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    def add_config_flags(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--config", type=Path, help="TOML config file (overrides the embedded defaults)")
        sub.add_argument("--state-dir", help="directory for sockets and state (state_dir)")
        sub.add_argument("--unix-socket", help="unix socket path, '' disables (server.unix_socket)")
        sub.add_argument("--tcp-address", help="host:port, '' disables (server.tcp_address)")
        sub.add_argument("--metrics-address", help="host:port of /metrics, '' disables (metrics.address)")
        sub.add_argument("--capacity", help="host tier capacity, e.g. 4GiB (host.capacity_bytes)")
        sub.add_argument("--set", action="append", metavar="NAME=VALUE", help="any setting, e.g. leases.max_ms=60000")

    serve = commands.add_parser("serve", help="run the daemon")
    add_config_flags(serve)
    serve.set_defaults(handler=cmd_serve)

    config = commands.add_parser("config", help="print the effective configuration as JSON")
    add_config_flags(config)
    config.set_defaults(handler=cmd_config)

    status = commands.add_parser("status", help="show a running daemon's tiers, disk I/O, leases and pins, events and namespaces")
    _add_admin_flags(status)
    status.set_defaults(handler=cmd_status)

    demote = commands.add_parser("demote", help="drop a running daemon's host copies of blocks the disk also holds")
    _add_admin_flags(demote)
    demote.set_defaults(handler=cmd_demote)

    _add_namespace_commands(commands)

    health = commands.add_parser("health", help="exit 0 when the daemon serves (its gRPC health service); no token needed")
    health.add_argument("--target", help="unix:///path/kvd.sock or host:port (default: from --state-dir)")
    health.add_argument("--state-dir", default="state", help="state_dir of the daemon (default: state)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon")
    health.add_argument("--tls-ca-file", help="PEM CAs to trust, for a TCP --target with TLS")
    health.set_defaults(handler=cmd_health)

    token = commands.add_parser("token", help="make a random bearer token and the token_sha256 of the tenants file")
    token.add_argument("--json", action="store_true", help="print JSON")
    token.set_defaults(handler=cmd_token)

    inspect = commands.add_parser("inspect", help="show disk tier directories: identity, segments, namespaces")
    inspect.add_argument("directories", nargs="+", metavar="DIR", help="disk tier drive directories")
    inspect.set_defaults(handler=cmd_disk)

    fsck = commands.add_parser("fsck", help="read and verify every block of a disk tier (daemon stopped)")
    fsck.add_argument("directories", nargs="+", metavar="DIR", help="all drive directories, in configured order")
    fsck.add_argument("--repair", action="store_true", help="append REMOVE records for corrupt or unreadable blocks")
    fsck.set_defaults(handler=cmd_disk)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ConfigError as error:
        print(f"kvd: {error}", file=sys.stderr)
        return 2
    except KvdError as error:
        # What the daemon found wrong at start-up (a disk directory written
        # for another layout, no O_DIRECT, a drive too small): a restart
        # will not fix it, so the same exit code as a config error.
        print(f"kvd: cannot start: {error}", file=sys.stderr)
        return 2
    except ConnectionError as error:
        print(f"kvd: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
