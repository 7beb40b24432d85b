"""Shared pieces of the deploy/k8s tests (test_k8s_manifests.py, test_k8s_arena.py,
test_k8s_auth.py): the manifests rendered by kubectl and read back through kvd's own
configuration loader, the validators' versions and our PodMonitor schema, and the
small readers of rendered pods and Secrets. The `rendered` fixture is in
tests/deploy/conftest.py.

kubectl comes with the build machines' image (Debian package `kubectl`
from the Google Cloud SDK repository, not Debian's own; `make setup` does
not install it): a machine without it fails here rather than skip.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import kubernetes_validate
import yaml

from kvd.config import load, parse_size

ROOT = Path(__file__).parents[2]
EXAMPLE_OVERLAY = "deploy/k8s/overlays/example"
KUSTOMIZATIONS = ["deploy/k8s/base", EXAMPLE_OVERLAY]
# The engine pod that goes with the example overlay.
ENGINE_POD = ROOT / "deploy/k8s/examples/engine-pod.yaml"
KUBERNETES_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
CORE_KINDS = {"Namespace", "ServiceAccount", "ConfigMap", "Secret", "DaemonSet", "NetworkPolicy"}
BASE = ROOT / "deploy/k8s/base"
# The digests of the base's tenants.toml: one hex digit 64 times, which no
# token hashes to, so the base as shipped admits nobody.
PLACEHOLDER_DIGEST = re.compile(r"([0-9a-f])\1{63}")
# With tenants, kvd may map every host slot on its own and refuses to start
# when slots + 4096 (its headroom, kvd.daemon.planes.host_slot_classes) exceed the
# node's vm.max_map_count, whose kernel default is 65530.
DEFAULT_MAX_MAP_COUNT = 65530
MAP_COUNT_HEADROOM = 4096
# What the daemon needs beyond the arena: index, gRPC buffers, the interpreter.
DAEMON_MEMORY_BYTES_MIN = 1 << 30

DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
PODMONITOR_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PodMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "additionalProperties": False,
            "properties": {
                "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {"matchLabels": {"type": "object", "additionalProperties": {"type": "string"}}},
                },
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string", "minLength": 1},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": DURATION},
                            "scrapeTimeout": {"type": "string", "pattern": DURATION},
                        },
                    },
                },
            },
        },
    },
}


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(int(count) * units[unit] for count, unit in re.findall(r"(\d+)(ms|h|m|s)", duration))


def render(kustomization: str) -> list[dict]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render deploy/k8s (any kubectl >= 1.27; see this module's docstring)"
    result = subprocess.run([kubectl, "kustomize", str(ROOT / kustomization)], capture_output=True, text=True,
                            check=False, timeout=60)
    assert result.returncode == 0, result.stderr
    return [document for document in yaml.safe_load_all(result.stdout) if document]


_RENDERED: dict[str, dict] = {}


def rendered_objects(kustomization: str, tmp_path_factory) -> dict:
    """The objects of `kustomization` by kind, its kvd pod and container, and
    the configuration kvd would load from them (rendered once per module)."""
    if kustomization not in _RENDERED:
        _RENDERED[kustomization] = render_objects(kustomization, tmp_path_factory)
    return _RENDERED[kustomization]


def render_objects(kustomization: str, tmp_path_factory) -> dict:
    documents = render(kustomization)
    by_kind: dict[str, list[dict]] = {}
    for document in documents:
        by_kind.setdefault(document["kind"], []).append(document)
    assert {kind: len(items) for kind, items in by_kind.items()} == {kind: 1 for kind in CORE_KINDS | {"PodMonitor"}}
    objects = {kind: items[0] for kind, items in by_kind.items()}
    objects["pod"] = objects["DaemonSet"]["spec"]["template"]["spec"]
    (objects["container"],) = [c for c in objects["pod"]["containers"] if c["name"] == "kvd"]
    # The TOML the daemon will read, through kvd's own loader (it validates),
    # with the container's environment, which overrides the file (KVD_*).
    toml_text = objects["ConfigMap"]["data"]["kvd.toml"]
    config_path = tmp_path_factory.mktemp("k8s") / "kvd.toml"
    config_path.write_text(toml_text)
    env = {item["name"]: item["value"] for item in objects["container"].get("env", []) if "value" in item}
    assert not any("valueFrom" in item for item in objects["container"].get("env", [])
                   if item["name"].startswith("KVD_")), "a KVD_ setting this test cannot see"
    objects["config"] = load(config_path, env=env)
    objects["toml"] = tomllib.loads(toml_text)
    return objects


def secret_files(secret: dict) -> dict[str, str]:
    """The files of a rendered Secret (data is base64; stringData is plain)."""
    files = {key: base64.b64decode(value).decode() for key, value in secret.get("data", {}).items()}
    files.update(secret.get("stringData", {}))
    return files


def parse_port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def assert_shares_no_ipc(pod: dict) -> None:
    """Neither the node's IPC namespace nor any /dev/shm: the arena is memfd
    files that kvd hands out over its arena socket (kvd.arena_protocol)."""
    assert not pod.get("hostIPC", False) and not pod.get("hostPID", False)
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for volume in volumes.values():
        if "hostPath" in volume:
            assert not Path(volume["hostPath"]["path"]).is_relative_to("/dev/shm"), volume
    for container in [*pod.get("initContainers", []), *pod["containers"]]:
        for mount in container.get("volumeMounts", []):
            assert not Path(mount["mountPath"]).is_relative_to("/dev/shm"), (container["name"], mount)


def state_dir_init(pod: dict) -> tuple[dict, str]:
    """The init container that prepares the sockets' directory, and its script."""
    (init,) = [container for container in pod["initContainers"] if container["name"] == "state-dir"]
    assert init["command"][:2] == ["/bin/sh", "-c"] and len(init["command"]) == 3
    return init, init["command"][2]


def engine_documents() -> dict[str, dict]:
    documents = [document for document in yaml.safe_load_all(ENGINE_POD.read_text()) if document]
    by_kind = {document["kind"]: document for document in documents}
    assert sorted(by_kind) == ["Deployment", "Namespace"] and len(documents) == 2
    return by_kind


def kubernetes_quantity(text: str) -> int:
    return parse_size("memory", re.sub(r"^(\d+)([KMGT])i$", r"\1\2iB", text))


def kvd_token() -> dict[str, str]:
    """A new token and its token_sha256, from the real `kvd token --json`."""
    result = subprocess.run([sys.executable, "-m", "kvd", "token", "--json"], capture_output=True, text=True,
                            check=True, timeout=60)
    return json.loads(result.stdout)


def with_digests(tenants_toml: str, digests: dict[str, list[str]]) -> str:
    """`tenants_toml` (the base's file) with each tenant's token_sha256 line
    set to `digests[name]`, as an operator edits it."""
    lines, tenant = [], None
    for line in tenants_toml.splitlines():
        match = re.match(r'name = "([^"]+)"', line)
        if match:
            tenant = match.group(1)
        if line.startswith("token_sha256 ="):
            line = f"token_sha256 = {json.dumps(digests[tenant])}"
        lines.append(line)
    return "\n".join(lines) + "\n"
