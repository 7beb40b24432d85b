"""SIGKILL the daemon in the middle of a heavy durable Put stream, many times.

Writer processes (kvd.testing.put_stream) stream put(durable=True) of
blocks whose bytes derive from their keys, and log every Put before they
make it and every acknowledgement once they have it. Each round the test
starts the daemon on the same disk directories, checks what the earlier
rounds left, lets the writers run, and SIGKILLs the daemon at a seeded
random moment. After the last round a clean start is checked once more and
stopped with SIGTERM.

What a check proves, on every restart:

  * every chain a writer saw acknowledged as durable (in any earlier round)
    is matched whole by Lookup, from the disk tier, and reads back bit-exact;
  * for a sample of Puts that were never acknowledged (in flight at the
    kill, or failed), whatever Lookup claims is served in full by Get and is
    bit-exact: a crash may lose such blocks, never garble them;
  * keys nobody wrote match nothing; no disk read fails its checksum;
  * while the daemon was alive, no Put failed (errors only after the kill),
    and the daemon logged no error or traceback.

The host tier holds 64 blocks, far fewer than the stream writes, so blocks
are demoted and read back from disk all the time. The disk tier is large
enough that nothing acknowledged is ever evicted from it.

KVD_CRASH_ROUNDS (default 6) sets the number of kills (`make crash-long`
runs many); KVD_CRASH_SEED picks the kill moments and the writers' streams.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from kvd.client import Client
from kvd.testing.daemon import DaemonProcess, log_problems, run_daemon, start_daemon
from kvd.testing.put_stream import SPEC, blocks_for, read_log
from kvd.v1 import kvd_pb2

ROUNDS = int(os.environ.get("KVD_CRASH_ROUNDS", "6"))
SEED = int(os.environ.get("KVD_CRASH_SEED", "7"))
WRITERS = 3
HOST_SLOTS = 64
SLOT_BYTES = 8 << 10
# Once every writer has had a Put of the round acknowledged, the kill comes
# a random time later.
KILL_AFTER_S = (0.0, 0.8)
UNACKED_SAMPLE = 60
OLD_CHAINS_SAMPLE = 40
WRITER_STOP_TIMEOUT_S = 40.0


def daemon_config(tmp_path: Path) -> dict:
    # Room on disk for everything the rounds write, so no acknowledged block
    # is ever evicted from the disk tier (eviction would be a legal loss).
    # (A round writes about a thousand 8 KiB blocks; the check before every
    # kill asserts that the disk tier evicted nothing.)
    per_drive = max(8, ROUNDS) * (8 << 20)
    return {
        "host": {"capacity_bytes": HOST_SLOTS * SLOT_BYTES, "slot_bytes": SLOT_BYTES},
        "disk": {
            "directories": [str(tmp_path / "nvme0"), str(tmp_path / "nvme1")],
            "capacity_bytes": per_drive,
            "slot_bytes": SLOT_BYTES,
            "segment_bytes": 8 << 20,
            "fsync": "strict",
            "write_batch_blocks": 16,
        },
    }


@dataclass
class History:
    """What the writers' logs say so far."""

    acked: list[list[bytes]] = field(default_factory=list)
    acked_round: list[int] = field(default_factory=list)
    unacked: list[list[bytes]] = field(default_factory=list)
    puts: int = 0
    errors: list[dict] = field(default_factory=list)

    @classmethod
    def from_logs(cls, control: Path) -> History:
        history = cls()
        for writer in range(WRITERS):
            tries: dict[int, dict] = {}
            for record in read_log(control / f"writer-{writer}.jsonl"):
                if record["e"] == "try":
                    tries[record["id"]] = record
                    history.puts += 1
                elif record["e"] == "ack":
                    attempt = tries.pop(record["id"])
                    keys = [bytes.fromhex(key) for key in attempt["keys"]]
                    # put(durable=True) returned: every key is durable (a partial outcome raises).
                    assert record["durable"] == len(keys), record
                    history.acked.append(keys)
                    history.acked_round.append(record["r"])
                elif record["e"] == "err":
                    history.errors.append(record)
            history.unacked.extend([bytes.fromhex(key) for key in attempt["keys"]] for attempt in tries.values())
        return history


def metric(daemon: DaemonProcess, sample: str) -> float:
    text = urllib.request.urlopen(daemon.metrics_url, timeout=10).read().decode()
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"no metric sample {sample}")


def recovery_counts(daemon: DaemonProcess) -> dict:
    """What this start found on the drives (for the report: a kill may tear
    a manifest append that was never acknowledged, which is legal)."""
    for line in daemon.log().splitlines():
        if '"disk tier opened"' in line:
            record = json.loads(line)
            return {"recovered_blocks": record["blocks"], "truncated_bytes": record["truncated_bytes"],
                    "dropped": record["dropped"]}
    raise AssertionError("the daemon did not log its disk recovery")


def check_store(daemon: DaemonProcess, history: History, rng: random.Random, *, everything: bool) -> dict:
    """Check what a freshly started daemon serves against the writers' history."""
    chains = list(range(len(history.acked)))
    if not everything:
        # The last round's chains all, older ones sampled (each was fully
        # checked after the round that wrote it).
        last = max(history.acked_round, default=0)
        recent = [i for i in chains if history.acked_round[i] == last]
        older = [i for i in chains if history.acked_round[i] != last]
        chains = recent + rng.sample(older, min(len(older), OLD_CHAINS_SAMPLE))
    # A chain that another one extends is checked with it: chained keys
    # determine their whole prefix.
    inner = {key for i in chains for key in history.acked[i][:-1]}
    chains = [i for i in chains if history.acked[i][-1] not in inner]
    unacked = rng.sample(history.unacked, min(len(history.unacked), UNACKED_SAMPLE))
    found_unacked = 0
    with Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        # Lookups first: nothing has been read into the fresh host tier yet,
        # so every acknowledged block must be found on disk.
        for i in chains:
            keys = history.acked[i]
            lookup = client.lookup(namespace, keys)
            assert lookup.matched == len(keys), f"acknowledged chain {i} (round {history.acked_round[i]}): " \
                f"{lookup.matched} of {len(keys)} blocks after restart"
            assert set(lookup.tiers) == {kvd_pb2.TIER_DISK}, lookup.tiers
        for i in chains:
            keys = history.acked[i]
            got = client.get_numpy(namespace, keys)
            assert got.shape[0] == len(keys), f"acknowledged chain {i}: Get served {got.shape[0]} of {len(keys)}"
            assert got.tobytes() == blocks_for(keys).tobytes(), f"acknowledged chain {i}: wrong bytes"
        for keys in unacked:
            claimed = client.lookup(namespace, keys).matched
            got = client.get_numpy(namespace, keys)
            assert got.shape[0] == claimed, f"Lookup claimed {claimed} blocks, Get served {got.shape[0]}"
            assert got.tobytes() == blocks_for(keys[:claimed]).tobytes(), "an unacknowledged Put came back wrong"
            found_unacked += claimed > 0
        # Keys nobody ever wrote.
        stray = namespace.keys(np.random.default_rng(rng.randrange(1 << 32)).integers(0, 1 << 31, 4 * 16))
        assert client.lookup(namespace, stray).matched == 0
        disk = disk_stats(client)
    assert metric(daemon, 'kvd_disk_failures_total{operation="load"}') == 0
    # The Lookups above matched every acknowledged chain checked; the disk
    # tier also holds at least every acknowledged block.
    acked_blocks = len({key for keys in history.acked for key in keys})
    assert disk.blocks >= acked_blocks
    return {"chains": len(chains), "unacked": len(unacked), "unacked_found": found_unacked,
            "acked_blocks": acked_blocks, "disk_blocks": disk.blocks, **recovery_counts(daemon)}


def disk_stats(client: Client) -> kvd_pb2.TierStats:
    (disk,) = [tier for tier in client.stats().tiers if tier.tier == kvd_pb2.TIER_DISK]
    return disk


def assert_no_disk_eviction(daemon: DaemonProcess) -> None:
    """The test's premise: nothing acknowledged may leave the disk tier legally."""
    with Client(daemon.unix_target) as client:
        disk = disk_stats(client)
    assert disk.evictions == 0, f"the disk tier evicted {disk.evictions} blocks: give it more capacity"


def wait_for_writers(control: Path, writers: list[subprocess.Popen], round_: int, event: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = set(range(WRITERS))
    while pending and time.monotonic() < deadline:
        for writer in list(pending):
            records = read_log(control / f"writer-{writer}.jsonl")
            if any(record["e"] == event and record["r"] == round_ for record in records):
                pending.discard(writer)
        time.sleep(0.02)
    if pending:
        # Show where they hang: each writer prints its stacks on SIGUSR1.
        for writer in pending:
            writers[writer].send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        details = "\n".join(
            f"writer {writer}: last records {read_log(control / f'writer-{writer}.jsonl')[-3:]}\n"
            + (control / f"writer-{writer}.stderr").read_text()[-6000:]
            for writer in sorted(pending)
        )
        raise AssertionError(f"writers {sorted(pending)} logged no {event!r} in round {round_} within {timeout_s}s\n{details}")


def spawn_writer(control: Path, writer: int) -> subprocess.Popen:
    with open(control / f"writer-{writer}.stderr", "wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "kvd.testing.put_stream", str(control), str(writer), str(SEED)], stderr=stderr
        )


@pytest.mark.slow
def test_sigkill_during_durable_put_stream(tmp_path):
    rng = random.Random(SEED)
    directory = tmp_path / "daemon"
    config = daemon_config(tmp_path)
    control = tmp_path / "control"
    control.mkdir()
    writers = [spawn_writer(control, writer) for writer in range(WRITERS)]
    history = History()
    report = []
    try:
        for round_ in range(ROUNDS):
            started = time.monotonic()
            daemon = start_daemon(directory, config=config)
            try:
                phases = {"start_s": time.monotonic() - started}
                checked = check_store(daemon, history, rng, everything=False)
                phases["check_s"] = time.monotonic() - started - phases["start_s"]
                # Atomically: a writer that sees the file must see its content.
                (control / f"go-{round_}.tmp").write_text(daemon.unix_target)
                (control / f"go-{round_}.tmp").rename(control / f"go-{round_}")
                wait_for_writers(control, writers, round_, "ack", 30.0)
                phases["first_acks_s"] = time.monotonic() - started - phases["start_s"] - phases["check_s"]
                time.sleep(rng.uniform(*KILL_AFTER_S))
                assert_no_disk_eviction(daemon)
                killed_at = time.time()
                daemon.process.send_signal(signal.SIGKILL)
                daemon.process.wait(30)
            finally:
                if daemon.alive():
                    daemon.process.kill()
                    daemon.process.wait()
            (control / f"stop-{round_}").write_text("")
            wait_for_writers(control, writers, round_, "done", WRITER_STOP_TIMEOUT_S)
            problems = log_problems(daemon.log())
            assert not problems, "the daemon logged errors:\n" + "\n".join(problems[:20])
            history = History.from_logs(control)
            early = [error for error in history.errors if error["r"] == round_ and error["t"] < killed_at]
            assert not early, f"Puts failed while the daemon was alive: {early[:5]}"
            phases["round_s"] = time.monotonic() - started
            report.append({"round": round_, **checked, "acked_total": len(history.acked), "puts_total": history.puts,
                           **{name: round(value, 2) for name, value in phases.items()}})
        started = time.monotonic()
        with run_daemon(directory, config=config) as daemon:
            checked = check_store(daemon, history, rng, everything=True)
            checked["check_s"] = round(time.monotonic() - started, 2)
            assert_no_disk_eviction(daemon)
            # Every acknowledged block was served by a read from disk.
            loads = metric(daemon, 'kvd_tier_moves_total{source_tier="disk",target_tier="host"}')
            assert loads >= checked["acked_blocks"]
        problems = log_problems(daemon.log())
        assert not problems, "the daemon logged errors:\n" + "\n".join(problems[:20])
        report.append({"final": True, **checked})
    finally:
        (control / "exit").write_text("")
        for writer in writers:
            try:
                writer.wait(30)
            except subprocess.TimeoutExpired:
                writer.kill()
                writer.wait()
    print(json.dumps(report))
    # The stream really was heavy and really was cut: many acknowledged
    # chains, and Puts in flight at the kills.
    assert len(history.acked) >= WRITERS * ROUNDS
    assert history.unacked
    assert all(writer.returncode == 0 for writer in writers)
