"""The deploy/k8s manifests (see test_k8s_manifests.py for how they are rendered and validated) and
the arena.

The arena (kvd.arena_protocol): nothing is shared with the node but the
sockets' directory, no hostIPC and no /dev/shm, in kvd's pods and the
example engine pod; the engine pod mounts that directory where its target's
socket has the arena socket next to it, and the overlay's socket group, the
engine pod's supplementalGroups and the init container's chown agree (the
init container itself runs, with CAP_CHOWN only, twice, where the machine
lets the test be root).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest

from kvd import arena_protocol
from tests.deploy.k8s_helpers import (EXAMPLE_OVERLAY, KUBERNETES_VERSIONS, assert_shares_no_ipc, engine_documents,
    rendered_objects, state_dir_init)


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
