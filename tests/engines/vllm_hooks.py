"""KvdConnector with a fault injected between the scheduler's Lookup and the worker's load.

Loaded by tests/engines/vllm_run.py (--hook) in the vLLM process. `NEXT`
names what happens right after the next request's Lookup found a hit:

- "delete": the hit blocks are deleted from kvd (another client's Delete);
- "corrupt": they are replaced by blocks of random values under the same keys;
- "kill": the daemon is SIGKILLed (pid in $KVD_TEST_DAEMON_PID);
- "slow": the drive under kvd's disk tier slows down (a blkio group and bytes
  a second in $KVD_TEST_SLOW_DRIVE, as "group|major:minor|bps") and the hit
  blocks' host copies are dropped: priced as host hits, they must now come
  from the slow drive, so the load falls behind its budget and is cut.

Then NEXT is cleared. Whatever happened, vLLM must answer as without kvd,
except for "corrupt", which proves the loaded bytes are really used.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np

from kvd.connectors.vllm.connector import KvdConnector
from kvd.v1 import kvd_pb2

NEXT = ""
FIRED: list[str] = []


class HookedKvdConnector(KvdConnector):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        global NEXT
        tokens, asynchronous = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if tokens and NEXT:
            first = num_computed_tokens // self.block_size
            stop = first + tokens // self.block_size
            _fire(NEXT, self.scheduler, self.scheduler.requests[request.request_id].keys[0], first, stop)
            FIRED.append(NEXT)
            NEXT = ""
        return tokens, asynchronous


def _fire(hook: str, scheduler, keys: list[bytes], first: int, stop: int) -> None:
    client, namespace = scheduler.client, scheduler.shards[0]
    if hook == "kill":
        os.kill(int(os.environ["KVD_TEST_DAEMON_PID"]), signal.SIGKILL)
        return
    if hook == "slow":
        _slow_down(client, namespace, keys[:stop])
        return
    deleted, pinned = client.delete(namespace, [keys[first]])
    deadline = time.monotonic() + 10
    while pinned and time.monotonic() < deadline:
        # The previous request's load still pins them: with transfer = "daemon", kvd releases its
        # pins once its copy stream drains, just after the engine saw the last layer land.
        time.sleep(0.01)
        deleted, pinned = client.delete(namespace, [keys[first]])
    assert deleted >= stop - first and not pinned, (deleted, pinned)
    if hook == "corrupt":
        shape = (stop - first, *namespace.spec.block_shape)
        garbage = np.random.default_rng(7).standard_normal(shape, dtype=np.float32)
        parent = keys[first - 1] if first else b""
        assert client.put(namespace, keys[first:stop], garbage, parent_key=parent) == stop - first


def _slow_down(client, namespace, keys: list[bytes]) -> None:
    group, numbers, bps = os.environ["KVD_TEST_SLOW_DRIVE"].split("|")
    Path(group, "blkio.throttle.read_bps_device").write_text(f"{numbers} {bps}")
    deadline = time.monotonic() + 20
    while set(client.lookup(namespace, keys).tiers) != {kvd_pb2.TIER_DISK}:  # written behind: wait for the disk
        assert time.monotonic() < deadline, "the hit blocks did not reach the disk tier in time"
        client.demote()
        time.sleep(0.05)
