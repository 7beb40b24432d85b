"""The disk tier through a real daemon: disk errors and a vanished drive cost only
their blocks, and drives of another layout or of zero segments at startup
(shared pieces: tests/integration/disk_tier_helpers.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvd.client import Client
from kvd.testing.daemon import run_daemon
from tests.integration.disk_tier_helpers import SPEC, blocks_for, disk_config, metric_samples


@pytest.mark.parametrize(("write_fault", "read_fault"), [("EIO", "EIO"), ("ENOSPC", "SHORT")])
def test_disk_errors_become_misses_and_the_daemon_keeps_serving(tmp_path, write_fault, read_fault):
    """A fault on every disk write, then on every disk read (injected through
    the I/O engine: EIO, a full drive, short reads): durable Puts fail
    precisely, nothing wrong is served, the host tier keeps working and the
    error metrics count what happened."""
    import grpc

    directory = tmp_path / "d"
    config = disk_config(tmp_path)
    keys_and_blocks = []
    with run_daemon(directory, config=config, env={"KVD_INJECT_IO_FAULTS": f"write:{write_fault}:100000"}) as daemon, \
            Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(4 * 16))
        blocks = blocks_for(4, seed=7)
        with pytest.raises(grpc.RpcError) as raised:
            client.put(namespace, keys, blocks, durable=True)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "keys[0:4] are not" in raised.value.details() and "the disk write failed" in raised.value.details()
        # Still in host memory, served bit-exact.
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_disk_failures_total{operation="write"}'] >= 1
        assert samples['kvd_tier_blocks{tier="disk"}'] == 0
    # A healthy run stores blocks durably ...
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(6 * 16) + 5000)
        blocks = blocks_for(6, seed=8)
        client.put(namespace, keys, blocks, durable=True)
        keys_and_blocks = (keys, blocks)
    # ... and a run whose reads all fail serves none of them, and no wrong byte.
    with run_daemon(directory, config=config, env={"KVD_INJECT_IO_FAULTS": f"read:{read_fault}:100000"}) as daemon, \
            Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys, blocks = keys_and_blocks
        assert client.lookup(namespace, keys).matched == 6
        assert client.get_numpy(namespace, keys).shape[0] == 0
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_disk_failures_total{operation="load"}'] >= 1
        # The daemon still serves new blocks from memory.
        fresh = namespace.keys(np.arange(2 * 16) + 9000)
        fresh_blocks = blocks_for(2, seed=9)
        client.put(namespace, fresh, fresh_blocks)
        assert np.array_equal(client.get_numpy(namespace, fresh), fresh_blocks)


def test_a_vanished_drive_directory_costs_only_its_blocks(tmp_path):
    """One drive's directory disappears under a running daemon (a drive
    pulled, a mount gone): durable Puts that need it fail precisely, what
    is served stays bit-exact, and a restart serves the rest from disk."""
    import shutil

    import grpc

    directory = tmp_path / "d"
    config = disk_config(tmp_path)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(6 * 16))
        blocks = blocks_for(6, seed=3)
        client.put(namespace, keys, blocks, durable=True)
        shutil.rmtree(tmp_path / "nvme1")
        assert np.array_equal(client.get_numpy(namespace, keys), blocks)
        more = namespace.keys(np.arange(4 * 16) + 1000)
        more_blocks = blocks_for(4, seed=4)
        with pytest.raises(grpc.RpcError) as raised:
            client.put(namespace, more, more_blocks, durable=True)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert np.array_equal(client.get_numpy(namespace, more), more_blocks)  # host memory still serves
        samples = metric_samples(daemon.metrics_url)
        assert samples['kvd_disk_failures_total{operation="write"}'] >= 1
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        for stored_keys, stored in ((keys, blocks), (more, more_blocks)):
            got = client.get_numpy(namespace, stored_keys)
            # Blocks on the lost drive are gone, and with them every block
            # after them in the chain; what comes back is a bit-exact prefix.
            assert got.shape[0] < stored.shape[0]
            assert np.array_equal(got, stored[: got.shape[0]])
        assert client.get_numpy(namespace, keys).shape[0] >= 1  # block 0 lives on drive 0


def test_a_disk_directory_of_another_layout_stops_the_daemon_with_a_clear_message(tmp_path):
    """Exit 2 (systemd's RestartPreventExitStatus), the directory and field
    named, no traceback; the drive is left as it was."""
    import subprocess
    import sys

    directory = tmp_path / "d"
    with run_daemon(directory, config=disk_config(tmp_path)):
        pass
    identity = (tmp_path / "nvme0" / "IDENTITY").read_bytes()
    config_path = tmp_path / "other.toml"
    config_path.write_text(
        f'state_dir = "{tmp_path / "state2"}"\n[server]\ntcp_address = ""\n[metrics]\naddress = ""\n'
        f'[host]\ncapacity_bytes = "4MiB"\nslot_bytes = "64KiB"\n'
        f'[disk]\ndirectories = ["{tmp_path / "nvme0"}", "{tmp_path / "nvme1"}"]\n'
        f'capacity_bytes = "8MiB"\nslot_bytes = "128KiB"\nsegment_bytes = "4MiB"\n'
    )
    result = subprocess.run([sys.executable, "-m", "kvd", "serve", "--config", str(config_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "kvd: cannot start: disk directory" in result.stderr and "slot_bytes" in result.stderr
    assert "Traceback" not in result.stderr
    assert (tmp_path / "nvme0" / "IDENTITY").read_bytes() == identity


def test_a_daemon_with_zero_segments_starts_on_written_zeros_and_serves_from_them(tmp_path):
    """disk.zero_segments through a real daemon: every segment it created is written (no unwritten
    extent left), and a durable Put survives a restart bit-exact."""
    from tests.disk.test_zero_segments import unwritten_bytes

    directory, config = tmp_path / "d", disk_config(tmp_path, zero_segments=True)
    blocks = blocks_for(4, seed=81)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        segments = sorted(tmp_path.glob("nvme*/**/seg-*"))
        assert len(segments) == 4 and all(unwritten_bytes(path) == 0 for path in segments)
        namespace = client.register_namespace(SPEC)
        keys = namespace.keys(np.arange(4 * 16))
        client.put(namespace, keys, blocks, durable=True)
    with run_daemon(directory, config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        np.testing.assert_array_equal(client.get_numpy(namespace, keys), blocks)
