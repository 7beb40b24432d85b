"""What the Dockerfile does, short of Docker (which cannot run here).

The builder stage's COPY lines are read from the Dockerfile and exactly
those paths are copied into a scratch source tree (less what .dockerignore
leaves out); the wheel is built from it as the builder does (`pip wheel
--no-deps`), installed with --no-deps into a fresh venv that borrows the
dependencies from the project's venv, and run from outside the work tree,
so that nothing is imported from it. The runtime stage's apt packages must
be exactly the Debian packages that own the libraries kvd._native links.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def stages() -> list[list[str]]:
    """The Dockerfile's instructions (continuations joined), split by FROM."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.upper().startswith("FROM "):
            result.append([])
        result[-1].append(line)
    return result


def apt_packages(stage: list[str]) -> set[str]:
    packages = set()
    for line in stage:
        for command in re.findall(r"apt-get install ([^&;]+)", line):
            packages |= {word for word in command.split() if not word.startswith("-")}
    return packages


def copies(stage: list[str]) -> list[tuple[list[str], str]]:
    return [(words[1:-1], words[-1]) for words in (shlex.split(line) for line in stage)
            if words[0] == "COPY" and not any(word.startswith("--from") for word in words)]


def debian_package_of(library: str) -> str:
    # Under merged /usr a library has two paths; dpkg knows one of them.
    real = os.path.realpath(library)
    candidates = {library, real, real.removeprefix("/usr"), "/usr" + library}
    for path in sorted(candidates):
        found = subprocess.run(["dpkg", "-S", path], capture_output=True, text=True, check=False)
        if found.returncode == 0:
            return found.stdout.split(":")[0]
    raise AssertionError(f"no Debian package owns {library} ({sorted(candidates)})")


def run(command: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False, timeout=timeout)
    assert result.returncode == 0, f"{command} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    scratch = tmp_path_factory.mktemp("docker")
    builder, runtime = stages()
    source = scratch / "src"
    source.mkdir()
    ignored = shutil.ignore_patterns("__pycache__", "_native*.so", "*.egg-info")
    for paths, destination in copies(builder):
        for path in paths:
            origin = ROOT / path
            assert origin.exists(), f"the Dockerfile COPYs {path}, which does not exist"
            target = source / destination / (origin.name if destination.endswith("/") else "")
            if origin.is_dir():
                shutil.copytree(origin, target, ignore=ignored)
            else:
                shutil.copy2(origin, target)
    wheel_command = next(line for line in builder if "pip wheel" in line)
    assert "--no-deps" in wheel_command
    wheels = scratch / "wheels"
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--wheel-dir", str(wheels), "."], cwd=source,
        timeout=300)
    (wheel,) = wheels.glob("kvd-*.whl")

    venv = scratch / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=scratch)
    python = venv / "bin" / "python"
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)], cwd=scratch)
    # The dependencies (grpcio, numpy, ..., and pytest) come from the project's
    # venv, appended after the fresh venv's own site-packages: a plain path
    # line, so the project venv's editable install of kvd is not activated.
    purelib = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       cwd=scratch).stdout.strip())
    (purelib / "kvd-test-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return {"scratch": scratch, "wheel": wheel, "venv": venv, "python": python, "purelib": purelib,
            "runtime": runtime}


def test_wheel_holds_the_native_engine_and_the_default_config(installed):
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = set(wheel.namelist())
        entry_points = wheel.read(next(name for name in names if name.endswith("entry_points.txt"))).decode()
    assert any(re.fullmatch(r"kvd/_native\.cpython-.*\.so", name) for name in names), sorted(names)
    assert {"kvd/default.toml", "kvd/_native.pyi", "kvd/py.typed", "kvd/v1/kvd_pb2.py"} <= names
    # ENTRYPOINT ["kvd"] is the console script.
    assert re.search(r"^kvd = kvd\.cli:main$", entry_points, re.MULTILINE), entry_points


def test_runtime_packages_are_what_the_native_module_links(installed):
    (native,) = (installed["purelib"] / "kvd").glob("_native*.so")
    linked = run(["ldd", str(native)], cwd=installed["scratch"]).stdout
    assert "not found" not in linked, linked
    libraries = re.findall(r"=> (\S+) \(", linked)
    assert len(libraries) >= 3, linked
    owners = set()
    for library in libraries:
        owners.add(debian_package_of(library))
    # libc6 is in the python:*-slim base image; everything else the runtime stage installs.
    assert owners - {"libc6"} == apt_packages(installed["runtime"]), (owners, apt_packages(installed["runtime"]))


def test_installed_wheel_runs_from_outside_the_work_tree(installed):
    python, venv, scratch = str(installed["python"]), installed["venv"], installed["scratch"]
    probe = ("import kvd, kvd._native as native; ring = native.Ring(8, 4); ring.close(); "
             "print(kvd.__file__); print(native.__file__)")
    paths = run([python, "-c", probe], cwd=scratch).stdout.split()
    assert all(Path(path).is_relative_to(venv) for path in paths), paths
    # The image's ENTRYPOINT and CMD, as far as they run without a daemon:
    # `kvd config` with the CMD's flags prints the configuration they make.
    runtime = installed["runtime"]
    entrypoint = json.loads(next(line for line in runtime if line.startswith("ENTRYPOINT")).split(None, 1)[1])
    command = json.loads(next(line for line in runtime if line.startswith("CMD")).split(None, 1)[1])
    assert entrypoint == ["kvd"] and command[0] == "serve"
    printed = run([str(venv / "bin" / entrypoint[0]), "config", *command[1:]], cwd=scratch).stdout
    config = json.loads(printed)
    assert config["state_dir"] == "/var/run/kvd" and config["host"]["capacity_bytes"] == 1 << 30
    exposed = {int(port) for line in runtime if line.startswith("EXPOSE") for port in line.split()[1:]}
    assert exposed == {int(config["server"]["tcp_address"].rsplit(":", 1)[1]),
                       int(config["metrics"]["address"].rsplit(":", 1)[1])}
    # The image runs as a non-root user, and the state directory it is given is created for it.
    user = next(line for line in runtime if line.startswith("USER")).split()[1]
    assert user not in ("root", "0")
    assert any(re.search(rf"install -d -o {user} .*{config['state_dir']}", line) for line in runtime)


def test_native_engine_tests_pass_against_the_installed_wheel(installed):
    scratch = installed["scratch"]
    shutil.copytree(ROOT / "tests" / "native", scratch / "tests" / "native",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (scratch / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    result = subprocess.run([str(installed["python"]), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "tests/native"], cwd=scratch, capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert re.search(r"\d+ passed", result.stdout) and "skipped" not in result.stdout, result.stdout[-2000:]
