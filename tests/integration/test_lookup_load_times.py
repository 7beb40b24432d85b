"""Lookup(load_times) against a real daemon with a disk tier on real files: how long each part of a
hit would take to load now (issue 38 item 1's measure). Unknown (NaN) for the disk until the
daemon has read from it; then host blocks cost nothing and each disk block the same, at the rate
the drives' recent reads ran."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvd.client import Client
from kvd.testing.daemon import run_daemon
from kvd.v1 import kvd_pb2
from tests.integration.test_device_disk_loads import disk_config, stored_on_disk_only
from tests.integration.test_device_plane import Engine


def test_load_times_are_unknown_before_the_disk_was_read_then_priced_per_tier(tmp_path):
    with run_daemon(tmp_path / "kvd", config=disk_config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        engine = Engine(client)
        _, keys = stored_on_disk_only(client, engine, 6, seed=21)
        assert client.lookup(engine.namespace, keys).load_s is None  # not asked
        unknown = client.lookup(engine.namespace, keys, load_times=True)
        assert unknown.matched == 6 and all(math.isnan(value) for value in unknown.load_s)
        assert len(client.get_numpy(engine.namespace, keys[:2])) == 2  # read from disk: the rate is measured
        priced = client.lookup(engine.namespace, keys, load_times=True)
        assert list(priced.tiers) == [kvd_pb2.TIER_HOST] * 2 + [kvd_pb2.TIER_DISK] * 4
        load_s = np.array(priced.load_s)
        assert load_s[:2].tolist() == [0.0, 0.0] and np.all(np.isfinite(load_s)) and np.all(load_s[2:] > 0)
        steps = np.diff(load_s[2:])
        np.testing.assert_allclose(steps, steps[0], rtol=1e-3)  # every disk block the same price
        assert load_s[2] == pytest.approx(steps[0], rel=1e-3)  # nothing queued ahead of it
        engine.close()
