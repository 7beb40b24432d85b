"""The function-length gate of `make lint` (tools/check_function_length.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TOOL = Path(__file__).resolve().parents[2] / "tools" / "check_function_length.py"


def function_of(lines: int, *, decorated: bool = False) -> str:
    head = ["@staticmethod"] if decorated else []
    body = [f"    x{number} = {number}" for number in range(lines - 1 - len(head))]
    return "\n".join(head + ["def f():"] + body) + "\n"


def run(tmp_path: Path, source: str, *extra: str) -> subprocess.CompletedProcess:
    path = tmp_path / "module.py"
    path.write_text(source)
    return subprocess.run([sys.executable, str(TOOL), *extra, str(tmp_path)], capture_output=True, text=True)


def test_a_function_at_the_limit_passes_and_one_line_more_fails_by_name(tmp_path):
    assert run(tmp_path, function_of(70)).returncode == 0
    failed = run(tmp_path, function_of(71))
    assert failed.returncode == 1
    assert "module.py:1: f is 71 lines (at most 70)" in failed.stderr


def test_decorators_count_and_the_limit_is_a_flag(tmp_path):
    assert run(tmp_path, function_of(71, decorated=True)).returncode == 1
    assert run(tmp_path, function_of(30), "--max-lines", "29").returncode == 1


def test_the_daemon_and_the_tools_pass():
    repo = TOOL.parents[1]
    result = subprocess.run([sys.executable, str(TOOL), str(repo / "kvd"), str(repo / "tools")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
