"""The fenced blocks of README.md and docs/*.md, and which test answers for each.

Every block is accounted for by its language:

- ```python: run as written against a real daemon (test_doc_snippets_run.py);
- ```toml: loaded as a kvd configuration or tenants file (test_doc_snippets_run.py);
- ```sh: split into commands, each claimed by exactly one kind in `KINDS`:
  the commands a test can run cheaply run (test_doc_snippets_run.py), the
  others are checked without running them (test_doc_snippets_checked.py,
  test_doc_snippets_deploy.py);
- ```yaml: parsed and held against the manifests it documents (test_doc_snippets_deploy.py);
- ```text and ```console: output samples and formulas, not run; a console
  sample's `$ kvd ...` output is compared with the real command's
  (test_doc_snippets_run.py).

test_doc_snippets_checked.py fails on a block without a language, a language
not listed here, a command no kind claims, and an indented (unfenced) code
block, so no new snippet goes untested silently.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "toml", "sh", "yaml", "text", "console")
OPENING = re.compile(r"^( {0,3})(`{3,}|~{3,})\s*([^`\s]*)\s*$")
# Compound shell statements: a command that opens one runs to its closing keyword.
OPENERS = {"for": "done", "while": "done", "until": "done", "if": "fi"}


@dataclass(frozen=True)
class Block:
    document: Path
    line: int  # of the opening fence, 1-based
    language: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


@dataclass(frozen=True)
class Command:
    block: Block
    line: int
    text: str  # continuation lines joined, comments dropped

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text, comments=True)

    @property
    def where(self) -> str:
        return f"{self.block.document.relative_to(ROOT)}:{self.line}"


def fenced_blocks(document: Path) -> list[Block]:
    lines = document.read_text().splitlines()
    found, index = [], 0
    while index < len(lines):
        opening = OPENING.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, fence, language = len(opening.group(1)), opening.group(2), opening.group(3)
        closing = re.compile(rf"^ {{0,{indent + 3}}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = next((at for at in range(index + 1, len(lines)) if closing.match(lines[at])), None)
        assert end is not None, f"{document}:{index + 1}: a fence that never closes"
        body = "\n".join(re.sub(rf"^ {{0,{indent}}}", "", line) for line in lines[index + 1:end])
        found.append(Block(document, index + 1, language, body + "\n"))
        index = end + 1
    return found


def blocks(language: str | None = None) -> list[Block]:
    every = [block for document in DOCUMENTS for block in fenced_blocks(document)]
    return [block for block in every if language is None or block.language == language]


def indented_code(document: Path) -> list[int]:
    """Lines that open an indented code block (four spaces after a blank line, not inside a list
    item or a fence): a snippet no fence names the language of."""
    lines, found, fenced = document.read_text().splitlines(), [], False
    for at, line in enumerate(lines):
        if OPENING.match(line) or (fenced and re.match(r"^\s*(`{3,}|~{3,})\s*$", line)):
            fenced = not fenced
            continue
        if fenced or not line.startswith("    ") or at == 0 or lines[at - 1].strip():
            continue
        before = next((lines[back] for back in range(at - 1, -1, -1) if lines[back].strip()), "")
        if not re.match(r"^\s*([-*+]|\d+\.)\s", before) and not before.startswith("  "):
            found.append(at + 1)
    return found


def commands(block: Block) -> list[Command]:
    """A sh block's commands: lines joined while a quote or a `\\` continues them, or a compound
    statement (for ... done) is open; comment lines dropped."""
    found, pending, start, depth = [], "", 0, 0
    for offset, line in enumerate(block.body.splitlines()):
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            start = block.line + 1 + offset
        pending += line.removesuffix("\\") + ("\n" if not line.endswith("\\") else "")
        first = line.split()[0] if line.split() else ""
        depth += (first in OPENERS) - (first in OPENERS.values())
        if line.endswith("\\") or depth or not _complete(pending):
            continue
        found.append(Command(block, start, pending.strip()))
        pending = ""
    assert not pending, f"{block.where}: a command that never ends: {pending!r}"
    return found


def _complete(text: str) -> bool:
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on
        return False
    return True


def program(command: Command) -> tuple[str, list[str]]:
    """The program a command runs (its path's last part, a venv's `bin/` dropped) and its arguments."""
    argv = command.argv
    while argv and re.fullmatch(r"\w+=.*", argv[0]):  # VAR=value before the program
        argv = argv[1:]
    return (Path(argv[0]).name, argv[1:]) if argv else ("", [])


def kind(command: Command) -> str | None:
    """Which test answers for a sh command (a key of KINDS), or None: no test does."""
    name, args = program(command)
    if name in ("for", "while", "until"):
        return "kubectl" if "kubectl" in command.text else None
    if name == "kvd" and args and args[0] in RUN_KVD:
        return "run"
    if name in ("jq", "umask"):
        return "run"
    if name == "python" and args[:1] == ["-m"] and args[1:2] == ["kvd.testing.vllm_cli"]:
        return "vllm"
    if name == "python" and args[:2] == ["-m", "sglang.launch_server"]:
        return "sglang"
    if name == "python" and args and args[0] in RUN_SCRIPTS:
        return "run"
    if name in ("python", "bash"):
        return "script"
    if name == "vllm":
        return "vllm"
    return next((kind for kind, programs in PROGRAMS.items() if name in programs), None)


# kvd's own commands that run against the test daemon (or, `token` and `config`, need none).
RUN_KVD = ("health", "status", "namespaces", "delete", "config", "token")
# Scripts cheap enough to run as written against the test daemon.
RUN_SCRIPTS = ("examples/hf_prefix_reuse.py",)
PROGRAMS = {
    "make": ("make",),
    "wheel": ("pip",),
    "systemd": ("useradd", "install", "systemctl"),
    "docker": ("docker",),
    "kubectl": ("kubectl",),
}
KINDS = {
    "run": "run against a real daemon (test_doc_snippets_run.py)",
    "make": "`make -n TARGET` succeeds and what it would run exists (test_doc_snippets_checked.py)",
    "script": "the script exists and its --help has every flag given (test_doc_snippets_checked.py)",
    "vllm": "the harness's command line, kvd's connector config accepts it (test_doc_snippets_checked.py)",
    "sglang": "the backend's module, class and config keys (test_doc_snippets_checked.py)",
    "wheel": "the project the wheel is built from (test_doc_snippets_deploy.py)",
    "systemd": "the unit's user, state directory, config and drop-in (test_doc_snippets_deploy.py)",
    "docker": "the Dockerfile's entry point takes the arguments (test_doc_snippets_deploy.py)",
    "kubectl": "the names it uses are the rendered manifests' (test_doc_snippets_deploy.py)",
}


def sh_commands(of_kind: str | None = None) -> list[Command]:
    every = [command for block in blocks("sh") for command in commands(block)]
    return [command for command in every if of_kind is None or kind(command) == of_kind]


def argument(args: list[str], flag: str) -> str:
    """The value of `flag` in a command's arguments (`--flag value` or `--flag=value`)."""
    for at, arg in enumerate(args):
        if arg == flag:
            return args[at + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"no {flag} in {args}")
