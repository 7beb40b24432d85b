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
  no schema for): OUR OWN JSON schema (PODMONITOR_SCHEMA in
  tests/deploy/k8s_helpers.py), written from the operator's
  CRD for just the fields these manifests use. It catches typos and wrong
  types in those fields; it is not the operator's full schema.

The arena and the sockets' directory are checked in test_k8s_arena.py, auth in
test_k8s_auth.py; the shared pieces are in tests/deploy/k8s_helpers.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.k8s_helpers import (CORE_KINDS, DAEMON_MEMORY_BYTES_MIN, KUBERNETES_VERSIONS, PODMONITOR_SCHEMA, ROOT,
    assert_shares_no_ipc, kubernetes_quantity, parse_port, seconds)


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


def test_memory_covers_the_arena(rendered):
    resources = rendered["container"]["resources"]
    capacity_bytes = rendered["config"].host.capacity_bytes
    request_bytes = kubernetes_quantity(resources["requests"]["memory"])
    assert request_bytes >= capacity_bytes + DAEMON_MEMORY_BYTES_MIN
    assert kubernetes_quantity(resources["limits"]["memory"]) >= request_bytes
    assert "cpu" in resources["requests"]


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
