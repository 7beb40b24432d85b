#!/usr/bin/env python3
"""Fail when a function is longer than the limit (lines from `def` to its last line).

A function a reader must scroll holds more than one idea; split it. The
limit follows TigerBeetle's 70 lines. Generated code (kvd/v1) is skipped.

Usage: tools/check_function_length.py [--max-lines 70] PATH...
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

GENERATED = ("kvd/v1",)


def long_functions(path: Path, max_lines: int) -> list[tuple[int, str, int]]:
    """(line, name, length) of every function in `path` over `max_lines`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = node.decorator_list[0].lineno if node.decorator_list else node.lineno
            length = node.end_lineno - start + 1
            if length > max_lines:
                found.append((node.lineno, node.name, length))
    return found


def python_files(paths: list[str]) -> list[Path]:
    files = []
    for name in paths:
        path = Path(name)
        candidates = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        files.extend(file for file in candidates if not any(part in file.as_posix() for part in GENERATED))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-lines", type=int, default=70)
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    failures = [(file, *found) for file in python_files(args.paths) for found in long_functions(file, args.max_lines)]
    for file, line, name, length in failures:
        print(f"{file}:{line}: {name} is {length} lines (at most {args.max_lines}): split it", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
