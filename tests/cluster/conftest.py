"""Cluster tests run against a real etcd server started by the harness."""

from __future__ import annotations

import shutil

import pytest

from kvd.testing.etcd import EtcdServer


@pytest.fixture(scope="module")
def etcd():
    if shutil.which("etcd") is None:
        pytest.fail("etcd is not installed: make test installs etcd-server (apt)")
    with EtcdServer() as server:
        yield server
