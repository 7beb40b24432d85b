"""A real daemon in another process, shared by the tests of a module."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec
from kvd.testing.daemon import run_daemon

SMALL_SPEC = NamespaceSpec(
    model_id="integration-model", num_layers=4, num_kv_heads=2, head_dim=16, block_tokens=16, kv_dtype=DType.FLOAT32
)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    directory = tmp_path_factory.mktemp("kvd")
    with run_daemon(directory, config={"host": {"capacity_bytes": 16 << 20, "slot_bytes": 64 << 10}}) as process:
        yield process


@pytest.fixture
def client(daemon):
    with Client(daemon.unix_target) as client:
        yield client


def random_blocks(spec: NamespaceSpec, count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, *spec.block_shape), dtype=np.float32)
