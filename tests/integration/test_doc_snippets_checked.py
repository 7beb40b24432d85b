"""The snippets of README.md and docs/*.md that start long things, checked without running them;
and that every fenced block has a language some test handles (issue 36 item 6).

- `make TARGET`: `make -n TARGET` succeeds, and every script and `-m` module it would run exists.
- a Python script or module with flags (`python -m kvd.sim --seed 1 ...`): it exists and its
  `--help` lists every flag given; a shell script (`bash tools/x.sh ARGS`): it exists, parses
  (`bash -n`) and its own usage text is the documented command line.
- `vllm serve` and the harness's `python -m kvd.testing.vllm_cli serve`: the JSON given to
  --kv-transfer-config is what kvd.testing.vllm_server (the engine tests' and benchmarks'
  harness) passes, built by its connector_config, and kvd's connector config
  (ConnectorConfig.from_extra) accepts its options; the flags are the harness's, with its values.
- SGLang's `python -m sglang.launch_server`: the extra config names kvd's backend module and class,
  and every key is SGLang's own or one KvdSettings.from_extra_config reads. SGLang's own flags
  are not checked here: its parser lives in .venv-sglang, which tests/engines needs and this
  module does not.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

import kvd.connectors.vllm
from kvd.connectors.vllm.config import ConnectorConfig
from kvd.testing import vllm_server
from tests.integration.doc_snippets import (DOCUMENTS, KINDS, LANGUAGES, ROOT, argument, blocks, commands, indented_code,
                                            kind, program, sh_commands)

# Keys SGLang's dynamic backend factory and its HiCache controller take from the extra config
# themselves (sglang/srt/mem_cache: backend_name, module_path and class_name load the class,
# interface_v1 and hicache_storage_pass_prefix_keys are popped by the controller); the rest
# reach the backend.
SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "hicache_storage_pass_prefix_keys"}


def test_every_block_has_a_language_a_test_handles():
    every = blocks()
    assert len(every) >= 30
    assert [block.where for block in every if block.language not in LANGUAGES] == []
    assert [f"{document.relative_to(ROOT)}:{line}" for document in DOCUMENTS for line in indented_code(document)] == []


def test_every_sh_command_is_run_or_checked():
    claimed = sh_commands()
    assert [f"{command.where}: {command.text}" for command in claimed if kind(command) not in KINDS] == []
    assert {kind(command) for command in claimed} == set(KINDS), "a kind no snippet uses: drop it"


def test_the_checks_see_what_they_should(tmp_path):
    """The fence reader finds an untagged and an indented block, keeps a compound command and a
    multi-line quote whole, and a new program is claimed by no kind."""
    document = tmp_path / "doc.md"
    document.write_text("Text:\n\n```\nx\n```\n\n    indented\n\n- item\n\n  ```sh\n  for a in b; do\n    "
                        "echo '{\n    }'\n  done\n  rsync a b\n  ```\n")
    from tests.integration.doc_snippets import fenced_blocks

    untagged, sh = fenced_blocks(document)
    assert (untagged.language, sh.language, indented_code(document)) == ("", "sh", [7])
    loop, rsync = commands(sh)
    assert loop.text.startswith("for a") and loop.text.endswith("done") and (loop.line, rsync.line) == (12, 16)
    assert kind(rsync) is None and kind(loop) is None


def output_of(command: list[str], timeout_s: float) -> str:
    """What `command` prints, run from the repository root; it must succeed."""
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert result.returncode == 0, f"{shlex.join(command)}:\n{result.stderr[-2000:]}"
    return result.stdout


@cache
def dry_run(target: str) -> str:
    return output_of(["make", "-n", "--no-print-directory", target], 60)


@pytest.mark.parametrize("command", sh_commands("make"), ids=lambda command: command.where)
def test_make_targets_exist_and_what_they_run_is_there(command):
    _, targets = program(command)
    assert targets and all(not target.startswith("-") for target in targets), command.text
    for target in targets:
        recipe = dry_run(target)
        assert recipe.strip(), f"make {target} would run nothing"
        words = shlex.split(recipe.replace("\\\n", " "), comments=True)
        for runner, script, module in zip(words, words[1:], words[2:]):
            if runner.endswith(("python", "python3", "bash")) and re.fullmatch(r"[\w./-]+\.(py|sh)", script):
                assert (ROOT / script).is_file(), f"make {target} runs {script}, which is not there"
            elif runner.endswith(("python", "python3")) and script == "-m":
                assert importlib.util.find_spec(module), f"make {target} runs -m {module}, which is not there"


@cache
def help_text(*invocation: str) -> str:
    return output_of([sys.executable, *invocation, "--help"], 120)


@pytest.mark.parametrize("command", sh_commands("script"), ids=lambda command: command.where)
def test_scripts_exist_and_take_the_flags_given(command):
    name, args = program(command)
    if name == "bash":
        script = ROOT / args[0]
        assert script.is_file() and subprocess.run(["bash", "-n", str(script)]).returncode == 0, command.text
        assert shlex.join(args) in script.read_text(), f"{script} does not give `{shlex.join(args)}` as its usage"
        return
    invocation = tuple(args[:2]) if args[0] == "-m" else (args[0],)
    assert invocation[0] == "-m" and importlib.util.find_spec(invocation[1]) or (ROOT / invocation[0]).is_file()
    usage = help_text(*invocation)
    for flag in [arg.split("=")[0] for arg in args[len(invocation):] if arg.startswith("--")]:
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", usage), f"{command.where}: {flag} is not in --help"


class Started(Exception):
    """What the harness would have run, caught instead of starting vLLM."""


def harness_command(monkeypatch, tmp_path, target: str) -> list[str]:
    """The command line kvd.testing.vllm_server runs for a connector with this target."""
    def start(command, **_):
        raise Started(command)

    monkeypatch.setattr(vllm_server.subprocess, "Popen", start)
    with pytest.raises(Started) as started:
        with vllm_server.vllm_server(Path(".venv-vllm/bin/python"), Path("$MODEL_DIR"), tmp_path / "log",
                                     connector={"target": target}):
            pass
    return started.value.args[0]


def flags(argv: list[str]) -> dict[str, str | None]:
    """--flag -> its value (None for a switch), from a command line."""
    found = {}
    for at, arg in enumerate(argv):
        if arg.startswith("--"):
            value = argv[at + 1] if at + 1 < len(argv) and not argv[at + 1].startswith("--") else None
            found[arg] = value
    return found


@pytest.mark.parametrize("command", sh_commands("vllm"), ids=lambda command: command.where)
def test_vllm_command_lines_are_the_harness_and_the_connector_takes_them(command, monkeypatch, tmp_path):
    _, args = program(command)
    documented = json.loads(argument(args, "--kv-transfer-config"))
    extra = documented["kv_connector_extra_config"]
    assert documented == json.loads(vllm_server.connector_config(extra)), command.where
    assert documented["kv_connector"] in kvd.connectors.vllm.__all__
    assert importlib.util.find_spec(documented["kv_connector_module_path"]) is not None
    ConnectorConfig.from_extra(extra)
    harness = harness_command(monkeypatch, tmp_path, extra["target"])
    given, runs = flags(args), flags(harness)
    given.pop("--kv-transfer-config"), runs.pop("--kv-transfer-config")
    if args[:2] == ["-m", "kvd.testing.vllm_cli"]:  # "what the tests run": all of it, as the harness has it
        port = harness[harness.index("--port") + 1]
        assert [arg.replace("$PORT", port) for arg in args if not arg.startswith("{")] == [
            arg for arg in harness[1:] if not arg.startswith("{")], command.where
    else:
        assert args[0] == "serve" and {flag: runs.get(flag, "missing") for flag in given} == given, command.where


def names_read(function: ast.FunctionDef, mapping: str) -> set[str]:
    """The keys a function reads from a dict it calls `mapping` (mapping.get("k"), mapping["k"])."""
    keys = set()
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == mapping:
            keys.add(node.args[0].value)
        elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == mapping \
                and isinstance(node.slice, ast.Constant):
            keys.add(node.slice.value)
    return keys


def backend_module(module_path: str) -> tuple[ast.Module, str]:
    spec = importlib.util.find_spec(module_path)
    assert spec is not None and spec.origin, module_path
    source = Path(spec.origin).read_text()
    return ast.parse(source), source


@pytest.mark.parametrize("command", sh_commands("sglang"), ids=lambda command: command.where)
def test_sglang_command_lines_name_kvds_backend_and_its_keys(command):
    _, args = program(command)
    documented = json.loads(argument(args, "--hicache-storage-backend-extra-config"))
    assert argument(args, "--hicache-storage-backend") == "dynamic" and "--enable-hierarchical-cache" in args
    assert documented["backend_name"] == "kvd"
    tree, source = backend_module(documented["module_path"])
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    assert documented["class_name"] in classes, f"{documented['module_path']} has no {documented['class_name']}"
    (settings,) = [node for node in ast.walk(classes["KvdSettings"])
                   if isinstance(node, ast.FunctionDef) and node.name == "from_extra_config"]
    read = names_read(settings, "extra")
    assert read >= {"target", "token", "namespace", "prefill_profile"}
    assert set(documented) - SGLANG_KEYS - read == set(), command.where
    # The module's own docstring gives the same command line.
    docstring = ast.get_docstring(tree)
    quoted = re.search(r"--hicache-storage-backend-extra-config '([^']*)'", docstring).group(1)
    assert json.loads(quoted) == documented, command.where
