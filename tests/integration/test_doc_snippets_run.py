"""The snippets of README.md and docs/*.md that run, run as written against a real daemon (issue 10:
the README's Python snippet used undefined names, so a newcomer's first paste failed; issue 36:
every snippet still runs in a test).

One daemon serves the module, from a directory laid out like the repository root after `make
run`: state/kvd.sock is the daemon's socket, `.venv` links to the venv running the tests and
`examples` to the repository's. So the commands run with nothing substituted but:

- NAME_OR_ID (README: `kvd delete --namespace NAME_OR_ID`), which names a namespace this test
  stored, and the answer `y` typed at the prompt `kvd delete` asks on its terminal (a pty);
- `kvd` without `.venv/bin/` (docs/operations.md, after `pip install`) is the venv's, on PATH.

Every ```python block runs in a process of its own; every ```toml block loads as a kvd
configuration; every sh command doc_snippets.kind calls "run" runs, the commands of a block in
order in one shell, and each has its output checked (`expect`); a ```console sample's command
parses with kvd's own parser and its output has the shape the real command's has.
"""

from __future__ import annotations

import hashlib
import json
import os
import pty
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvd import config as kvd_config
from kvd.cli import build_parser
from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec
from kvd.testing.daemon import run_daemon
from tests.integration.doc_snippets import ROOT, Block, Command, blocks, commands, kind, program

VENV = Path(sys.executable).parent.parent  # not resolved: the venv's bin/, not the interpreter it links to
# What the README's `kvd delete --namespace NAME_OR_ID` deletes: stored by the test first.
DELETED = NamespaceSpec(model_id="doc-snippets-delete", num_layers=2, num_kv_heads=1, head_dim=32, block_tokens=16,
                        kv_dtype=DType.FLOAT32)
DELETED_BLOCKS = 4
MARK = "@@doc-snippet-command "
RUN_BLOCKS = [block for block in blocks("sh") if any(kind(command) == "run" for command in commands(block))]

# What the events snippet (a function a router runs) is driven with: one Put,
# and the mirror must show its blocks in host memory.
EVENTS_DRIVER = textwrap.dedent('''
    import threading

    import numpy as np

    from kvd.client import Client
    from kvd.core.keys import DType, NamespaceSpec

    class Seen(Exception):
        pass

    spec = NamespaceSpec(model_id="readme-events", num_layers=2, num_kv_heads=1, head_dim=32, block_tokens=16,
                         kv_dtype=DType.FLOAT32)
    with Client("unix:state/kvd.sock") as client:
        ns = client.register_namespace(spec)
        keys = ns.keys(list(range(64)))
        ready, done = threading.Event(), []

        def on_change(mirror):
            if all(key in mirror.tiers for key in keys):
                raise Seen()

        def follow():
            try:
                mirror_forever(client, ns, on_change)
            except Seen:
                done.append(True)

        follower = threading.Thread(target=follow)
        follower.start()
        client.put(ns, keys, np.ones((4, *spec.block_shape), dtype=np.float32))
        follower.join(60)
        assert done == [True], "the mirror never saw the Put"
''')


@pytest.fixture(scope="module")
def daemon_directory(tmp_path_factory):
    directory = tmp_path_factory.mktemp("readme")
    # As `make run`'s defaults, smaller: 2 MiB slots, state in ./state.
    with run_daemon(directory, config={"host": {"capacity_bytes": 256 << 20, "slot_bytes": 2 << 20}}):
        assert (VENV / "bin" / "kvd").exists(), f"{VENV} has no kvd: the tests run from kvd's venv"
        (directory / ".venv").symlink_to(VENV)
        (directory / "examples").symlink_to(ROOT / "examples")
        yield directory


@pytest.fixture(scope="module")
def outputs(daemon_directory) -> dict[str, list[tuple[Command, str, str]]]:
    """Each runnable block's commands with their stdout and stderr, run once for the module."""
    with Client(f"unix://{daemon_directory}/state/kvd.sock") as client:
        namespace = client.register_namespace(DELETED)
        assert client.put(namespace, namespace.keys(list(range(DELETED_BLOCKS * 16))),
                          np.ones((DELETED_BLOCKS, *DELETED.block_shape), dtype=np.float32)) == DELETED_BLOCKS
    return {block.where: run_commands(block, daemon_directory) for block in RUN_BLOCKS}


def run_commands(block: Block, directory: Path) -> list[tuple[Command, str, str]]:
    """The block's runnable commands in one bash, in order, stdin a terminal with `y` typed."""
    runnable = [command for command in commands(block) if kind(command) == "run"]
    script = "set -e\n" + "".join(f"echo '{MARK}{at}'; echo '{MARK}{at}' >&2\n"
                                  f"{command.text.replace('NAME_OR_ID', DELETED.model_id)}\n"
                                  for at, command in enumerate(runnable))
    env = {**os.environ, "PATH": f"{VENV / 'bin'}:{os.environ['PATH']}"}
    terminal, stdin = pty.openpty()
    try:
        os.write(terminal, b"y\n")
        result = subprocess.run(["bash", "-c", script], cwd=directory, env=env, stdin=stdin, capture_output=True,
                                text=True, timeout=300)
    finally:
        os.close(stdin)
        os.close(terminal)
    stdouts, stderrs = result.stdout.split(MARK)[1:], result.stderr.split(MARK)[1:]
    assert result.returncode == 0, (f"{runnable[len(stdouts) - 1].where} failed ({result.returncode}):\n"
                                    f"{result.stdout[-2000:]}\n{result.stderr[-3000:]}")
    return [(command, out.split("\n", 1)[1], err.split("\n", 1)[1])
            for command, out, err in zip(runnable, stdouts, stderrs, strict=True)]


def snippets(language: str) -> list[str]:
    return [block.body for block in blocks(language)]


def test_the_documents_have_snippets():
    assert len(snippets("python")) >= 2 and snippets("toml") and RUN_BLOCKS
    readme = [block.language for block in blocks() if block.document.name == "README.md"]
    assert "python" in readme  # the one example a newcomer pastes first
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300  # read in ten minutes


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda block: block.where)
def test_sh_commands_run_as_written(outputs, daemon_directory, block):
    """First in the module: after the Python snippets had filled half the arena, the README's
    example took 17.7 s here instead of 6.6 s."""
    for command, out, err in outputs[block.where]:
        expect(command, out, err, daemon_directory)


@pytest.mark.parametrize("index", range(len(snippets("python"))))
def test_python_snippet_runs_as_written(daemon_directory, index):
    code = snippets("python")[index]
    if "def mirror_forever" in code:
        code += EVENTS_DRIVER
    result = subprocess.run([sys.executable, "-c", code], cwd=daemon_directory, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, f"snippet {index} failed:\n{code}\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("index", range(len(snippets("toml"))))
def test_toml_snippet_is_a_valid_configuration(tmp_path, index):
    """A daemon's configuration; or, for a [[tenants]] table, a tenants file (auth.tenants_file)."""
    path = tmp_path / "kvd.toml"
    text = snippets("toml")[index]
    path.write_text(text)
    if text.lstrip().startswith("[[tenants]]"):
        assert kvd_config.load_tenants(path, env={"KVD_OPS_TOKEN": "a-token-from-the-environment"})
    else:
        kvd_config.load(path, env={})


def expect(command: Command, out: str, err: str, directory: Path) -> None:
    """What each command that runs must have printed or written (a new one needs its case here)."""
    name, args = program(command)
    sub = args[0] if name == "kvd" else Path(args[0]).name
    where = f"{command.where}: {command.text}\n{out[-2000:]}\n{err[-2000:]}"
    if sub == "health":
        assert out.strip() == "SERVING", where
    elif sub in ("status", "namespaces"):
        rows = [row for row in out.splitlines() if DELETED.model_id in row]
        assert rows and (sub == "status" or f" {DELETED_BLOCKS} " in rows[0]), where
    elif sub == "delete":
        assert "? [y/N]" in err and out.startswith(f"deleted {DELETED_BLOCKS} blocks of namespace "), where
        with Client(f"unix://{directory}/state/kvd.sock") as client:
            namespace = client.register_namespace(DELETED)
            assert client.lookup(namespace, namespace.keys(list(range(DELETED_BLOCKS * 16)))).matched == 0
    elif sub == "config":
        assert {"state_dir", "host", "server", "disk"} <= set(json.loads(out)), where
    elif sub == "token" or name in ("jq", "umask"):
        expect_token_files(command, out, directory)
    elif sub == "hf_prefix_reuse.py":
        assert "bit-exact: True" in out and "TTFT restored" in out, where
    else:
        raise AssertionError(f"{command.where}: no expectation for a command that runs: {command.text}")


def expect_token_files(command: Command, out: str, directory: Path) -> None:
    """`kvd token --json > F`: a token and its digest; `jq -j .token F > G`: the token alone, no
    newline, readable by its owner only (umask 077); `jq -r .token_sha256 F...`: the digests."""
    argv = command.argv
    if ">" in argv:
        written = directory / argv[argv.index(">") + 1]
        assert written.stat().st_mode & 0o077 == 0, f"{written} is readable by others"
    if argv[:3] == ["kvd", "token", "--json"]:
        made = json.loads(written.read_text())
        assert hashlib.sha256(made["token"].encode()).hexdigest() == made["token_sha256"]
    elif argv[:3] == ["jq", "-j", ".token"]:
        assert written.read_text() == json.loads((directory / argv[3]).read_text())["token"]
    elif argv[:3] == ["jq", "-r", ".token_sha256"]:
        assert out.split() == [json.loads((directory / made).read_text())["token_sha256"] for made in argv[3:]]
    else:
        assert argv == ["umask", "077"], command.text


def shape(line: str) -> str:
    """A line of `kvd namespaces` / `kvd delete` output with its values replaced by their kinds."""
    line = re.sub(r"'[^']*'", "Q", line.strip())
    line = re.sub(r"\b[0-9a-f]{16}\b", "ID", line).replace(" tenant Q", "")  # tenant: shown only with tenants
    line = re.sub(r"\d+(\.\d+)?", "N", line)
    return re.sub(r"; \w+ N \(N \w+\)(, \w+ N \(N \w+\))*", "; TIERS", line)  # one per tier the daemon has


@pytest.mark.parametrize("block", blocks("console"), ids=lambda block: block.where)
def test_console_samples_look_like_the_real_output(outputs, block):
    """A sample's `$ kvd ...` parses as kvd's command line; its output has the shape of the same
    command's real output in the README's run, where the daemon has no tenants and no disk tier."""
    lines = block.body.splitlines()
    assert lines[0].startswith("$ kvd "), f"{block.where}: a console sample is `$ kvd ...` and its output"
    argv = lines[0].removeprefix("$ ").split()
    build_parser().parse_args(argv[1:])
    real = {program(command)[1][0]: (out, err) for results in outputs.values() for command, out, err in results
            if program(command)[0] == "kvd"}
    out, err = real[argv[1]]
    if argv[1] == "namespaces":
        sample_header = re.split(r"\s{2,}", lines[1].strip())
        real_header = re.split(r"\s{2,}", out.splitlines()[0].strip())
        assert [column for column in sample_header if column in real_header] == real_header
        assert set(sample_header) - set(real_header) <= {"tenant", "disk"}, block.where
    elif argv[1] == "delete":
        assert shape(lines[1]).removesuffix(" y") == shape(err), block.where  # y: the answer typed
        assert shape(lines[2]) == shape(out), block.where
    else:
        raise AssertionError(f"{block.where}: no real output to compare `{lines[0]}` with")
