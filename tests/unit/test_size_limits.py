"""No Python class a reader must scroll (issue 36): classes at most 400 lines, modules at most 600.

Covers every Python file of the repository that we wrote: kvd/, tests/, bench/, tools/, examples/,
engines/, setup.py and any other .py below the repository root. Excluded are
- generated code: a module whose first lines carry the code generator's "DO NOT EDIT" (protoc's
  kvd/v1/kvd_pb2.py and kvd/v1/kvd_pb2_grpc.py);
- what is not ours though it lies in the tree: hidden directories (.git, .venv*, .device-bundle,
  .hypothesis, ...), virtual environments (a directory holding pyvenv.cfg), build output
  (build/, dist/, *.egg-info, __pycache__) and the scratch directories .gitignore names (a
  daemon's state/, bench_peers' kvd-peers-*/).
There is no list of exceptions: a file over a limit is split, not listed.
"""

from __future__ import annotations

import ast
import functools
import os
from pathlib import Path

ROOT = Path(__file__).parents[2]
CLASS_LINES = 400
MODULE_LINES = 600
BUILD_DIRS = {"build", "dist", "__pycache__", "node_modules"}
GENERATED_MARK = "DO NOT EDIT"


def not_ours(directory: Path) -> bool:
    """A directory below ROOT that holds no code of ours: hidden, a virtual environment, build output
    or scratch."""
    name = directory.name
    return (name.startswith(".") or name in BUILD_DIRS or name.endswith(".egg-info")
            or (directory / "pyvenv.cfg").exists() or scratch(directory))


def scratch(directory: Path) -> bool:
    """A scratch directory at the repository's top that .gitignore names: a daemon's state/, or
    bench_peers' kvd-peers-*/."""
    return directory.parent == ROOT and (directory.name == "state" or directory.name.startswith("kvd-peers-"))


def python_files(root: Path = ROOT) -> list[Path]:
    """Every .py below `root` outside the directories `not_ours` names, generated modules left out."""
    found = []
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(name for name in subdirectories if not not_ours(Path(directory, name)))
        for name in sorted(files):
            path = Path(directory, name)
            if name.endswith(".py") and not generated(path):
                found.append(path)
    return found


def generated(path: Path) -> bool:
    with path.open(errors="replace") as file:
        head = "".join(file.readline() for _ in range(3))
    return GENERATED_MARK in head


@functools.cache
def sizes() -> dict[str, int]:
    """Lines of every module, and of every class over CLASS_LINES, by relative path (and :Class)."""
    found = {}
    for path in python_files():
        name = str(path.relative_to(ROOT))
        text = path.read_text()
        found[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text, filename=name)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES:
                found[f"{name}:{node.name}"] = node.end_lineno - node.lineno + 1
    return found


def test_the_walk_covers_the_whole_repository_and_skips_generated_code():
    found = sizes()
    tops = {name.split("/")[0] for name in found if ":" not in name}
    assert {"kvd", "tests", "bench", "tools", "examples", "setup.py"} <= tops
    assert "kvd/core/engine.py" in found and "tests/unit/test_size_limits.py" in found
    assert not any(name.startswith("kvd/v1/kvd_pb2") for name in found)
    assert not any(part.startswith(".") for name in found for part in name.split("/"))


def test_classes_and_modules_stay_within_their_limits():
    found = sizes()
    assert len(found) > 300
    over = {name: lines for name, lines in found.items()
            if lines > (CLASS_LINES if ":" in name else MODULE_LINES)}
    assert not over, f"over the limit (classes {CLASS_LINES} lines, modules {MODULE_LINES}); split them: {over}"
