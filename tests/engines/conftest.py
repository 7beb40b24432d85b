"""What the engine tests share: vLLM's own venv (.venv-vllm), which `make test` builds first; its
absence fails the tests that need it rather than skipping them."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"


@pytest.fixture(scope="session")
def engine_python() -> Path:
    if not ENGINE_PYTHON.exists():
        pytest.fail(f"{ENGINE_PYTHON} is missing: run `make vllm-venv` (make test builds it)")
    return ENGINE_PYTHON
