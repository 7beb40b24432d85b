"""A transfer = "daemon" load cut past its budget, against a real daemon reading a slowed drive.

With a prefill profile the scheduler gives each load a budget: past it,
computing the blocks is sooner than their arrival. With transfer = "daemon"
kvd itself writes the engine's pages, so the worker cannot just stop
copying, as with transfer = "client": it cancels the load through its
cancel word and hands the pages back to vLLM only once kvd says it is done
with them. The test then lets the drive run at full speed, waits until
kvd's reads of the cut load are over, and checks that no layer kvd had not
issued before the cut reached the pages afterwards (without the cancel,
kvd would go on writing pages vLLM recomputes, or gave to another request).
The daemon's CPU device runs synchronous and asynchronous (copies land 5 ms
after they are issued, as a GPU's do).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvd.client import Client
from kvd.connectors.vllm.metadata import KvdConnectorMetadata, LoadOrder
from kvd.device.cpu import DELAY_ENV
from kvd.testing.daemon import run_daemon
from kvd.testing.slow_drive import slowed_drive
from kvd.v1 import kvd_pb2
from tests.integration.test_device_plane import wait_for
from tests.integration.test_vllm_device_worker import SPEC, Model, data, keys_for

COUNT = 6  # blocks of 12 KiB: layer 0 of them is 24 KiB, 0.4 s at 64 KiB/s; layers 1 and 2 another 0.75 s


def config(directory) -> dict:
    return {"host": {"capacity_bytes": 16 << 20, "slot_bytes": 64 << 10},
            "disk": {"directories": [str(directory)], "capacity_bytes": 32 << 20, "segment_bytes": 4 << 20,
                     "slot_bytes": 64 << 10, "write_mode": "through"},
            "device": {"kind": "cpu"}}


@pytest.mark.parametrize("delay_ms", ["0", "5"], ids=["synchronous", "asynchronous"])
def test_a_load_past_its_budget_is_cancelled_and_kvd_writes_no_page_after_it(tmp_path, delay_ms):
    stored, keys = data(COUNT, seed=4), keys_for(4, COUNT)
    with slowed_drive(tmp_path / "nvme0", size_bytes=256 << 20) as drive, \
            run_daemon(tmp_path / "d", config=config(drive.directory), env={DELAY_ENV: delay_ms}) as daemon, \
            Client(daemon.unix_target) as client:
        drive.admit(daemon.pid)
        namespace = client.register_namespace(SPEC)
        assert client.put(namespace, keys, stored, durable=True) == COUNT
        assert client.demote().blocks_demoted >= COUNT
        assert list(client.lookup(namespace, keys).tiers) == [kvd_pb2.TIER_DISK] * COUNT
        model = Model(daemon.unix_target)
        pages = list(range(2, 2 + COUNT))
        drive.throttle(read_bps=64 << 10)
        model.step(KvdConnectorMetadata(loads=[LoadOrder("slow", [keys], 0, [pages], False, budget_s=0.6)]))
        totals = model.totals()
        assert totals["cut_loads"] == 1 and totals["load_errors"] == COUNT and totals["loaded_blocks"] == 0
        assert model.worker.load_errors() == set(pages)

        drive.throttle()  # kvd's reads of the cut load now finish at once
        wait_for(lambda: daemon.metric("kvd_lease_pinned_blocks") == 0)
        assert daemon.metric_samples("kvd_device_disk_loads_total")[
            'kvd_device_disk_loads_total{result="failed"}'] == 1.0
        for page, block in zip(pages, stored):
            landed = model.page(page)
            # Layer 0 may have been issued before the cut; nothing after it was.
            assert not landed[1:].any(), f"page {page}: a layer kvd read after the cut reached the engine"
            assert not landed[0].any() or np.array_equal(landed[0], block[0])

        # Both words came back: a load with time enough lands whole into other pages.
        again = list(range(2 + COUNT, 2 + 2 * COUNT))
        model.step(KvdConnectorMetadata(loads=[LoadOrder("in-time", [keys], 0, [again], False, budget_s=30.0)]))
        assert model.totals()["cut_loads"] == 1 and model.worker.load_errors() == set()
        for page, block in zip(again, stored):
            np.testing.assert_array_equal(model.page(page), block)
        model.worker.close()
