"""Fixtures of the deploy/k8s tests (their helpers: tests/deploy/k8s_helpers.py)."""

from __future__ import annotations

import pytest

from tests.deploy.k8s_helpers import KUSTOMIZATIONS, rendered_objects


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request, tmp_path_factory) -> dict:
    return rendered_objects(request.param, tmp_path_factory)
