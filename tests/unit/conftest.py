"""Fixtures of the engine API tests (tests/unit/test_engine*.py; their helpers
are in tests/unit/engine_helpers.py). The suite-wide guards, and the
engine_factory these build on, are in tests/conftest.py."""

from __future__ import annotations

import pytest

from kvd.core.engine import EngineLimits
from tests.unit.engine_helpers import LONG, SLOT_BYTES, SPEC, Checked, K
from kvd.core.requests import KeysRequest


@pytest.fixture
def make(engine_factory):
    def build(slots: int = 6, **limits) -> tuple[Checked, bytes]:
        engine = engine_factory(slots, SLOT_BYTES, limits=EngineLimits(**limits))
        namespace_id = engine.register_namespace(SPEC).namespace_id
        engine.verify()
        return Checked(engine), namespace_id

    return build


@pytest.fixture
def env(make):
    return make()


@pytest.fixture
def writing(env):
    """A write lease over abcd, nothing committed yet."""
    engine, ns = env
    result = engine.reserve(KeysRequest(ns, "writer", K("abcd"), LONG, 0))
    return engine, ns, result.lease.lease_id
