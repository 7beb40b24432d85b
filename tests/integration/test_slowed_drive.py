"""A drive slowed down under a real daemon (kvd.testing.slow_drive: a loop device with ext4 and a
cgroup v1 blkio read throttle for the daemon's process), and what the daemon then says a disk hit
costs (Lookup(load_times)): priced at the drive's throttled rate within a few MiB of reads once it
slows down, and the throttle really holds the daemon's O_DIRECT reads (the group counts them)."""

from __future__ import annotations

import numpy as np

from kvd.client import Client
from kvd.core.keys import DType, NamespaceSpec, chain_keys
from kvd.testing.daemon import run_daemon
from kvd.testing.slow_drive import slowed_drive
from kvd.v1 import kvd_pb2

SPEC = NamespaceSpec(model_id="slowed-drive-model", num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=128,
                     kv_dtype=DType.FLOAT32)  # 512 KiB blocks
THROTTLE = 8 << 20


def config(directory) -> dict:
    return {"host": {"capacity_bytes": 64 << 20, "slot_bytes": 512 << 10},
            "disk": {"directories": [str(directory)], "capacity_bytes": 256 << 20, "segment_bytes": 32 << 20,
                     "slot_bytes": 512 << 10, "write_mode": "through"}}


def disk_block_price(client, namespace, keys) -> float:
    """Seconds Lookup(load_times) puts on one more disk block (nothing is queued: every read is over)."""
    looked = client.lookup(namespace, keys, load_times=True)
    assert looked.tiers[-2:] == [kvd_pb2.TIER_DISK] * 2
    return looked.load_s[-1] - looked.load_s[-2]


def test_hits_on_a_drive_that_slows_down_are_priced_at_its_new_rate(tmp_path):
    with slowed_drive(tmp_path / "nvme0", size_bytes=1 << 30) as drive, \
            run_daemon(tmp_path / "kvd", config=config(drive.directory)) as daemon, \
            Client(daemon.unix_target) as client:
        drive.admit(daemon.pid)
        namespace = client.register_namespace(SPEC)
        keys = chain_keys(SPEC, np.arange(48 * SPEC.block_tokens))
        data = np.random.default_rng(1).standard_normal((48, *SPEC.block_shape), dtype=np.float32)
        assert client.put(namespace, keys, data, durable=True) == 48
        assert client.demote().blocks_demoted >= 48
        np.testing.assert_array_equal(client.get_numpy(namespace, keys[:4]), data[:4])  # unthrottled reads
        fast = disk_block_price(client, namespace, keys)
        drive.throttle(read_bps=THROTTLE)
        before = drive.read_bytes()
        np.testing.assert_array_equal(client.get_numpy(namespace, keys[:36]), data[:36])  # 32 blocks, 16 MiB
        assert drive.read_bytes() - before >= 32 * SPEC.block_bytes  # through the throttled device
        slow = disk_block_price(client, namespace, keys)
        assert slow > 10 * fast  # the drive slowed down, and the price says so
        # within 2x of the throttle's own rate after 16 MiB of throttled reads
        assert SPEC.block_bytes / THROTTLE / 2 < slow < 2 * SPEC.block_bytes / THROTTLE
