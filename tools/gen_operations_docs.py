"""Regenerate the generated sections of docs/operations.md.

    .venv/bin/python tools/gen_operations_docs.py          # rewrite them
    .venv/bin/python tools/gen_operations_docs.py --check  # exit 1 if stale

Two sections, each between a BEGIN and an END marker:
- config-reference: every setting of kvd.config.Config, its type, its
  default (the embedded kvd/default.toml as `kvd config` loads it), its
  environment variable and its comment (the comment above the field in
  its section's module of kvd/config/, else the comment beside it in
  kvd/default.toml);
- metrics-reference: the table in kvd/metrics.py's docstring.
tests/deploy/test_operations_docs.py fails when either is stale.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Any, get_type_hints

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from kvd import config as config_module

DOCS = ROOT / "docs" / "operations.md"
SECTIONS = ("config-reference", "metrics-reference")
METRIC_ROW = re.compile(r"^\| (kvd_\w+) \| (\w+) \|\s*([\w, ]*?)\s*\| (.+) \|$")
_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    kind: str
    default: str
    env: str
    comment: str


def _source_comments() -> dict[tuple[str, str], str]:
    """(class name, field) -> the comment lines right above the field, in every module of kvd/config/."""
    found = {}
    for path in sorted(Path(config_module.__file__).parent.glob("*.py")):
        found.update(_module_comments(path.read_text()))
    return found


def _module_comments(source: str) -> dict[tuple[str, str], str]:
    """(class name, field) -> the comment lines right above the field (and beside it) in `source`."""
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    found = {}
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.ClassDef):
            continue
        for item in node.body:
            if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                lines, line = [], item.lineno - 1
                while line in comments and not source.splitlines()[line - 1].split("#")[0].strip():
                    lines.insert(0, comments[line])
                    line -= 1
                inline = comments.get(item.lineno)
                if inline:
                    lines.append(inline)
                if lines:
                    found[(node.name, item.target.id)] = " ".join(lines)
    return found


def _toml_comments() -> dict[str, str]:
    """dotted name -> the comment beside it (and on the indented lines after it,
    or on the lines right above it) in kvd/default.toml. A comment that goes
    on from the line before ("... down to this fraction") says so."""
    found: dict[str, str] = {}
    table, above, last = "", [], None
    for raw in config_module.default_toml().splitlines():
        line = raw.strip()
        if not line:
            above, last = [], None
        elif line.startswith("#"):
            if last is not None and raw.startswith(" "):
                found[last] = f"{found.get(last, '')} {line.lstrip('#').strip()}".strip()
            else:
                above.append(line.lstrip("#").strip())
        elif line.startswith("["):
            table, above, last = line.strip("[]") + ".", [], None
        else:
            key, _, rest = line.partition("=")
            name = table + key.strip()
            _value, sep, comment = rest.partition(" #")
            text = comment.strip().lstrip("#").strip() if sep else " ".join(above)
            if text.startswith("...") and last is not None:
                text = f"With `{last}`: {text[3:].strip()}"
            text = text.removesuffix("...").strip()
            if text:
                found[name] = text
            above, last = [], name
    return found


def _kind(name: str, hint: Any) -> str:
    if name.endswith("_bytes"):
        return "bytes"
    if getattr(hint, "__origin__", None) is list:
        return "list of strings"
    return {int: "integer", float: "number", bool: "boolean", str: "string"}[hint]


def _toml_value(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if name.endswith("_bytes") and isinstance(value, int):
        for unit_bytes, unit in _UNITS:
            if value and value % unit_bytes == 0:
                return f'"{value // unit_bytes}{unit}"'
        return str(value)
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, list):
        return "[" + ", ".join(f'"{item}"' for item in value) + "]"
    return repr(value)


def settings() -> list[Setting]:
    """Every setting, in the order of kvd.config.Config and its sections."""
    defaults = config_module.load(env={})
    source, toml = _source_comments(), _toml_comments()
    rows = []

    def visit(instance: Any, prefix: str) -> None:
        hints = get_type_hints(type(instance))
        for field in dataclasses.fields(instance):
            value = getattr(instance, field.name)
            if dataclasses.is_dataclass(value):
                visit(value, f"{prefix}{field.name}.")
                continue
            name = prefix + field.name
            comment = source.get((type(instance).__name__, field.name)) or toml.get(name, "")
            env = config_module.ENV_PREFIX + name.replace(".", "_").upper()
            rows.append(Setting(name, _kind(name, hints[field.name]), _toml_value(name, value), env, comment))

    visit(defaults, "")
    return rows


def metrics() -> list[tuple[str, str, str, str]]:
    """(name, type, labels, meaning) of every row of kvd/metrics.py's table."""
    import kvd.metrics

    return [match.groups() for match in map(METRIC_ROW.match, kvd.metrics.__doc__.splitlines()) if match]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render(section: str) -> str:
    if section == "config-reference":
        lines = ["| setting | type | default | environment variable | meaning |", "|---|---|---|---|---|"]
        lines += [f"| `{row.name}` | {row.kind} | `{_cell(row.default)}` | `{row.env}` | {_cell(row.comment)} |"
                  for row in settings()]
    else:
        lines = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
        lines += [f"| `{name}` | {kind} | {labels} | {meaning} |" for name, kind, labels, meaning in metrics()]
    return "\n".join(lines)


def begin_marker(section: str) -> str:
    return f"<!-- BEGIN GENERATED {section}: tools/gen_operations_docs.py writes this; do not edit -->"


def end_marker(section: str) -> str:
    return f"<!-- END GENERATED {section} -->"


def update(text: str) -> str:
    """`text` with every generated section rendered afresh."""
    for section in SECTIONS:
        begin, end = begin_marker(section), end_marker(section)
        if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
            raise ValueError(f"{DOCS} needs exactly one {begin!r} ... {end!r}")
        head, rest = text.split(begin)
        _old, tail = rest.split(end)
        text = f"{head}{begin}\n{render(section)}\n{end}{tail}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/operations.md is stale")
    args = parser.parse_args(argv)
    current = DOCS.read_text()
    fresh = update(current)
    if args.check:
        if fresh != current:
            print(f"{DOCS.relative_to(ROOT)} is stale: run tools/gen_operations_docs.py", file=sys.stderr)
            return 1
        return 0
    if fresh != current:
        DOCS.write_text(fresh)
        print(f"rewrote the generated sections of {DOCS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
