"""The deploy/k8s manifests (see test_k8s_manifests.py for how they are rendered and validated) and
auth.

Auth (auth.mode = "token", the base's default): the tenants file of the
Secret kvd-tenants loads with kvd's own loader (kvd.config.load_tenants) and
token table (kvd.server.auth.TokenTable); an overlay made as
docs/operations.md says replaces it with tokens made by the real `kvd token`;
and a real daemon whose tenants file is updated the way the kubelet updates
a mounted Secret takes the new tokens on SIGHUP.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from pathlib import Path

import grpc
import kubernetes_validate
import yaml

from kvd.config import load, load_tenants
from kvd.server.auth import TokenTable
from kvd.testing.daemon import run_daemon
from kvd.v1 import kvd_pb2, kvd_pb2_grpc
from tests.deploy.k8s_helpers import (BASE, DEFAULT_MAX_MAP_COUNT, KUBERNETES_VERSIONS, MAP_COUNT_HEADROOM,
    PLACEHOLDER_DIGEST, ROOT, kvd_token, render, secret_files, with_digests)


def test_auth_is_on_with_the_tenants_file_from_the_secret(rendered):
    """Auth is the base's default, and the tenants file is where the Secret is
    mounted: read-only, a whole directory (a subPath never sees the Secret's
    updates), not inside another volume, readable by kvd's uid."""
    config, pod, container = rendered["config"], rendered["pod"], rendered["container"]
    assert config.auth.mode == "token"
    tenants_file = Path(config.auth.tenants_file)
    assert tenants_file.is_absolute()
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: mount for mount in container["volumeMounts"]}
    mount = mounts[str(tenants_file.parent)]
    assert mount.get("readOnly") is True
    assert "subPath" not in mount and "subPathExpr" not in mount
    for other in mounts:
        assert other == mount["mountPath"] or not tenants_file.parent.is_relative_to(other), other
    secret_volume = volumes[mount["name"]]["secret"]
    secret = rendered["Secret"]
    assert secret_volume["secretName"] == secret["metadata"]["name"]
    assert secret_volume.get("optional", False) is False
    assert "items" not in secret_volume
    assert tenants_file.name in secret_files(secret)
    # The kubelet writes the files root-owned: kvd (uid 1000) reads them as "other".
    assert secret_volume.get("defaultMode", 0o644) & 0o004
    # A stable name: updating the Secret in place reaches the mounted file.
    assert not re.search(r"-[a-z0-9]{10}$", secret["metadata"]["name"])
    # kvd is pid 1 of its container, for `kubectl exec ... -- kill -HUP 1`.
    assert not pod.get("shareProcessNamespace", False)
    assert container["command"][0] == "kvd"
    # With tenants the arena may need one memory mapping per slot.
    slots = config.host.capacity_bytes // config.host.slot_bytes
    assert slots + MAP_COUNT_HEADROOM <= DEFAULT_MAX_MAP_COUNT


def test_the_shipped_tenants_file_loads_and_admits_nobody(rendered, tmp_path):
    """The base's tenants file is in the documented format (kvd's own loader
    takes it, an admin for `kvd status` and a tenant for engines), and its
    digests are placeholders: no token, `kvd token`'s least of all, is known."""
    name = Path(rendered["config"].auth.tenants_file).name
    path = tmp_path / name
    path.write_text(secret_files(rendered["Secret"])[name])
    tenants = load_tenants(path, env={})
    assert [tenant.name for tenant in tenants if tenant.admin] == ["ops"]
    assert any(not tenant.admin and tenant.namespaces for tenant in tenants)
    for tenant in tenants:
        for digest in tenant.token_digests:
            assert PLACEHOLDER_DIGEST.fullmatch(digest.hex()), tenant.name
    assert TokenTable(tenants).authenticate(kvd_token()["token"]) is None


def test_an_overlay_replaces_the_tenants_with_tokens_that_work(tmp_path):
    """The documented way: tokens from `kvd token`, their digests in the
    operator's tenants.toml, an overlay that replaces the Secret's file.
    The Secret keeps its name, so the DaemonSet mounts it; its file loads
    with kvd's loader and authenticates exactly those tokens."""
    tokens = {"ops": kvd_token(), "engines": kvd_token()}
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    (overlay / "tenants.toml").write_text(with_digests(
        (BASE / "tenants.toml").read_text(), {name: [made["token_sha256"]] for name, made in tokens.items()}))
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [os.path.relpath(BASE, overlay)],
        "secretGenerator": [{"name": "kvd-tenants", "behavior": "replace", "files": ["tenants.toml"]}],
    }))
    documents = render(str(overlay))
    (secret,) = [document for document in documents if document["kind"] == "Secret"]
    (daemonset,) = [document for document in documents if document["kind"] == "DaemonSet"]
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(secret, version, strict=True)
    names = [volume["secret"]["secretName"] for volume in daemonset["spec"]["template"]["spec"]["volumes"]
             if "secret" in volume]
    assert names == [secret["metadata"]["name"]] == ["kvd-tenants"]
    path = tmp_path / "tenants.toml"
    path.write_text(secret_files(secret)["tenants.toml"])
    table = TokenTable(load_tenants(path, env={}))
    ops, engines = table.authenticate(tokens["ops"]["token"]), table.authenticate(tokens["engines"]["token"])
    assert (ops.name, ops.admin) == ("ops", True)
    assert (engines.name, engines.admin, engines.may_use("meta-llama/Llama-3.1-8B")) == ("engines", False, True)
    assert table.authenticate(kvd_token()["token"]) is None


class KubeletSecretVolume:
    """A directory laid out as the kubelet lays out a Secret volume
    (AtomicWriter): the data in a timestamped directory, a `..data` symlink
    to it, and each key a symlink through `..data`. An update writes a new
    directory and renames a new `..data` over the old one, atomically."""

    def __init__(self, directory: Path, files: dict[str, str]) -> None:
        self.directory = directory
        self.generation = 0
        directory.mkdir()
        self.update(files)
        for name in files:
            (directory / name).symlink_to(Path("..data") / name)

    def update(self, files: dict[str, str]) -> None:
        self.generation += 1
        data = self.directory / f"..2025_01_01_00_00_00.{self.generation:09d}"
        data.mkdir()
        for name, text in files.items():
            (data / name).write_text(text)
        old = os.readlink(self.directory / "..data") if (self.directory / "..data").is_symlink() else None
        (self.directory / "..data_tmp").symlink_to(data.name)
        os.rename(self.directory / "..data_tmp", self.directory / "..data")
        if old:
            shutil.rmtree(self.directory / old)


def test_a_secret_update_reaches_the_daemon_on_sighup(tmp_path):
    """Rotation as docs/operations.md describes it, against a real daemon
    whose tenants file is the base's, in a Secret volume the kubelet
    updates: the new file alone changes nothing; SIGHUP (kill -HUP 1 in the
    pod) takes it. First old and new token both, then the new one alone."""
    tenants_toml = (BASE / "tenants.toml").read_text()
    ops, old, new = kvd_token(), kvd_token(), kvd_token()

    def file_with(*engine_tokens):
        digests = {"ops": [ops["token_sha256"]], "engines": [made["token_sha256"] for made in engine_tokens]}
        return {"tenants.toml": with_digests(tenants_toml, digests)}

    volume = KubeletSecretVolume(tmp_path / "kvd-tenants", file_with(old))

    def code(daemon, token: str) -> grpc.StatusCode:
        # Stats: OK for an admin, PERMISSION_DENIED for another tenant, UNAUTHENTICATED for a stranger.
        with grpc.insecure_channel(daemon.unix_target) as channel:
            try:
                kvd_pb2_grpc.KvdStub(channel).Stats(kvd_pb2.StatsRequest(), timeout=10,
                                                    metadata=(("authorization", f"Bearer {token}"),))
            except grpc.RpcError as error:
                return error.code()
        return grpc.StatusCode.OK

    def reload(daemon) -> None:
        reloads = daemon.log().count("tenant tokens reloaded")
        daemon.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while daemon.log().count("tenant tokens reloaded") == reloads:
            assert "tenants file not reloaded" not in daemon.log(), daemon.log()[-2000:]
            assert time.monotonic() < deadline, "no reload logged"
            time.sleep(0.05)

    config = {"auth": {"mode": "token", "tenants_file": str(volume.directory / "tenants.toml")}}
    with run_daemon(tmp_path / "daemon", config=config) as daemon:
        denied, unknown = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED
        assert (code(daemon, ops["token"]), code(daemon, old["token"]), code(daemon, new["token"])) == (
            grpc.StatusCode.OK, denied, unknown)
        volume.update(file_with(old, new))  # the Secret, updated: both digests
        time.sleep(0.2)
        assert code(daemon, new["token"]) == unknown  # the file alone: no change
        reload(daemon)
        assert (code(daemon, old["token"]), code(daemon, new["token"])) == (denied, denied)
        volume.update(file_with(new))  # the clients moved: the old digest goes
        reload(daemon)
        assert (code(daemon, old["token"]), code(daemon, new["token"])) == (unknown, denied)
        assert code(daemon, ops["token"]) == grpc.StatusCode.OK
        log = daemon.log()
        assert not any(made["token"] in log for made in (ops, old, new))


def test_the_documented_opt_out_turns_auth_off(tmp_path):
    """Without tokens, as docs/operations.md shows it: KVD_AUTH_MODE=none in
    the container's environment, which kvd's loader puts above kvd.toml."""
    docs = (ROOT / "docs/operations.md").read_text()
    section = docs[docs.index("**Without tokens.**"):]
    patch = re.search(r"```yaml\n(patches:\n.*?)```", section, re.DOTALL).group(1)
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    kustomization = yaml.safe_load(patch)
    kustomization.update({"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                          "resources": [os.path.relpath(BASE, overlay)]})
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    documents = {document["kind"]: document for document in render(str(overlay))}
    (container,) = [c for c in documents["DaemonSet"]["spec"]["template"]["spec"]["containers"] if c["name"] == "kvd"]
    kubernetes_validate.validate(documents["DaemonSet"], KUBERNETES_VERSIONS[-1], strict=True)
    config_path = tmp_path / "kvd.toml"
    config_path.write_text(documents["ConfigMap"]["data"]["kvd.toml"])
    env = {item["name"]: item["value"] for item in container["env"]}
    assert load(config_path, env={}).auth.mode == "token"
    assert load(config_path, env=env).auth.mode == "none"
