"""Tenants (auth.mode = "token"): the tenants file and its checks.

The tenants file, TOML, or JSON when its name ends in .json:

    [[tenants]]
    name = "team-a"                      # [A-Za-z0-9][A-Za-z0-9_.-]{0,63}
    token_sha256 = "9f86d08..."          # SHA-256 of the token, hex; a list while rotating
    token_env = "KVD_TOKEN_TEAM_A"       # and/or: an environment variable holding the token
    namespaces = ["meta-llama/*"]        # model ids it may register (glob patterns; "*": any)
    host_bytes = "8GiB"                  # host memory quota (0 or absent: none)
    disk_bytes = "200GiB"                # disk quota (0 or absent: none)
    admin = false                        # may call administrative RPCs (Stats)

Tokens themselves are never stored in the file and never printed: errors
name the tenant and the key, never a value.
"""

from __future__ import annotations

import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvd.config.values import parse_size
from kvd.errors import ConfigError

TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# A token from the environment must be at least this long (`kvd token` makes
# 43 characters: 32 random bytes).
MIN_TOKEN_CHARS = 16
_TENANT_KEYS = ("name", "token_sha256", "token_env", "namespaces", "host_bytes", "disk_bytes", "admin")


@dataclass(frozen=True, slots=True)
class TenantSettings:
    name: str
    # SHA-256 digests of the tenant's tokens (more than one while rotating).
    token_digests: tuple[bytes, ...] = field(repr=False)
    # Glob patterns over model ids (fnmatch, case-sensitive); "*" is any.
    namespaces: tuple[str, ...] = ()
    host_bytes: int = 0
    disk_bytes: int = 0
    admin: bool = False


def load_tenants(path: str | Path, env: dict[str, str] | None = None) -> list[TenantSettings]:
    """The tenants of the tenants file; ConfigError naming the tenant and key of any mistake."""
    import json

    env = os.environ if env is None else env
    field_name = "auth.tenants_file"
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(field_name, f"cannot read {path}: {error.strerror}") from None
    try:
        document = json.loads(text) if str(path).endswith(".json") else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as error:
        kind = "JSON" if str(path).endswith(".json") else "TOML"
        raise ConfigError(field_name, f"{path} is not valid {kind}: {error}") from None
    if not isinstance(document, dict) or set(document) != {"tenants"} or not isinstance(document["tenants"], list):
        raise ConfigError(field_name, f"{path} must hold exactly one list, `tenants` ([[tenants]] tables in TOML)")
    tenants: list[TenantSettings] = []
    owner_of_digest: dict[bytes, str] = {}
    for position, entry in enumerate(document["tenants"]):
        tenant = _tenant(f"{path}: tenants[{position}]", entry, env)
        if any(other.name == tenant.name for other in tenants):
            raise ConfigError(field_name, f"{path}: tenant {tenant.name!r} is defined twice")
        for digest in tenant.token_digests:
            if digest in owner_of_digest:
                raise ConfigError(
                    field_name, f"{path}: tenants {owner_of_digest[digest]!r} and {tenant.name!r} share a token"
                )
            owner_of_digest[digest] = tenant.name
        tenants.append(tenant)
    if not tenants:
        raise ConfigError(field_name, f"{path} defines no tenant: with auth.mode = \"token\" nobody could connect")
    return tenants


def _token_digests(entry: dict, env: dict[str, str], fail) -> list[bytes]:
    """The SHA-256 digests of a tenant's tokens: listed (token_sha256) or read from the environment (token_env)."""
    import hashlib

    hashes = entry.get("token_sha256", [])
    if isinstance(hashes, str):
        hashes = [hashes]
    if not isinstance(hashes, list):
        raise fail("token_sha256 must be a hex string or a list of them")
    digests = []
    for value in hashes:
        if not isinstance(value, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", value):
            raise fail("token_sha256 must be 64 hex digits (the SHA-256 of the token)")
        digests.append(bytes.fromhex(value))
    variable = entry.get("token_env")
    if variable is not None:
        if not isinstance(variable, str) or not variable:
            raise fail("token_env must name an environment variable")
        token = env.get(variable, "")
        if len(token) < MIN_TOKEN_CHARS:
            state = "is not set" if not token else f"holds fewer than {MIN_TOKEN_CHARS} characters"
            raise fail(f"token_env: the environment variable {variable} {state}")
        digests.append(hashlib.sha256(token.encode()).digest())
    if not digests:
        raise fail("has no token: set token_sha256 or token_env")
    if len(set(digests)) != len(digests):
        raise fail("lists the same token twice")
    return digests


def _tenant(where: str, entry: Any, env: dict[str, str]) -> TenantSettings:
    def fail(message: str) -> ConfigError:
        return ConfigError("auth.tenants_file", f"{where}: {message}")

    if not isinstance(entry, dict):
        raise fail("must be a table")
    name = entry.get("name")
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise fail(f"name must match {TENANT_NAME.pattern}, got {name!r}")
    where = f"{where} ({name})"
    if "token" in entry:
        raise fail("has a plain `token`: store its SHA-256 as token_sha256 (`kvd token` prints both), "
                   "or name an environment variable that holds it with token_env")
    unknown = sorted(set(entry) - set(_TENANT_KEYS))
    if unknown:
        raise fail(f"unknown key {unknown[0]!r} (known: {', '.join(_TENANT_KEYS)})")
    digests = _token_digests(entry, env, fail)
    namespaces = entry.get("namespaces")
    if not isinstance(namespaces, list) or not all(isinstance(item, str) and item for item in namespaces):
        raise fail('namespaces must be a list of model ids or glob patterns (["*"] for any; [] for none)')
    quotas = {}
    for key in ("host_bytes", "disk_bytes"):
        value = parse_size(f"{where}: {key}", entry.get(key, 0))
        if value < 0:
            raise fail(f"{key} must not be negative")
        quotas[key] = value
    admin = entry.get("admin", False)
    if not isinstance(admin, bool):
        raise fail("admin must be true or false")
    return TenantSettings(name, tuple(digests), tuple(namespaces), quotas["host_bytes"], quotas["disk_bytes"], admin)
