"""Tenants files, the token table and the auth settings (kvd.config, kvd.server.auth)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest

from kvd import config
from kvd.config import load_tenants
from kvd.core.keys import NamespaceSpec
from kvd.errors import ConfigError, InvalidArgument
from kvd.server import auth
from kvd.server.auth import Tenant, TokenTable, bearer_token, scoped_client_id
from kvd.tiers.disk.registry import decode_spec

TOKEN_A = "token-of-team-a-0123456789"
TOKEN_B = "token-of-team-b-0123456789"


def sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def write(tmp_path, text: str, name: str = "tenants.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_a_tenants_file_in_toml(tmp_path):
    path = write(tmp_path, f"""
[[tenants]]
name = "team-a"
token_sha256 = ["{sha(TOKEN_A)}", "{sha("rotated-token-0123456789")}"]
namespaces = ["meta-llama/*"]
host_bytes = "2GiB"
disk_bytes = 1048576

[[tenants]]
name = "ops"
token_env = "OPS_TOKEN"
namespaces = []
admin = true
""")
    team, ops = load_tenants(path, env={"OPS_TOKEN": TOKEN_B})
    assert (team.name, team.namespaces, team.host_bytes, team.disk_bytes, team.admin) == (
        "team-a", ("meta-llama/*",), 2 << 30, 1 << 20, False)
    assert len(team.token_digests) == 2
    assert (ops.name, ops.namespaces, ops.admin, ops.token_digests) == (
        "ops", (), True, (hashlib.sha256(TOKEN_B.encode()).digest(),))
    # Digests stay out of reprs (and so out of any log line that prints one).
    assert sha(TOKEN_A) not in repr(team) and "digest" not in repr(team)


def test_a_tenants_file_in_json(tmp_path):
    path = write(tmp_path, json.dumps({"tenants": [{"name": "a", "token_sha256": sha(TOKEN_A), "namespaces": ["*"]}]}),
                 name="tenants.json")
    (tenant,) = load_tenants(path, env={})
    assert tenant.name == "a" and tenant.namespaces == ("*",)


@pytest.mark.parametrize(
    ("entries", "env", "message"),
    [
        ('name = "a"\ntoken = "x"\nnamespaces = []', {}, "plain `token`"),
        ('name = "a"\nnamespaces = []', {}, "has no token"),
        ('name = "a b"\nnamespaces = []', {}, "name must match"),
        ('name = "a"\ntoken_sha256 = "abc"\nnamespaces = []', {}, "64 hex digits"),
        ('name = "a"\ntoken_env = "T"\nnamespaces = []', {}, "T is not set"),
        ('name = "a"\ntoken_env = "T"\nnamespaces = []', {"T": "short"}, "fewer than 16"),
        (f'name = "a"\ntoken_sha256 = "{sha(TOKEN_A)}"', {}, "namespaces must be a list"),
        (f'name = "a"\ntoken_sha256 = "{sha(TOKEN_A)}"\nnamespaces = []\nquota = 1', {}, "unknown key 'quota'"),
        (f'name = "a"\ntoken_sha256 = "{sha(TOKEN_A)}"\nnamespaces = []\nhost_bytes = "lots"', {}, "byte size"),
        (f'name = "a"\ntoken_sha256 = "{sha(TOKEN_A)}"\nnamespaces = []\nadmin = "yes"', {}, "admin must be"),
    ],
)
def test_mistakes_in_a_tenant_name_the_tenant_and_the_key(tmp_path, entries, env, message):
    path = write(tmp_path, "[[tenants]]\n" + entries + "\n")
    with pytest.raises(ConfigError, match=message) as error:
        load_tenants(path, env=env)
    assert error.value.field.startswith("auth.tenants_file") or "tenants[0]" in str(error.value)
    assert "tenants[0]" in str(error.value)


def test_an_error_never_shows_a_token(tmp_path):
    path = write(tmp_path, '[[tenants]]\nname = "a"\ntoken = "secret-token-value"\nnamespaces = []\n')
    with pytest.raises(ConfigError) as error:
        load_tenants(path, env={})
    assert "secret-token-value" not in str(error.value)
    path = write(tmp_path, '[[tenants]]\nname = "a"\ntoken_env = "T"\nnamespaces = []\n')
    with pytest.raises(ConfigError) as error:
        load_tenants(path, env={"T": "short-secret"})
    assert "short-secret" not in str(error.value)


def test_tenants_must_differ_in_name_and_token(tmp_path):
    entry = '[[tenants]]\nname = "{name}"\ntoken_sha256 = "{digest}"\nnamespaces = []\n'
    same_name = entry.format(name="a", digest=sha(TOKEN_A)) + entry.format(name="a", digest=sha(TOKEN_B))
    with pytest.raises(ConfigError, match="defined twice"):
        load_tenants(write(tmp_path, same_name), env={})
    same_token = entry.format(name="a", digest=sha(TOKEN_A)) + entry.format(name="b", digest=sha(TOKEN_A))
    with pytest.raises(ConfigError, match="'a' and 'b' share a token"):
        load_tenants(write(tmp_path, same_token), env={})
    with pytest.raises(ConfigError, match="defines no tenant"):
        load_tenants(write(tmp_path, "tenants = []\n"), env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_tenants(tmp_path / "missing.toml", env={})


def test_auth_and_tls_settings_are_checked(tmp_path):
    with pytest.raises(ConfigError, match="auth.tenants_file"):
        config.load(env={}, overrides={"auth.mode": "token"})
    with pytest.raises(ConfigError, match="auth.mode"):
        config.load(env={}, overrides={"auth.mode": "password"})
    with pytest.raises(ConfigError, match="server.tls_key_file"):
        config.load(env={}, overrides={"server.tls_cert_file": "cert.pem"})
    with pytest.raises(ConfigError, match="server.tls_client_ca_file"):
        config.load(env={}, overrides={"server.tls_client_ca_file": "ca.pem"})
    with pytest.raises(ConfigError, match="TCP listener"):
        config.load(env={}, overrides={"server.tls_cert_file": "c", "server.tls_key_file": "k",
                                       "server.tcp_address": ""})
    loaded = config.load(env={"KVD_AUTH_MODE": "token", "KVD_AUTH_TENANTS_FILE": "/etc/kvd/tenants.toml"})
    assert (loaded.auth.mode, loaded.auth.tenants_file) == ("token", "/etc/kvd/tenants.toml")


def tenants_table() -> TokenTable:
    tenants = [
        config.TenantSettings("a", (hashlib.sha256(TOKEN_A.encode()).digest(),), ("*",)),
        config.TenantSettings("b", (hashlib.sha256(TOKEN_B.encode()).digest(),), ("llama/*",), admin=True),
    ]
    return TokenTable(tenants)


def test_the_token_table_finds_each_tenant_and_nobody_else():
    table = tenants_table()
    assert table.authenticate(TOKEN_A) == Tenant("a", ("*",), False)
    assert table.authenticate(TOKEN_B).admin
    assert table.authenticate(TOKEN_A + "x") is None
    assert table.authenticate("") is None


def test_every_stored_digest_is_compared_in_constant_time_whichever_matches(monkeypatch):
    compared = []
    real = auth.hmac.compare_digest

    def spy(left, right):
        compared.append((left, right))
        return real(left, right)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    table = tenants_table()
    for token in (TOKEN_A, TOKEN_B, "unknown-token"):
        compared.clear()
        table.authenticate(token)
        # Never an early exit on the first match, never a plain ==.
        assert len(compared) == len(table) == 2
        assert all(left == hashlib.sha256(token.encode()).digest() for left, _ in compared)


@pytest.mark.parametrize(
    ("metadata", "token"),
    [
        ((("authorization", "Bearer abc"),), "abc"),
        ((("x-other", "1"), ("authorization", "bearer  abc ")), "abc"),
        ((("authorization", "Basic abc"),), None),
        ((("authorization", "Bearer "),), None),
        ((("authorization", "Bearer " + "x" * 5000),), None),
        ((), None),
        (None, None),
    ],
)
def test_bearer_tokens_are_read_from_the_authorization_metadata(metadata, token):
    assert bearer_token(metadata) == token


def test_client_ids_are_scoped_by_tenant():
    tenant = Tenant("a", ("*",))
    assert scoped_client_id(tenant, "engine-0") == "a\x00engine-0"
    assert scoped_client_id(None, "engine-0") == "engine-0"
    # Empty stays empty: the engine refuses it where a client id is needed.
    assert scoped_client_id(tenant, "") == scoped_client_id(None, "") == ""
    with pytest.raises(InvalidArgument, match="1..128"):
        scoped_client_id(None, "x" * 129)
    with pytest.raises(InvalidArgument, match="NUL"):
        scoped_client_id(tenant, "b\x00engine-0")


def test_namespace_patterns():
    tenant = Tenant("a", ("meta-llama/*", "gpt2"))
    assert tenant.may_use("meta-llama/Llama-3.1-8B") and tenant.may_use("gpt2")
    assert not tenant.may_use("gpt2-xl") and not tenant.may_use("Meta-Llama/x")
    assert not Tenant("ops", ()).may_use("gpt2")


def test_a_tenants_spec_round_trips_through_the_disk_registry_and_keeps_old_ids():
    spec = NamespaceSpec(model_id="m", num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=4)
    mine = dataclasses.replace(spec, tenant="a")
    assert decode_spec(mine.encode()) == mine
    assert mine.namespace_id() != spec.namespace_id()
    assert mine.without_tenant() == spec and spec.without_tenant() is spec
    # No tenant, no field: the encoding (and every id) of a spec without one is as before.
    assert mine.encode() == spec.encode() + b"\x06tenant\x01\x00\x00\x00a"
    with pytest.raises(InvalidArgument, match="not canonical"):
        decode_spec(spec.encode() + b"\x06tenant\x00\x00\x00\x00")  # an empty tenant is written as none
