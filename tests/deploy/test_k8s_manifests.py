"""The kustomize base in deploy/k8s, its example overlay and the example
engine pod, rendered by kubectl and schema-checked, then held against kvd's
own configuration.

kubectl comes with the build machines' image (Debian package `kubectl`
from the Google Cloud SDK repository, not Debian's own; `make setup` does
not install it): a machine without it fails here rather than skip.

Validators:
- the core kinds (Namespace, ServiceAccount, ConfigMap, Secret, DaemonSet,
  NetworkPolicy): kubernetes-validate's strict schemas (unknown fields are
  errors), for the oldest Kubernetes the manifests claim (1.27: native gRPC
  probes are GA) and the newest the package knows;
- the PodMonitor (a Prometheus Operator CRD, which kubernetes-validate has
  no schema for): OUR OWN JSON schema below, written from the operator's
  CRD for just the fields these manifests use. It catches typos and wrong
  types in those fields; it is not the operator's full schema.

The arena (kvd.arena_protocol): nothing is shared with the node but the
sockets' directory, no hostIPC and no /dev/shm, in kvd's pods and the
example engine pod; the engine pod mounts that directory where its target's
socket has the arena socket next to it, and the overlay's socket group, the
engine pod's supplementalGroups and the init container's chown agree (the
init container itself runs, with CAP_CHOWN only, twice, where the machine
lets the test be root).

Auth (auth.mode = "token", the base's default): the tenants file of the
Secret kvd-tenants loads with kvd's own loader (kvd.config.load_tenants) and
token table (kvd.server.auth.TokenTable); an overlay made as
docs/operations.md says replaces it with tokens made by the real `kvd token`;
and a real daemon whose tenants file is updated the way the kubelet updates
a mounted Secret takes the new tokens on SIGHUP.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import grpc
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvd import arena_protocol
from kvd.config import load, load_tenants, parse_size
from kvd.server.auth import TokenTable
from kvd.testing.daemon import run_daemon
from kvd.v1 import kvd_pb2, kvd_pb2_grpc

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


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request, tmp_path_factory) -> dict:
    return rendered_objects(request.param, tmp_path_factory)


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


def test_core_objects_pass_strict_kubernetes_schemas(rendered):
    for kind in sorted(CORE_KINDS):
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(rendered[kind], version, strict=True)


def test_the_validators_reject_what_they_should():
    """A typo'd field and a wrongly typed probe port fail the core schema; a
    typo'd PodMonitor field fails ours: the checks above can fail."""
    daemonset = yaml.safe_load((ROOT / "deploy/k8s/base/daemonset.yaml").read_text())
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    container["securityContext"]["readOnlyRootFS"] = True
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSIONS[-1], strict=True)
    del container["securityContext"]["readOnlyRootFS"]
    container["readinessProbe"]["grpc"]["port"] = "grpc"  # gRPC probes take numbers only
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSIONS[-1], strict=True)
    podmonitor = yaml.safe_load((ROOT / "deploy/k8s/base/podmonitor.yaml").read_text())
    jsonschema.validate(podmonitor, PODMONITOR_SCHEMA)
    podmonitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(podmonitor, PODMONITOR_SCHEMA)


def test_podmonitor_matches_our_schema_and_the_pods(rendered):
    podmonitor = rendered["PodMonitor"]
    jsonschema.validate(podmonitor, PODMONITOR_SCHEMA)
    labels = rendered["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    assert podmonitor["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {port["name"]: port["containerPort"] for port in rendered["container"]["ports"]}
    for endpoint in podmonitor["spec"]["podMetricsEndpoints"]:
        assert ports[endpoint["port"]] == parse_port(rendered["config"].metrics.address)
        assert seconds(endpoint["scrapeTimeout"]) <= seconds(endpoint["interval"])


def parse_port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_probes_and_ports_follow_the_toml(rendered):
    config, container = rendered["config"], rendered["container"]
    grpc_port = parse_port(config.server.tcp_address)
    # The kubelet probes the pod IP: the TCP listener must not be loopback-only.
    assert config.server.tcp_address.startswith("0.0.0.0:")
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"grpc": grpc_port, "metrics": parse_port(config.metrics.address)}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == grpc_port, probe
        # The health service knows "" and the kvd service, nothing else.
        assert container[probe]["grpc"].get("service", "") in ("", "kvd.v1.Kvd"), probe
    # Recovery may take minutes before the first SERVING; the startup probe waits.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_termination_grace_outlasts_the_drain(rendered):
    grace_period_s = rendered["toml"]["server"]["grace_period_s"]
    assert grace_period_s == rendered["config"].server.grace_period_s
    assert rendered["pod"]["terminationGracePeriodSeconds"] > grace_period_s + 5


def test_volumes_hold_what_the_toml_names(rendered):
    pod, container, config = rendered["pod"], rendered["container"], rendered["config"]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in container["volumeMounts"]}
    # --config names the ConfigMap's key where the ConfigMap is mounted.
    words = [*container.get("command", []), *container.get("args", [])]
    config_file = Path(words[words.index("--config") + 1])
    assert mounts[str(config_file.parent)]["configMap"]["name"] == rendered["ConfigMap"]["metadata"]["name"]
    assert config_file.name in rendered["ConfigMap"]["data"]
    # The socket's directory is on the node, for engine pods to mount.
    assert mounts[config.state_dir]["hostPath"]["path"] == config.state_dir
    # Every drive is a hostPath that must exist (type Directory): an unmounted
    # drive stops the pod instead of filling the root file system.
    assert config.disk.directories
    for directory in config.disk.directories:
        assert mounts[directory]["hostPath"]["type"] == "Directory", directory
    # The arena is memfd files handed out over the arena socket: nothing of
    # the node's IPC or /dev/shm is shared.
    assert_shares_no_ipc(pod)
    # Writable mounts are the only writable places.
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


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


def test_the_socket_directory_admits_the_socket_group(rendered):
    """Both sockets have the same mode: 0600, or 0660 with
    server.unix_socket_group. With a group (a number: no such group need
    exist in the image), kvd must be a member to give its sockets to it
    (supplementalGroups) and the init container gives it the directory,
    mode 0750, so that it can enter; without one, the directory is kvd's
    own group's and only uid 1000 gets in."""
    config, pod = rendered["config"], rendered["pod"]
    init, script = state_dir_init(pod)
    assert {mount["mountPath"] for mount in init["volumeMounts"]} == {config.state_dir}
    directory = re.escape(config.state_dir)
    chowns = re.findall(rf"\bchown (\d+)(?::(\d+))? {directory}\b", script)
    assert chowns, script
    uid, gid = chowns[-1]
    assert int(uid) == pod["securityContext"]["runAsUser"]
    group = config.server.unix_socket_group
    if group:
        assert group.isdigit(), "a gid, which needs no group entry in the image"
        assert int(gid) == int(group)
        assert int(group) in pod["securityContext"].get("supplementalGroups", [])
    else:
        assert int(gid) == pod["securityContext"]["runAsGroup"]
    assert re.findall(rf"\bchmod (\d+) {directory}\b", script) == ["0750"]


def test_the_init_container_prepares_the_directory_on_every_start(rendered, tmp_path):
    """The init container's script, run as it runs (uid 0, CAP_CHOWN alone)
    on a directory as the kubelet makes it (root's), then again as a
    restarted pod finds it (already uid 1000's): root without CAP_FOWNER
    may chmod only what it owns."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv (util-linux) to run the script with CAP_CHOWN alone")
    config, pod = rendered["config"], rendered["pod"]
    init, script = state_dir_init(pod)
    added = init["securityContext"]["capabilities"]["add"]
    bounding = ",".join(["-all", *(f"+{capability.lower()}" for capability in added)])
    directory = tmp_path / "run-kvd"
    directory.mkdir()
    os.chmod(directory, 0o755)
    group = config.server.unix_socket_group
    gid = int(group) if group else pod["securityContext"]["runAsGroup"]
    for start in ("first", "second"):
        result = subprocess.run(
            ["setpriv", "--bounding-set", bounding, "--inh-caps", "-all", "/bin/sh", "-c",
             script.replace(config.state_dir, str(directory))],
            capture_output=True, text=True, check=False, timeout=30)
        assert result.returncode == 0, (start, result.stderr)
        status = directory.stat()
        assert (oct(status.st_mode & 0o7777), status.st_uid, status.st_gid) == (
            oct(0o750), pod["securityContext"]["runAsUser"], gid), start


def engine_documents() -> dict[str, dict]:
    documents = [document for document in yaml.safe_load_all(ENGINE_POD.read_text()) if document]
    by_kind = {document["kind"]: document for document in documents}
    assert sorted(by_kind) == ["Deployment", "Namespace"] and len(documents) == 2
    return by_kind


def test_the_example_engine_pod_passes_strict_kubernetes_schemas():
    for document in engine_documents().values():
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(document, version, strict=True)


def test_the_example_engine_pod_gets_the_arena_through_the_socket_directory(tmp_path_factory):
    """The engine pod of deploy/k8s/examples, against the example overlay's
    kvd: it mounts the node directory that holds kvd's sockets, as a
    directory, where its target's socket has the arena socket next to it;
    it is in the sockets' group, under a uid of its own; its token comes
    from its own Secret; and it shares no IPC and no /dev/shm."""
    kvd = rendered_objects(EXAMPLE_OVERLAY, tmp_path_factory)
    config = kvd["config"]
    documents = engine_documents()
    namespace, deployment = documents["Namespace"], documents["Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert_shares_no_ipc(pod)
    # The node directory behind kvd's state_dir, and kvd's socket in it.
    kvd_volumes = {volume["name"]: volume for volume in kvd["pod"]["volumes"]}
    kvd_mounts = {mount["mountPath"]: kvd_volumes[mount["name"]] for mount in kvd["container"]["volumeMounts"]}
    node_directory = Path(kvd_mounts[config.state_dir]["hostPath"]["path"])
    socket = config.unix_socket_path
    assert socket is not None and socket.parent == Path(config.state_dir)
    # The engine mounts that directory and nothing else of the node, whole.
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert [volume["hostPath"]["path"] for volume in volumes.values() if "hostPath" in volume] == [
        str(node_directory)]
    (mount,) = [mount for mount in container["volumeMounts"] if "hostPath" in volumes[mount["name"]]]
    assert "subPath" not in mount and "subPathExpr" not in mount
    socket_in_engine = Path(mount["mountPath"]) / socket.relative_to(config.state_dir)
    # Its target is that socket, and the arena socket the client derives
    # from the target is kvd's, in the same mount.
    words = [*container.get("command", []), *container.get("args", []),
             *(item.get("value", "") for item in container.get("env", []))]
    (target,) = [word for word in words if word.startswith("unix:")]
    arena_socket = arena_protocol.socket_path_for_target(target)
    assert arena_socket == arena_protocol.socket_path(socket_in_engine)
    assert arena_socket.parent == Path(mount["mountPath"])
    # The sockets' group: the overlay's server.unix_socket_group, the group
    # the init container gives the directory, and the engine's supplementalGroups.
    group = config.server.unix_socket_group
    assert group.isdigit()
    _init, script = state_dir_init(kvd["pod"])
    _uid, gid = re.findall(rf"\bchown (\d+):(\d+) {re.escape(config.state_dir)}\b", script)[-1]
    security = pod["securityContext"]
    assert security["supplementalGroups"] == [int(group)] == [int(gid)]
    # A uid of its own: not root, not kvd's (which could read all of kvd's memory).
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] not in (0, kvd["pod"]["securityContext"]["runAsUser"])
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # Its tenant's token from a Secret of its own namespace, never a literal.
    env = {item["name"]: item for item in container["env"]}
    assert "value" not in env["KVD_TOKEN"]
    reference = env["KVD_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert reference["name"] and reference["key"] and not reference.get("optional", False)
    # Only on kvd's nodes; in a namespace that admits its hostPath volume.
    assert kvd["pod"]["nodeSelector"].items() <= pod["nodeSelector"].items()
    assert deployment["metadata"]["namespace"] == namespace["metadata"]["name"] != kvd["Namespace"]["metadata"]["name"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    template_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= template_labels.items()


def test_memory_covers_the_arena(rendered):
    resources = rendered["container"]["resources"]
    capacity_bytes = rendered["config"].host.capacity_bytes
    request_bytes = kubernetes_quantity(resources["requests"]["memory"])
    assert request_bytes >= capacity_bytes + DAEMON_MEMORY_BYTES_MIN
    assert kubernetes_quantity(resources["limits"]["memory"]) >= request_bytes
    assert "cpu" in resources["requests"]


def kubernetes_quantity(text: str) -> int:
    return parse_size("memory", re.sub(r"^(\d+)([KMGT])i$", r"\1\2iB", text))


def test_pods_run_non_root_with_nothing_extra(rendered):
    pod, container = rendered["pod"], rendered["container"]
    dockerfile = (ROOT / "Dockerfile").read_text()
    image_uid = int(re.search(r"useradd --uid (\d+)", dockerfile).group(1))
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == image_uid != 0
    assert pod["securityContext"]["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost")
    assert not pod.get("hostNetwork") and not pod.get("hostPID")
    assert pod["automountServiceAccountToken"] is False
    assert pod["serviceAccountName"] == rendered["ServiceAccount"]["metadata"]["name"]
    security = container["securityContext"]
    assert security["allowPrivilegeEscalation"] is False and "privileged" not in security
    assert security["capabilities"]["drop"] == ["ALL"]
    assert set(security["capabilities"].get("add", [])) <= {"IPC_LOCK"}
    for init in pod.get("initContainers", []):
        assert init["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN"]}, init["name"]
        assert init["securityContext"]["allowPrivilegeEscalation"] is False
    # One kvd per node at any time: they would share the socket directory and the drives.
    assert rendered["DaemonSet"]["spec"]["updateStrategy"]["rollingUpdate"]["maxSurge"] == 0


def test_network_policy_opens_only_the_metrics_port(rendered):
    policy = rendered["NetworkPolicy"]["spec"]
    labels = rendered["DaemonSet"]["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"].items() <= labels.items()
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"] and policy["egress"] == []
    assert [port["port"] for rule in policy["ingress"] for port in rule["ports"]] == ["metrics"]


def test_namespace_admits_the_pods(rendered):
    namespace = rendered["Namespace"]
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    for kind in CORE_KINDS - {"Namespace"} | {"PodMonitor"}:
        assert rendered[kind]["metadata"]["namespace"] == namespace["metadata"]["name"], kind


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
