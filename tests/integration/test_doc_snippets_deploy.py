"""The deployment snippets of docs/operations.md (pip, systemd, Docker, kubectl, kustomize YAML),
held against what they deploy, without a machine to deploy on (issue 36 item 6).

- `pip wheel` / `pip install`: the project built is kvd, so the wheel is the `kvd-*.whl` the
  next line installs (tests/deploy/test_wheel_install.py builds and installs it);
- useradd, install, systemctl: the user, home, config path, unit and drop-in names are the
  unit's (deploy/systemd/, read with tests/deploy/test_systemd_unit.py's parser);
- `docker build` / `docker run`: the image tag is kvd's version, the Dockerfile's entry point is
  kvd, and the arguments after the image load as a configuration through `kvd config` (serve's
  flags), whose state_dir and disk directories are the volumes mounted;
- kubectl: every namespace, DaemonSet, label, mount path, Secret and key named is the rendered
  base's (`kubectl kustomize`) or the example engine pod's; the commands run inside the pod parse
  as kvd's; the log lines grepped for are kvd's own;
- ```yaml: an overlay is rendered with the base, the engine pod's environment is the example
  pod's.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

import kvd
from kvd.cli import build_parser
from kvd.config import load, load_tenants
from tests.deploy.test_systemd_unit import parse_unit
from tests.integration.doc_snippets import ROOT, Command, argument, blocks, program, sh_commands

BASE = ROOT / "deploy" / "k8s" / "base"
ENGINE_POD = ROOT / "deploy" / "k8s" / "examples" / "engine-pod.yaml"
SYSTEMD = ROOT / "deploy" / "systemd"
VENV_BIN = Path(sys.executable).parent


def render(kustomization: Path) -> dict[str, list[dict]]:
    """The objects `kubectl kustomize` makes of a kustomization, by kind."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl renders deploy/k8s (tests/deploy/test_k8s_manifests.py says where it comes from)"
    result = subprocess.run([kubectl, "kustomize", str(kustomization)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    objects: dict[str, list[dict]] = {}
    for document in filter(None, yaml.safe_load_all(result.stdout)):
        objects.setdefault(document["kind"], []).append(document)
    return objects


@pytest.fixture(scope="module")
def base() -> dict:
    objects = render(BASE)
    (daemonset,) = objects["DaemonSet"]
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = [container for container in pod["containers"] if container["name"] == "kvd"]
    (configmap,) = objects["ConfigMap"]
    return {"objects": objects, "daemonset": daemonset, "pod": pod, "container": container,
            "toml": tomllib.loads(configmap["data"]["kvd.toml"])}


def documented_overlay() -> Path:
    """The overlay docs/operations.md has the reader make (named in its YAML's first line)."""
    (first,) = [block.body.splitlines()[0] for block in blocks("yaml") if "secretGenerator" in block.body]
    return Path(re.fullmatch(r"# (\S+)/kustomization\.yaml,.*", first).group(1))


def test_the_deployment_snippets_are_there():
    assert len(sh_commands("kubectl")) >= 5 and len(blocks("yaml")) >= 3
    assert sh_commands("wheel") and sh_commands("systemd") and sh_commands("docker")


@pytest.mark.parametrize("command", sh_commands("wheel"), ids=lambda command: command.where)
def test_the_wheel_is_kvds(command):
    _, args = program(command)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    if args[0] == "wheel":
        assert args[-1] == "." and (ROOT / "setup.py").is_file() and "--no-deps" in args, command.text
        assert project["name"] == "kvd"
    else:
        assert args[0] == "install" and re.fullmatch(rf"([\w/]+/)?{project['name']}-\*\.whl", args[1]), command.text


def unit() -> dict:
    return parse_unit((SYSTEMD / "kvd.service").read_text())


@pytest.mark.parametrize("command", sh_commands("systemd"), ids=lambda command: command.where)
def test_the_systemd_steps_match_the_unit(command):
    name, args = program(command)
    service = unit()["Service"]
    user, group = service["User"], service["Group"]
    if name == "useradd":
        assert [args[-1]] == user == group, command.text
        assert argument(args, "--home-dir") == f"/var/lib/{service['StateDirectory'][0]}", command.text
    elif name == "install" and "-D" in args:
        source, target = ROOT / args[-2], args[-1]
        assert source.is_file(), command.text
        config = argument(shlex.split(service["ExecStart"][0]), "--config")
        placed = config if source.suffix == ".toml" else f"/etc/systemd/system/{source.relative_to(SYSTEMD)}"
        assert target == placed, command.text
    elif name == "install":
        assert [argument(args, "-o")] == user and [argument(args, "-g")] == group, command.text
        drop_in = parse_unit((SYSTEMD / "kvd.service.d" / "disk.conf").read_text())
        assert args[args.index(argument(args, "-m")) + 1:] == drop_in["Service"]["ReadWritePaths"][0].split()
    else:
        assert args[-3:-1] == ["enable", "--now"] and (SYSTEMD / f"{args[-1]}.service").is_file(), command.text


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


@pytest.mark.parametrize("command", sh_commands("docker"), ids=lambda command: command.where)
def test_the_docker_lines_fit_the_dockerfile(command):
    _, args = program(command)
    tag = f"kvd:{kvd.__version__}"
    if args[0] == "build":
        assert argument(args, "-t") == tag and args[-1] == "." and (ROOT / "Dockerfile").is_file(), command.text
        return
    assert args[0] == "run" and tag in args, command.text
    assert re.search(r'^ENTRYPOINT \["kvd"\]$', dockerfile(), re.MULTILINE)
    image_args = args[args.index(tag) + 1:]
    mounts = [volume.split(":")[1] for flag, volume in zip(args, args[1:]) if flag == "-v"]
    assert image_args[0] == "serve", command.text
    build_parser().parse_args(image_args)
    # serve's flags, through `kvd config` (the same flags): the configuration kvd would run with.
    printed = subprocess.run([str(VENV_BIN / "kvd"), "config", *image_args[1:]], capture_output=True, text=True,
                             timeout=60, cwd=ROOT)
    assert printed.returncode == 0, printed.stderr
    config = json.loads(printed.stdout)
    assert config["state_dir"] in mounts and set(config["disk"]["directories"]) <= set(mounts), command.text


def kubectl_calls(command: Command) -> list[list[str]]:
    """Each kubectl invocation in a command (a loop's, a pipeline's, a $(...)'s), as argv."""
    calls = [shlex.split(text, comments=True) for text in re.findall(r"\bkubectl\b[^|;)\n]*", command.text)]
    return [call[:call.index("<")] if "<" in call else call for call in calls]


def test_kubectl_calls_are_read_whole():
    loop = [command for command in sh_commands("kubectl") if command.text.startswith("for ")]
    assert len(loop) == 1 and [call[1] for call in kubectl_calls(loop[0])] == ["get", "exec", "exec"]


@pytest.mark.parametrize("command", sh_commands("kubectl"), ids=lambda command: command.where)
def test_kubectl_names_what_the_manifests_have(command, base):
    assert subprocess.run(["bash", "-n", "-c", command.text]).returncode == 0, command.text
    for call in kubectl_calls(command):
        check_kubectl(call, base)
    for patterns in re.findall(r"grep -E '([^']*)'", command.text):
        for message in patterns.split("|"):
            assert any(f'"{message}"' in path.read_text() for path in (ROOT / "kvd").rglob("*.py")), message
    for compared in re.findall(r"cmp -s - (\S+)", command.text):
        assert Path(compared).parent == documented_overlay(), command.text


def check_kubectl(call: list[str], base: dict) -> None:
    daemonset, operation = base["daemonset"], call[1]
    if operation == "apply":
        path = Path(argument(call, "-k"))
        assert (ROOT / path / "kustomization.yaml").is_file() or path == documented_overlay(), call
        return
    if operation == "create":
        check_engine_secret(call)
        return
    assert argument(call, "-n") == daemonset["metadata"]["namespace"], call
    if "-l" in call:
        label, value = argument(call, "-l").split("=")
        assert base["pod"] and daemonset["spec"]["template"]["metadata"]["labels"][label] == value, call
    if operation == "exec":
        target = call[call.index("--") - 1]
        assert target in ("$pod", f"ds/{daemonset['metadata']['name']}"), call
        check_in_pod(call[call.index("--") + 1:], base)
    else:
        assert operation in ("get", "logs"), call


def check_in_pod(inner: list[str], base: dict) -> None:
    """A command run in kvd's container: kvd's own, a mounted file, or a signal to kvd (PID 1)."""
    container = base["container"]
    if inner[0] == "kvd":
        arguments = build_parser().parse_args(inner[1:])
        assert arguments.state_dir == base["toml"]["state_dir"], inner
    elif inner[0] == "cat":
        mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
        secrets = {volume["name"]: volume["secret"]["secretName"] for volume in base["pod"]["volumes"]
                   if "secret" in volume}
        path = Path(inner[1])
        (volume,) = [name for name, mount in mounts.items() if mount == str(path.parent)]
        (secret,) = [secret for secret in base["objects"]["Secret"] if secret["metadata"]["name"] == secrets[volume]]
        assert path.name in {**secret.get("data", {}), **secret.get("stringData", {})}, inner
    else:
        assert inner == ["sh", "-c", "kill -HUP 1"] and container["command"][0] == "kvd", inner


def engine_pod() -> tuple[dict, dict]:
    documents = [document for document in yaml.safe_load_all(ENGINE_POD.read_text()) if document]
    (pod,) = [document for document in documents if document["kind"] in ("Pod", "Deployment")]
    spec = pod["spec"]["template"]["spec"] if pod["kind"] == "Deployment" else pod["spec"]
    return pod, spec


def check_engine_secret(call: list[str]) -> None:
    """`kubectl create secret generic NAME -n NS --from-file=KEY=FILE`: what the engine pod reads."""
    assert call[2:4] == ["secret", "generic"], call
    name, key = call[4], argument(call, "--from-file").split("=")[0]
    pod, spec = engine_pod()
    assert argument(call, "-n") == pod["metadata"]["namespace"], call
    references = [entry["valueFrom"]["secretKeyRef"] for container in spec["containers"]
                  for entry in container.get("env", []) if "secretKeyRef" in entry.get("valueFrom", {})]
    assert {"name": name, "key": key} in references, call


@pytest.mark.parametrize("block", blocks("yaml"), ids=lambda block: block.where)
def test_yaml_blocks_render_with_what_they_document(block, base, tmp_path):
    documented = yaml.safe_load(block.body)
    if "secretGenerator" in documented:
        check_overlay(documented, tmp_path)
    elif "patches" in documented:
        check_patch(documented, tmp_path)
    elif set(documented) == {"env"}:
        _, spec = engine_pod()
        assert ENGINE_POD.relative_to(ROOT).as_posix() in block.body.splitlines()[0], block.where
        assert any(all(entry in container.get("env", []) for entry in documented["env"])
                   for container in spec["containers"]), block.where
    else:
        raise AssertionError(f"{block.where}: no check for this YAML")


def overlay_tree(tmp_path: Path, kustomization: dict) -> Path:
    """The documented overlay's directory in a copy of deploy/k8s, its kustomization written."""
    shutil.copytree(BASE, tmp_path / "deploy" / "k8s" / "base")
    overlay = tmp_path / documented_overlay()
    overlay.mkdir(parents=True)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    return overlay


def check_overlay(documented: dict, tmp_path: Path) -> None:
    """The Secret keeps its name and carries the overlay's tenants.toml, which kvd loads."""
    overlay = overlay_tree(tmp_path, documented)
    tenants = (BASE / "tenants.toml").read_text() + "\n# the overlay's own file\n"
    (overlay / "tenants.toml").write_text(tenants)
    objects = render(overlay)
    (secret,) = objects["Secret"]
    files = {name: base64.b64decode(text).decode() for name, text in secret.get("data", {}).items()}
    assert {**files, **secret.get("stringData", {})} == {"tenants.toml": tenants}
    pod = objects["DaemonSet"][0]["spec"]["template"]["spec"]
    assert secret["metadata"]["name"] in [volume["secret"]["secretName"] for volume in pod["volumes"]
                                          if "secret" in volume]
    assert load_tenants(overlay / "tenants.toml", env={})


def check_patch(documented: dict, tmp_path: Path) -> None:
    """The patch applies to the base's DaemonSet, and the environment it gives wins over kvd.toml."""
    overlay = overlay_tree(tmp_path, {"resources": ["../../base"], **documented})
    objects = render(overlay)
    (container,) = [container for container in objects["DaemonSet"][0]["spec"]["template"]["spec"]["containers"]
                    if container["name"] == "kvd"]
    config = tmp_path / "kvd.toml"
    config.write_text(objects["ConfigMap"][0]["data"]["kvd.toml"])
    env = {entry["name"]: entry["value"] for entry in container.get("env", []) if "value" in entry}
    assert (load(config, env={}).auth.mode, load(config, env=env).auth.mode) == ("token", "none")
