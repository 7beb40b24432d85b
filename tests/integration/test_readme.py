"""The snippets of README.md and docs/*.md run as written (issue 10: the README's Python
snippet used undefined names, so a newcomer's first paste failed).

Every ```python block runs in a process of its own, from a directory whose
state/kvd.sock is a real daemon's socket, as after `make run` from the
repository root. Every ```toml block loads as a kvd configuration.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvd import config as kvd_config
from kvd.testing.daemon import run_daemon

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def snippets(language: str) -> list[str]:
    return [body for document in DOCUMENTS for kind, body in FENCE.findall(document.read_text()) if kind == language]


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
        yield directory


def test_the_documents_have_snippets():
    assert len(snippets("python")) >= 2 and snippets("toml")
    readme = FENCE.findall((ROOT / "README.md").read_text())
    assert any(kind == "python" for kind, _ in readme)  # the one example a newcomer pastes first
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300  # read in ten minutes


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
