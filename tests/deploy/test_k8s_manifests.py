"""The kustomize base in deploy/k8s and its example overlay, rendered by
kubectl and schema-checked, then held against kvd's own configuration.

kubectl comes with the build machines' image (Debian package `kubectl`
from the Google Cloud SDK repository, not Debian's own; `make setup` does
not install it): a machine without it fails here rather than skip.

Validators:
- the core kinds (Namespace, ServiceAccount, ConfigMap, DaemonSet,
  NetworkPolicy): kubernetes-validate's strict schemas (unknown fields are
  errors), for the oldest Kubernetes the manifests claim (1.27: native gRPC
  probes are GA) and the newest the package knows;
- the PodMonitor (a Prometheus Operator CRD, which kubernetes-validate has
  no schema for): OUR OWN JSON schema below, written from the operator's
  CRD for just the fields these manifests use. It catches typos and wrong
  types in those fields; it is not the operator's full schema.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvd.config import load, parse_size

ROOT = Path(__file__).parents[2]
KUSTOMIZATIONS = ["deploy/k8s/base", "deploy/k8s/overlays/host-ipc"]
KUBERNETES_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
CORE_KINDS = {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet", "NetworkPolicy"}
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


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request, tmp_path_factory) -> dict:
    documents = render(request.param)
    by_kind: dict[str, list[dict]] = {}
    for document in documents:
        by_kind.setdefault(document["kind"], []).append(document)
    assert {kind: len(items) for kind, items in by_kind.items()} == {kind: 1 for kind in CORE_KINDS | {"PodMonitor"}}
    objects = {kind: items[0] for kind, items in by_kind.items()}
    # The TOML the daemon will read, through kvd's own loader (it validates).
    toml_text = objects["ConfigMap"]["data"]["kvd.toml"]
    config_path = tmp_path_factory.mktemp("k8s") / "kvd.toml"
    config_path.write_text(toml_text)
    objects["config"] = load(config_path, env={})
    objects["toml"] = tomllib.loads(toml_text)
    objects["pod"] = objects["DaemonSet"]["spec"]["template"]["spec"]
    (objects["container"],) = [c for c in objects["pod"]["containers"] if c["name"] == "kvd"]
    return objects


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
    # The arena is shared with the node: hostIPC, or the node's /dev/shm; exactly one.
    shm = mounts.get("/dev/shm")
    shared_by_hostpath = shm is not None and shm.get("hostPath", {}).get("path") == "/dev/shm"
    assert pod.get("hostIPC", False) != shared_by_hostpath
    # Writable mounts are the only writable places.
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


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
    # One kvd per node at any time: they would share /dev/shm and the drives.
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
