"""A durable Put whose client goes away while it waits for the disk logs no error.

The daemon's durable wait used asyncio.wait_for(asyncio.gather(...)): when
the call was cancelled (a client killed mid-Put, as tests/soak does),
wait_for cancelled the gather without ever retrieving its CancelledError,
and asyncio logged "_GatheringFuture exception was never retrieved" at
level error for each such Put.
"""

from __future__ import annotations

import time

import grpc
import numpy as np

from kvd.client import Client
from kvd.testing.daemon import log_problems, run_daemon
from kvd.testing.put_stream import SPEC, blocks_for
from kvd.v1 import kvd_pb2, kvd_pb2_grpc

PUTS = 10
BLOCKS_PER_PUT = 64


def wait_committed(client: Client, namespace, keys: list[bytes], timeout_s: float = 30.0) -> None:
    """Until the Put's blocks are stored (committed; a durable Put then waits for the disk)."""
    deadline = time.monotonic() + timeout_s
    while client.lookup(namespace, keys).matched < len(keys):
        assert time.monotonic() < deadline, "the Put was not committed in time"
        time.sleep(0.002)


def test_cancelled_durable_puts_log_no_error(tmp_path):
    config = {
        "host": {"capacity_bytes": 8 << 20, "slot_bytes": SPEC.block_bytes},
        # One block per fsynced write: a 64-block durable Put waits a while.
        "disk": {"directories": [str(tmp_path / "nvme0")], "capacity_bytes": 32 << 20,
                 "slot_bytes": SPEC.block_bytes, "segment_bytes": 8 << 20, "fsync": "strict",
                 "write_batch_blocks": 1, "write_chunk_blocks": 1},
    }
    with run_daemon(tmp_path / "daemon", config=config) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        with grpc.insecure_channel(daemon.unix_target) as channel:
            stub = kvd_pb2_grpc.KvdStub(channel)
            for put in range(PUTS):
                keys = namespace.keys(np.arange(BLOCKS_PER_PUT * SPEC.block_tokens) + put * 1_000_000)
                blocks = [row.tobytes() for row in blocks_for(keys).reshape(len(keys), -1)]
                call = stub.PutInline.future(kvd_pb2.PutInlineRequest(
                    namespace_id=namespace.namespace_id, client_id="leaver", keys=keys, blocks=blocks,
                    ack=kvd_pb2.ACK_DURABLE))
                wait_committed(client, namespace, keys)  # and now waiting for the disk
                call.cancel()
            # The writer catches up; cancelled calls' waits resolve unobserved.
            deadline = time.monotonic() + 20
            while daemon.metric("kvd_disk_write_queue") and time.monotonic() < deadline:
                time.sleep(0.1)
        # Every block was still written: the Put was committed before its client left.
        keys = namespace.keys(np.arange(BLOCKS_PER_PUT * SPEC.block_tokens))
        assert client.lookup(namespace, keys).matched == BLOCKS_PER_PUT
        assert client.get_numpy(namespace, keys).tobytes() == blocks_for(keys).tobytes()
    problems = log_problems(daemon.log())
    assert not problems, "\n".join(problems[:10])
