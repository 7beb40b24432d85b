"""Soak: client processes hammer one daemon while some are SIGKILLed, disks fail, and it drains.

WORKERS client processes (kvd.testing.soak_worker) loop over Lookup, Put,
durable Put, Get, GetLayers and Prefetch on a daemon with a small host tier
(far fewer slots than the blocks the workers share, so blocks are evicted,
demoted to disk and read back all the time) and a disk tier. One of them
never maps the arena (inline bytes). The daemon has auth.mode = "token":
worker i works as tenant TENANTS[i % 2] with that tenant's token; both
tenants register the same spec and put the same shared prompts, so they
use the same namespace id and keys, with other bytes (every block's bytes
derive from its tenant and its key). The workers check every block a Get
returns, and that it is not another tenant's; the test checks that no
tenant's mapping of the arena ever shows another tenant's blocks
(`Isolation`).

  1. load, SOAK_S seconds: every few seconds a worker is SIGKILLed, half
     the time right after it has logged a lease it holds (a read or a
     write lease held for a second), and restarted. The daemon's RSS is
     sampled throughout.
  2. all workers SIGKILLed at once: the daemon must end every lease of
     theirs by its deadline (the held ones logged in 1 among them), and
     then pin nothing; RSS after warm-up stayed flat.
  3. workers again, and SIGTERM under their load: the daemon drains within
     server.grace_period_s and exits 0.
  4. a clean restart serves every block a worker saw acknowledged durable
     (in 1 or 3), bit-exact, from disk, to its tenant and to no other.
  5. load again, FAULT_S seconds, on a daemon started with injected disk
     faults (KVD_INJECT_IO_FAULTS: ENOSPC writes, EIO and short reads):
     Gets may miss, durable Puts may fail, nothing comes back wrong.
  6. a clean restart: every durable block is still served bit-exact, but
     for those a failed read in 5 dropped (at most one chain per failed
     load; the disk tier may lose, never lie), and the daemon stops cleanly
     with no leaked handle.

In 1 and 5 an admin tenant also calls Demote every few seconds, so blocks
leave host memory for the drive while the workers read and write them.

Throughout: no worker ever got wrong bytes or another tenant's, no RPC failed with a status
other than the expected ones (UNAVAILABLE while the daemon is down or
draining, RESOURCE_EXHAUSTED when the host tier is pinned full...), no
worker died on its own.

KVD_SOAK_SECONDS (default 24) and KVD_SOAK_FAULT_SECONDS (default 12) set
the two load phases, KVD_SOAK_WORKERS (5) the clients, KVD_SOAK_SEED the
kill times; `make soak-long` runs minutes, printing progress.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from kvd.client import Client
from kvd.testing.daemon import DaemonProcess, log_problems, run_daemon, start_daemon
from kvd.testing.put_stream import SPEC, read_log
from kvd.testing.soak_worker import LEASE_MS, TENANTS, family_keys
from kvd.testing.tenants import ArenaView, TenantStub, by_prefix, tenant_blocks, write_tenants_file
from kvd.v1 import kvd_pb2

SOAK_S = float(os.environ.get("KVD_SOAK_SECONDS", "18"))
FAULT_S = float(os.environ.get("KVD_SOAK_FAULT_SECONDS", "9"))
WORKERS = int(os.environ.get("KVD_SOAK_WORKERS", "5"))
SEED = int(os.environ.get("KVD_SOAK_SEED", "11"))
GRACE_PERIOD_S = 5.0
HOST_SLOTS = 256
SLOT_BYTES = 8 << 10
KILL_EVERY_S = (1.5, 3.5)
HOLD_WAIT_S = 6.0
# RSS samples from this fraction of the load phase on are "after warm-up".
WARM_UP_FRACTION = 0.4
RSS_GROWTH_FRACTION = 0.10
RSS_GROWTH_BYTES = 24 << 20
FAULTS = "write:ENOSPC:400,read:EIO:60,read:SHORT:30"
# Statuses a worker may see: the daemon gone or draining (UNAVAILABLE, or
# CANCELLED mid-call), the host tier pinned full or a pin cap
# (RESOURCE_EXHAUSTED), a lease that expired while a starved worker held
# it (NOT_FOUND), a call slower than its deadline on a starved machine.
EXPECTED_CODES = {"UNAVAILABLE", "CANCELLED", "RESOURCE_EXHAUSTED", "NOT_FOUND", "DEADLINE_EXCEEDED"}
PROGRESS = os.environ.get("KVD_SOAK_PROGRESS") == "1"
TOKENS = {tenant: f"soak-{tenant}-token-{os.urandom(8).hex()}" for tenant in TENANTS}
# An admin tenant, "ops", which calls Demote now and then under the load:
# every host copy the disk also holds goes, and the workers' next Gets of
# those blocks read the drive, racing their Puts, Deletes and leases.
OPS_TOKEN = f"soak-ops-token-{os.urandom(8).hex()}"
DEMOTE_EVERY_S = (1.0, 3.0)
# How often the test looks through every tenant's mapping of the arena.
ISOLATION_EVERY_S = 1.0


def daemon_config(tmp_path: Path) -> dict:
    # Disk room for every durable chain of a long run (about 25 blocks/s at
    # most), so none is evicted: a disk eviction would be a legal loss.
    disk_bytes = max(64 << 20, int((SOAK_S + FAULT_S + 60) * 25 * SLOT_BYTES * 2))
    return {
        "host": {"capacity_bytes": HOST_SLOTS * SLOT_BYTES, "slot_bytes": SLOT_BYTES},
        "disk": {
            "directories": [str(tmp_path / "nvme0")],
            "capacity_bytes": -(-disk_bytes // (8 << 20)) * (8 << 20),
            "slot_bytes": SLOT_BYTES,
            "segment_bytes": 8 << 20,
            "fsync": "group",
        },
        "server": {"grace_period_s": GRACE_PERIOD_S},
        "leases": {"default_ms": 2000, "max_ms": 10_000, "sweep_interval_ms": 100},
        # A small event ring: its memory is bounded, and reached early.
        "events": {"ring_events": 1024, "ring_keys": 16384},
        "auth": {"mode": "token", "tenants_file": str(write_tenants_file(
            tmp_path / "tenants.toml",
            {**{tenant: {"token": token, "namespaces": [SPEC.model_id]} for tenant, token in TOKENS.items()},
             "ops": {"token": OPS_TOKEN, "namespaces": [], "admin": True}}))},
    }


def tenant_of(slot: int) -> str:
    return TENANTS[slot % len(TENANTS)]


def progress(message: str) -> None:
    if PROGRESS:
        print(f"[soak {time.strftime('%H:%M:%S')}] {message}", flush=True)


@dataclass
class Fleet:
    """The worker processes, restarted under new names after each kill."""

    control: Path
    rng: random.Random
    processes: dict[int, tuple[str, subprocess.Popen]] = field(default_factory=dict)
    incarnations: Counter = field(default_factory=Counter)
    kills: int = 0
    kill_rounds: int = 0
    demote_calls: int = 0
    demoted_blocks: int = 0
    # (tenant, client_id, lease_id, kind) of leases held by workers when they were killed.
    held_at_kill: list = field(default_factory=list)

    def spawn(self, slot: int) -> None:
        self.incarnations[slot] += 1
        name = f"w{slot}-{self.incarnations[slot]}"
        tenant = tenant_of(slot)
        arguments = [sys.executable, "-m", "kvd.testing.soak_worker", str(self.control), name,
                     str(SEED * 1000 + slot * 100 + self.incarnations[slot]), "--tenant", tenant]
        if slot == 0:
            arguments.append("--inline")
        with open(self.control / f"{name}.stderr", "wb") as stderr:
            # The token in the environment, never on a command line.
            self.processes[slot] = (name, subprocess.Popen(arguments, stderr=stderr,
                                                           env={**os.environ, "KVD_TOKEN": TOKENS[tenant]}))

    def start(self) -> None:
        (self.control / "stop").unlink(missing_ok=True)
        for slot in range(WORKERS):
            self.spawn(slot)

    def kill(self, slot: int) -> None:
        name, process = self.processes[slot]
        process.send_signal(signal.SIGKILL)
        process.wait(30)
        self.kills += 1

    def kill_one(self) -> None:
        """SIGKILL a random worker, every other time while it holds a lease; restart it."""
        slot = self.rng.randrange(WORKERS)
        name, process = self.processes[slot]
        self.check_alive()
        self.kill_rounds += 1
        if self.kill_rounds % 2:
            hold = self._next_hold(name)
            self.kill(slot)
            if hold is not None:
                self.held_at_kill.append((hold["tenant"], hold["client"], hold["lease"], hold["kind"]))
        else:
            self.kill(slot)
        self.spawn(slot)

    def _next_hold(self, name: str) -> dict | None:
        seen = len(read_log(self.control / f"{name}.jsonl"))
        deadline = time.monotonic() + HOLD_WAIT_S
        while time.monotonic() < deadline:
            records = read_log(self.control / f"{name}.jsonl")[seen:]
            for record in records:
                if record["e"] == "hold":
                    return record
            time.sleep(0.01)
        return None

    def kill_all(self) -> None:
        self.check_alive()
        for slot in list(self.processes):
            self.kill(slot)
        self.processes.clear()

    def check_alive(self) -> None:
        for name, process in self.processes.values():
            if process.poll() is not None:
                raise AssertionError(f"worker {name} died on its own with {process.returncode}:\n"
                                     + (self.control / f"{name}.stderr").read_text()[-4000:])

    def records(self) -> list[dict]:
        return [record for path in sorted(self.control.glob("w*.jsonl")) for record in read_log(path)]

    def summary(self) -> dict:
        """Totals over every worker log: operations, blocks checked, errors by code, durable chains."""
        ops: Counter = Counter()
        checked: Counter = Counter()
        for path in sorted(self.control.glob("w*.jsonl")):
            stats = [record for record in read_log(path) if record["e"] == "stats"]
            if stats:
                ops.update(stats[-1]["ops"])
                # w<slot>-<incarnation>.jsonl
                checked[tenant_of(int(path.stem[1:].split("-")[0]))] += stats[-1]["blocks_checked"]
        records = self.records()
        return {
            "ops": sum(ops.values()), "by_op": dict(ops), "blocks_checked": sum(checked.values()),
            "blocks_checked_by_tenant": dict(checked),
            "errors": dict(Counter(record["code"] for record in records if record["e"] == "err")),
            "durable_chains": sum(record["e"] == "durable" for record in records),
            "holds": sum(record["e"] == "hold" for record in records),
            "bad": [record for record in records if record["e"] in ("bad", "foreign")],
            "foreign": sum(record["e"] == "foreign" for record in records),
            "kills": self.kills, "held_at_kill": len(self.held_at_kill),
        }


def durable_chains(fleet: Fleet) -> list[tuple[str, list[bytes]]]:
    """(tenant, keys) of every chain a worker saw acknowledged durable."""
    return [(record["tenant"], [bytes.fromhex(key) for key in record["keys"]]) for record in fleet.records()
            if record["e"] == "durable"]


def check_durable(daemon: DaemonProcess, chains: list[tuple[str, list[bytes]]]) -> tuple[int, int]:
    """Every durable chain is served bit-exact from its start to its tenant, and not at all to
    another tenant (who never put those keys); returns (whole, cut short)."""
    whole = short = 0
    clients = {tenant: Client(daemon.unix_target, token=token) for tenant, token in TOKENS.items()}
    try:
        namespaces = {tenant: client.register_namespace(SPEC) for tenant, client in clients.items()}
        for tenant, keys in chains:
            got = clients[tenant].get_numpy(namespaces[tenant], keys)
            assert got.tobytes() == tenant_blocks(tenant, keys[: got.shape[0]]).tobytes(), (
                "a durable block came back wrong")
            whole += got.shape[0] == len(keys)
            short += got.shape[0] < len(keys)
            for other in TENANTS:
                if other != tenant:
                    assert clients[other].lookup(namespaces[other], keys).matched == 0, (
                        f"tenant {other} finds a durable block of {tenant}'s")
    finally:
        for client in clients.values():
            client.close()
    return whole, short


class Isolation:
    """Every tenant's mapping of the arena (the file its clients get), checked for other tenants' blocks.

    The shared prompts' blocks of each tenant are known (`tenant_blocks` of
    `family_keys`); a slot of tenant t's mapping that holds one of another
    tenant's is a leak. Slots holding t's own show that the check looks at
    live data (`own_seen`)."""

    def __init__(self) -> None:
        keys = [key for chain in family_keys() for key in chain]
        self.blocks = {tenant: by_prefix(tenant_blocks(tenant, keys)) for tenant in TENANTS}
        self.views: dict[str, ArenaView] = {}
        self.scans = 0
        self.own_seen: Counter = Counter()
        self.checked_at = 0.0

    def watch(self, daemon: DaemonProcess) -> None:
        self.close()
        with grpc.insecure_channel(daemon.unix_target) as channel:
            for tenant, token in TOKENS.items():
                info = TenantStub(channel, token).ArenaInfo(kvd_pb2.ArenaInfoRequest())
                self.views[tenant] = ArenaView(daemon, token, info)

    def check(self, force: bool = False) -> None:
        now = time.monotonic()
        if not self.views or (not force and now - self.checked_at < ISOLATION_EVERY_S):
            return
        self.checked_at = now
        for tenant, view in self.views.items():
            for other, blocks in self.blocks.items():
                rows = view.rows_holding(blocks)
                if other == tenant:
                    self.own_seen[tenant] += len(rows)
                else:
                    assert not rows, f"tenant {tenant}'s arena shows tenant {other}'s blocks in slots {rows[:8]}"
        self.scans += 1

    def close(self) -> None:
        for view in self.views.values():
            view.close()
        self.views.clear()


def disk_evictions(daemon: DaemonProcess) -> float:
    return sum(value for key, value in daemon.metric_samples("kvd_tier_evictions_total").items() if "disk" in key)


def wait_for_zero(daemon: DaemonProcess, name: str, timeout_s: float) -> float:
    """Poll until metric `name` (summed) is 0; returns how long that took."""
    started = time.monotonic()
    while True:
        value = sum(daemon.metric_samples(name).values())
        if value == 0:
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{name} is still {value} {timeout_s}s after every client was killed")
        time.sleep(0.1)


def sample_rss(daemon: DaemonProcess, samples: list, stop: threading.Event) -> None:
    started = time.monotonic()
    while not stop.wait(0.5):
        samples.append((time.monotonic() - started, daemon.rss_bytes()))


def demote(fleet: Fleet, daemon: DaemonProcess) -> None:
    """The ops tenant's Demote, counted in `fleet`."""
    with grpc.insecure_channel(daemon.unix_target) as channel:
        answer = TenantStub(channel, OPS_TOKEN).Demote(kvd_pb2.DemoteRequest())
    fleet.demote_calls += 1
    fleet.demoted_blocks += answer.blocks_demoted


def run_load(fleet: Fleet, daemon: DaemonProcess, seconds: float, isolation: Isolation, *, kills: bool) -> None:
    started = time.monotonic()
    next_kill = started + fleet.rng.uniform(*KILL_EVERY_S)
    next_demote = started + fleet.rng.uniform(*DEMOTE_EVERY_S)
    next_report = started + 5.0
    while time.monotonic() - started < seconds:
        assert daemon.alive(), f"kvd died under load:\n{daemon.log()[-4000:]}"
        now = time.monotonic()
        if kills and now >= next_kill:
            fleet.kill_one()
            next_kill = time.monotonic() + fleet.rng.uniform(*KILL_EVERY_S)
        if now >= next_demote:
            demote(fleet, daemon)
            next_demote = time.monotonic() + fleet.rng.uniform(*DEMOTE_EVERY_S)
        if now >= next_report:
            next_report = now + 5.0
            summary = fleet.summary()
            progress(f"{now - started:5.0f}s  ops {summary['ops']}  blocks checked {summary['blocks_checked']}  "
                     f"durable chains {summary['durable_chains']}  kills {fleet.kills}  "
                     f"rss {daemon.rss_bytes() >> 20} MiB  leases {daemon.metric('kvd_leases'):.0f}  "
                     f"errors {summary['errors']}")
        fleet.check_alive()
        isolation.check()
        time.sleep(0.05)


def assert_rss_flat(samples: list[tuple[float, int]], seconds: float) -> dict:
    after = [rss for at, rss in samples if at >= seconds * WARM_UP_FRACTION]
    assert len(after) >= 4, f"too few RSS samples: {samples}"
    baseline = after[0]
    bound = baseline * (1 + RSS_GROWTH_FRACTION) + RSS_GROWTH_BYTES
    assert max(after) <= bound, (
        f"daemon RSS grew from {baseline >> 20} MiB to {max(after) >> 20} MiB after warm-up "
        f"(bound {int(bound) >> 20} MiB): {[rss >> 20 for _, rss in samples]}")
    return {"rss_warm_mib": baseline >> 20, "rss_max_mib": max(after) >> 20, "rss_samples": len(samples)}


def assert_clean_log(daemon: DaemonProcess) -> None:
    problems = log_problems(daemon.log())
    assert not problems, "the daemon logged errors:\n" + "\n".join(problems[:20])


def set_target(control: Path, daemon: DaemonProcess) -> None:
    (control / "target.tmp").write_text(daemon.unix_target)
    (control / "target.tmp").replace(control / "target")


def drain_under_load(fleet: Fleet, daemon: DaemonProcess) -> float:
    """SIGTERM once every worker has made progress; returns the daemon's own drain_s."""
    before = fleet.summary()["ops"]
    deadline = time.monotonic() + 30
    while fleet.summary()["ops"] < before + 20 * WORKERS and time.monotonic() < deadline:
        fleet.check_alive()
        time.sleep(0.1)
    started = time.monotonic()
    code = daemon.stop(signal.SIGTERM, timeout_s=GRACE_PERIOD_S + 30)
    elapsed = time.monotonic() - started
    assert code == 0, f"kvd exited with {code} after SIGTERM under load:\n{daemon.log()[-4000:]}"
    stopped = [json.loads(line) for line in daemon.log().splitlines() if '"stopped"' in line]
    assert stopped, f"kvd logged no 'stopped':\n{daemon.log()[-4000:]}"
    drain_s = stopped[-1]["drain_s"]
    # The daemon's own measure: in-flight RPCs and queued writes within the
    # grace period (plus a little for closing what follows them).
    assert drain_s <= GRACE_PERIOD_S + 2.0, f"drain took {drain_s}s, grace period {GRACE_PERIOD_S}s"
    assert elapsed <= GRACE_PERIOD_S + 20.0, f"kvd took {elapsed:.1f}s to exit after SIGTERM"
    return drain_s


def phase_kills_and_drain(fleet: Fleet, daemon, control, isolation: Isolation, report: dict) -> None:
    """Phases 1 to 3: load with kills, leases reclaimed after the last kill, SIGTERM under load."""
    set_target(control, daemon)
    isolation.watch(daemon)
    fleet.start()
    samples: list = []
    stop_sampling = threading.Event()
    sampler = threading.Thread(target=sample_rss, args=(daemon, samples, stop_sampling), daemon=True)
    sampler.start()
    progress(f"phase 1: {WORKERS} workers, {SOAK_S:.0f}s, kills every {KILL_EVERY_S}s")
    run_load(fleet, daemon, SOAK_S, isolation, kills=True)
    stop_sampling.set()
    sampler.join()
    # 2. Every client gone: leases end by their deadline, nothing stays pinned.
    fleet.kill_all()
    reclaimed_s = wait_for_zero(daemon, "kvd_leases", LEASE_MS / 1000 + 10)
    wait_for_zero(daemon, "kvd_lease_pinned_blocks", 5)
    wait_for_zero(daemon, "kvd_tier_pinned_blocks", 20)
    with grpc.insecure_channel(daemon.unix_target) as channel:
        for tenant, client_id, lease_id, kind in fleet.held_at_kill:
            # As the client that held it, with its tenant's token: ended, not another's.
            with pytest.raises(grpc.RpcError) as raised:
                TenantStub(channel, TOKENS[tenant]).Release(
                    kvd_pb2.ReleaseRequest(client_id=client_id, lease_ids=[lease_id]))
            assert raised.value.code() == grpc.StatusCode.NOT_FOUND, (kind, raised.value.details())
    expired = daemon.metric("kvd_leases_expired_total")
    # Expired, not released: the workers were killed holding them.
    assert expired >= len(fleet.held_at_kill)
    isolation.check(force=True)
    assert all(isolation.own_seen[tenant] for tenant in TENANTS), isolation.own_seen
    assert fleet.demote_calls and fleet.demoted_blocks, "Demote under load dropped no host copy"
    report["phase1"] = {**fleet.summary(), "leases_reclaimed_s": round(reclaimed_s, 1),
                        "demote_calls": fleet.demote_calls, "demoted_blocks": fleet.demoted_blocks,
                        "leases_expired": expired, **assert_rss_flat(samples, SOAK_S),
                        "arena_scans": isolation.scans}
    progress(f"phase 2: leases reclaimed {reclaimed_s:.1f}s after the last kill; {report['phase1']}")
    # 3. SIGTERM under load.
    fleet.start()
    isolation.check(force=True)
    report["drain_s"] = drain_under_load(fleet, daemon)
    isolation.close()
    assert_clean_log(daemon)
    progress(f"phase 3: drained in {report['drain_s']}s under load")


def phase_faults(fleet: Fleet, daemon, control, isolation: Isolation) -> tuple[dict, int, str]:
    """Phase 5: load on faulty disks; (failures by kind, failed loads, the daemon's log)."""
    set_target(control, daemon)
    isolation.watch(daemon)
    fleet.start()
    progress(f"phase 5: {FAULT_S:.0f}s with faults {FAULTS}")
    run_load(fleet, daemon, FAULT_S, isolation, kills=False)
    isolation.check(force=True)
    isolation.close()
    failures = dict(daemon.metric_samples("kvd_disk_failures_total").items())
    load_failures = sum(value for key, value in failures.items() if '"load"' in key)
    assert sum(failures.values()) > 0, f"no injected fault was hit: {failures}"
    fleet.kill_all()
    assert daemon.stop() == 0, daemon.log()[-4000:]
    return failures, load_failures, daemon.log()


def kill_if_alive(daemon) -> None:
    if daemon.alive():
        daemon.process.kill()
        daemon.process.wait()


def check_fleet_summary(fleet: Fleet) -> None:
    """What the workers saw over the whole run: right bytes, expected statuses, real load."""
    summary = fleet.summary()
    assert not summary["bad"], f"workers got wrong bytes ({summary['foreign']} times another tenant's): " + str(
        summary["bad"][:5])
    unexpected = {code: count for code, count in summary["errors"].items() if code not in EXPECTED_CODES}
    assert not unexpected, f"unexpected statuses: {unexpected}; " + str(
        [record for record in fleet.records() if record["e"] == "err" and record["code"] in unexpected][:5])
    # The load was real: every operation ran, kills landed on held leases.
    assert summary["ops"] >= 200 * WORKERS * (SOAK_S + FAULT_S) / 36, summary
    assert all(summary["by_op"].get(op, 0) > 0 for op in ("lookup", "put", "put_durable", "get", "get_layers",
                                                           "prefetch")), summary["by_op"]
    assert summary["held_at_kill"] >= 1, summary
    # Every tenant's workers read back blocks (of the same keys as the other's): none were the other's.
    assert all(summary["blocks_checked_by_tenant"].get(tenant, 0) > 0 for tenant in TENANTS), summary


def run_phases(directory, config: dict, control, fleet: Fleet, isolation: Isolation, report: dict) -> None:
    # 1-3. Load with kills, leases reclaimed, SIGTERM under load.
    daemon = start_daemon(directory, config=config)
    try:
        phase_kills_and_drain(fleet, daemon, control, isolation, report)
    finally:
        kill_if_alive(daemon)
    fleet.kill_all()
    assert not fleet.summary()["bad"], fleet.summary()["bad"][:5]
    # 4. Nothing acknowledged durable was lost.
    chains = durable_chains(fleet)
    daemon = start_daemon(directory, config=config)
    try:
        whole, short = check_durable(daemon, chains)
        assert short == 0, f"{short} of {len(chains)} durable chains came back incomplete after the drain"
        assert disk_evictions(daemon) == 0
    finally:
        assert daemon.stop() == 0
    assert_clean_log(daemon)
    report["durable_after_drain"] = whole
    progress(f"phase 4: {whole} durable chains back after the drain")
    # 5. Load on faulty disks.
    daemon = start_daemon(directory, config=config, env={"KVD_INJECT_IO_FAULTS": FAULTS})
    try:
        failures, load_failures, fault_log = phase_faults(fleet, daemon, control, isolation)
    finally:
        kill_if_alive(daemon)
    report["faults"] = {key.split("{")[1].rstrip("}"): value for key, value in failures.items()}
    # Failed I/O is logged (warnings); nothing may crash or log a traceback.
    problems = log_problems(fault_log)
    assert not problems, "the daemon logged errors under disk faults:\n" + "\n".join(problems[:20])
    # 6. Every durable block still served bit-exact, but those a failed read dropped.
    chains = durable_chains(fleet)
    with run_daemon(directory, config=config) as daemon:
        whole, short = check_durable(daemon, chains)
        assert short <= load_failures, f"{short} durable chains cut short, {load_failures} failed loads"
    assert_clean_log(daemon)
    report["durable_final"] = {"whole": whole, "cut_by_failed_reads": short}


@pytest.mark.slow
def test_soak_kills_faults_and_drain(tmp_path):
    config = daemon_config(tmp_path)
    control = tmp_path / "control"
    control.mkdir()
    fleet = Fleet(control, random.Random(SEED))
    isolation = Isolation()
    report: dict = {}
    assert WORKERS >= len(TENANTS), f"KVD_SOAK_WORKERS: at least {len(TENANTS)}, a worker per tenant"
    try:
        run_phases(tmp_path / "daemon", config, control, fleet, isolation, report)
        summary = fleet.summary()
        report["total"] = {key: summary[key] for key in ("ops", "blocks_checked", "errors", "kills", "held_at_kill")}
        report["isolation"] = {"arena_scans": isolation.scans, "own_blocks_seen": dict(isolation.own_seen),
                               "blocks_checked_by_tenant": summary["blocks_checked_by_tenant"]}
    finally:
        isolation.close()
        (control / "stop").write_text("")
        for name, process in fleet.processes.values():
            process.kill()
            process.wait()
    print(json.dumps(report))
    check_fleet_summary(fleet)
