"""The simulator: fixed seeds through the real engine, its report, its failure output.

The seeded runs are small and hostile: a host tier of a few blocks, faulty
disk reads and writes, clients that crash holding leases that expire
during the run. The simulator checks the engine's invariants and its own
after every step; a seed that breaks one fails here with its seed.
`make sim-long` runs many more seeds, longer.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvd.planner.io_schedule import IoSchedule
from kvd.core.keys import NamespaceSpec, chain_keys
from kvd.core.policy import make_policy
from kvd.core.requests import CommitRequest, KeysRequest
from kvd.sim.__main__ import main, reproduce_command
from kvd.sim.disk import DiskOpKind, DiskSpec, ModelledDisk
from kvd.sim.plane import SlotContents
from kvd.sim.report import policy_names, sweep, table, write_json
from kvd.sim.config import SimConfig
from kvd.sim.simulator import Simulator
from kvd.sim.traces import TraceConfig

REPO = Path(__file__).parents[2]
POLICIES = policy_names()
HOSTILE_TRACE = dataclasses.replace(TraceConfig(), client_crash_share=0.1)


def small(seed: int, **changes) -> SimConfig:
    config = SimConfig(
        seed=seed, requests=150, host_blocks=6, disk_blocks=40, block_tokens=256, fault_rate=0.03,
        lease_ms=2_000, trace=HOSTILE_TRACE,
    )
    return dataclasses.replace(config, **changes)


# (seed, policy, write mode, disk blocks): every policy, both write modes,
# and a host-only engine.
SEEDS = [
    (seed, POLICIES[seed % len(POLICIES)], ("back", "through")[seed // 2 % 2], 0 if seed == 4 else 40)
    for seed in range(1, 9)
]


@pytest.mark.parametrize(("seed", "policy", "write_mode", "disk_blocks"), SEEDS)
def test_a_seed_holds_every_invariant_after_every_step(seed, policy, write_mode, disk_blocks):
    config = small(seed, policy=policy, write_mode=write_mode, disk_blocks=disk_blocks)
    stats = Simulator(config).run().stats
    assert stats.requests == config.requests
    assert stats.steps > 2 * config.requests  # every request is several steps
    for weight in ("tokens", "blocks"):
        assert sum(stats.share(part, weight) for part in ("host", "disk", "miss")) == pytest.approx(1.0)
    # The run went where it was meant to: evictions, expiry, disk traffic.
    assert stats.host_evictions > 0 and stats.leases_expired > 0 and stats.clients_crashed > 0
    assert stats.host_hit_blocks > 0
    if disk_blocks:
        assert stats.disk_hit_blocks > 0 and stats.disk_written_blocks > 0


@pytest.mark.parametrize("policy", POLICIES)
def test_three_tiers_hold_every_invariant_after_every_step(policy):
    """A middle memory tier between host memory and the disk: written back,
    read from in preference to the disk, evicted on its own, under faults,
    durable Puts, prefetch, Deletes and crashing clients, checked after
    every step (the fake bytes of every copy in every tier too)."""
    config = small(41, policy=policy, middle_blocks=10, requests=200, durable_share=0.3, prefetch_share=0.3,
                   delete_share=0.2)
    simulator = Simulator(config)
    stats = simulator.run().stats
    assert [tier.name for tier in simulator.engine.tiers] == ["host", "middle", "disk"]
    for weight in ("tokens", "blocks"):
        assert sum(stats.share(part, weight) for part in ("host", "middle", "disk", "miss")) == pytest.approx(1.0)
    assert stats.middle_hit_blocks > 0 and stats.disk_hit_blocks > 0
    assert stats.middle_written_blocks > 0 and stats.middle_loaded_blocks > 0 and stats.middle_evictions > 0
    assert stats.durable_acked > 0 and stats.prefetched_blocks > 0 and stats.lost_blocks > 0


def test_a_middle_tier_turns_disk_reads_into_middle_reads():
    """Same trace, same host memory: with a middle tier, some of what was
    read from disk comes from the middle tier instead, and the disk reads less."""
    two = Simulator(small(43, fault_rate=0.0, requests=200)).run().stats
    three = Simulator(small(43, fault_rate=0.0, requests=200, middle_blocks=16)).run().stats
    assert three.middle_hit_blocks > 0 and two.middle_hit_blocks == 0
    assert three.disk_loaded_blocks < two.disk_loaded_blocks


def test_faults_lose_blocks_and_nothing_wrong_is_served():
    stats = Simulator(small(22, fault_rate=0.2)).run().stats
    assert stats.lost_blocks > 0
    assert stats.disk_hit_blocks > 0
    # A Get cut at a block that failed its checksum says so (kvd.core.get_life), not "missing".
    assert 0 < stats.get_cut_corrupt <= stats.get_starved


def test_a_writers_slot_stays_its_own_when_a_load_of_its_parent_fails(engine_factory):
    """Found by the simulator: a failed load of a disk-only block freed the
    host slots of everything under it, including a block a writer had
    reserved and was still filling; the next reserve got that slot."""
    spec = NamespaceSpec(model_id="writer-slot", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
    engine = engine_factory(2, 64, disk_slot_count=8, disk_slot_bytes=64)
    ns = engine.register_namespace(spec).namespace_id
    engine.enable_disk(ns)
    contents = SlotContents(engine)

    def keys(text: str) -> list[bytes]:
        return chain_keys(spec, [ord(char) for char in text])

    def put_durably(text: str) -> None:
        result = engine.reserve(KeysRequest(ns, "w", keys(text), 10_000, 0))
        contents.fill(keys(text), result.slots)
        engine.commit(CommitRequest(ns, "w", result.lease.lease_id, 0))
        writes = engine.pick_writes(10)
        engine.finish_writes(writes, contents.write(writes))

    try:
        put_durably("a")
        put_durably("x")
        put_durably("y")  # two host slots: "a" is on disk only now
        writer = engine.reserve(KeysRequest(ns, "writer", keys("ab"), 10_000, 0))  # "b" under disk-only "a"
        slot = writer.slots[1]
        plan = engine.begin_get(KeysRequest(ns, "reader", keys("a"), 10_000, 0))
        assert [load.block.key for load in plan.loads] == keys("a")
        engine.finish_loads(plan.loads, [False])  # "a" reads back corrupt: lost, "b" with it
        assert engine.settle_get(plan) == []
        owner = engine.host.pool.owners[slot]
        assert owner is not None and owner.key == keys("ab")[1], "the writer's slot was freed under it"
    finally:
        engine.close_all_leases()


def report_json(tmp_path: Path, seed: int) -> str:
    base = small(seed, requests=40)
    results = sweep(base, POLICIES, [6, 12])
    path = tmp_path / f"report-{seed}.json"
    write_json(path, base, results)
    assert len(table(base, results).splitlines()) == 4 + len(POLICIES) * 2
    return path.read_text()


def test_the_same_seed_gives_the_same_report_and_another_seed_another(tmp_path):
    first = report_json(tmp_path, 31)
    assert report_json(tmp_path, 31) == first
    assert report_json(tmp_path, 32) != first
    runs = json.loads(first)["runs"]
    assert [(run["policy"], run["host_blocks"]) for run in runs] == [(p, h) for p in POLICIES for h in (6, 12)]


def test_the_report_lists_every_registered_policy():
    assert "lru" in POLICIES and len(POLICIES) == len(set(POLICIES))
    for name in POLICIES:
        assert make_policy(name).name == name


def run_sim(preamble: str, argv: list[str]) -> subprocess.CompletedProcess:
    """`python -m kvd.sim ARGV` in a fresh interpreter, after `preamble` ran."""
    code = "\n".join([
        "import runpy, sys",
        preamble,
        f"sys.argv = ['kvd.sim', *{argv!r}]",
        "runpy.run_module('kvd.sim', run_name='__main__', alter_sys=True)",
    ])
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)


ARGV = ["--seed", "7", "--requests", "30", "--policy", "lru", "--host-capacity", "8", "--disk-capacity", "48",
        "--quiet"]


def failure_lines(process: subprocess.CompletedProcess) -> tuple[str, str]:
    assert process.returncode == 1, process.stderr[-2000:]
    failed = [line for line in process.stderr.splitlines() if line.startswith("kvd.sim: FAILED")]
    reproduce = [line for line in process.stderr.splitlines() if line.startswith("reproduce: ")]
    assert len(failed) == 1 and len(reproduce) == 1, process.stderr[-2000:]
    return failed[0], reproduce[0].removeprefix("reproduce: ")


# The engine forgets to make released blocks eviction candidates.
BROKEN_ENGINE = "from kvd.core.blocks import BlockLifecycle\nBlockLifecycle.maybe_admit = lambda self, block, *, cold: None"


def test_a_broken_engine_is_caught_with_its_seed_and_reproduced_by_the_printed_command():
    failed, command = failure_lines(run_sim(BROKEN_ENGINE, ARGV))
    assert failed.startswith("kvd.sim: FAILED at seed 7, step ")
    assert "policy membership" in failed or "InvariantError" in failed
    words = shlex.split(command)
    assert words[:5] == ["python", "-m", "kvd.sim", "--seed", "7"]
    # The printed command fails the same way at the same step.
    again, _ = failure_lines(run_sim(BROKEN_ENGINE, words[3:] + ["--quiet"]))
    assert again == failed
    # And the unbroken engine passes the same run.
    assert run_sim("", ARGV).returncode == 0


# The data plane serves the neighbouring disk slot's bytes.
LYING_DISK = """
from kvd.sim.plane import SlotContents
def load(self, loads, corrupt=()):
    for load in loads:
        self.host[load.target_slot] = self.disk.get(load.source_slot + 1, b"")
    return [True] * len(loads)
SlotContents.load = load
"""


def test_a_wrong_block_served_is_caught():
    failed, _ = failure_lines(run_sim(LYING_DISK, ARGV))
    assert "seed 7" in failed and "holds the bytes of another block" in failed


# The middle tier's plane serves a neighbouring slot's bytes; the disk's is honest.
LYING_MIDDLE = """
from kvd.sim.plane import SlotContents
honest = SlotContents.load
def load(self, loads, corrupt=()):
    ok = honest(self, loads, corrupt)
    for load in loads:
        if load.source.name == "middle":
            self.host[load.target_slot] = self.lower[load.source].get(load.source_slot + 1, b"")
    return ok
SlotContents.load = load
"""


def test_a_wrong_block_served_from_the_middle_tier_is_caught():
    argv = ARGV[:-1] + ["--middle-capacity", "8", "--requests", "80", "--verify-every", "1", "--quiet"]
    failed, command = failure_lines(run_sim(LYING_MIDDLE, argv))
    assert "holds the bytes of another block" in failed and "--middle-capacity 8" in command
    assert run_sim("", argv).returncode == 0


DURABLE_ARGV = ["--seed", "3", "--requests", "60", "--policy", "lru", "--host-capacity", "8", "--disk-capacity",
                "64", "--durable-share", "0.5", "--fault-rate", "0.05", "--verify-every", "1", "--quiet"]


def test_durable_puts_are_acknowledged_only_on_disk_or_refused_with_why():
    """The simulator runs ACK_DURABLE Puts through the mover's durable waits,
    as the daemon does: every one is answered, an acknowledged one has every
    block on disk with its own bytes (checked in the run), a refused one says
    why (a write failed, or its parent never reached disk)."""
    config = SimConfig(seed=3, requests=60, host_blocks=8, disk_blocks=64, durable_share=0.5, fault_rate=0.05)
    stats = Simulator(config).run().stats
    assert stats.durable_acked > 0 and stats.durable_failed > 0
    clean = Simulator(dataclasses.replace(config, fault_rate=0.0, disk_blocks=1024)).run().stats
    assert clean.durable_acked > 0 and clean.durable_failed == 0


def test_deletes_and_tenant_quotas_run_under_every_invariant():
    """Deletes of reply chains (their removals journalled at once) and
    per-tenant host quotas (tenant namespaces, Puts over the quota
    refused, the tenant's own blocks evicted first), every invariant checked
    after every step, durable Puts and disk faults alongside."""
    config = SimConfig(seed=5, requests=120, host_blocks=16, disk_blocks=128, delete_share=0.3,
                       tenant_host_quota_blocks=8, durable_share=0.3, fault_rate=0.02)
    simulator = Simulator(config)
    stats = simulator.run().stats
    assert stats.deleted_blocks > 0 and stats.quota_refused > 0 and stats.durable_acked > 0
    quotas = simulator.engine.tenants
    assert sorted(quotas) == ["tenant-0", "tenant-1", "tenant-2"][: config.trace.tenants]
    assert all(quota.counters.host_refused > 0 or quota.counters.host_evicted > 0 for quota in quotas.values())


def test_prefetched_blocks_are_used_by_the_gets_that_follow():
    """Prefetch jobs (PREFETCH reads, promoted to restores once a Get waits
    for them) run through the mover as in the daemon; the Get that follows
    uses what they read, and every invariant holds after every step."""
    config = SimConfig(seed=5, requests=120, host_blocks=16, disk_blocks=128, prefetch_share=0.5, fault_rate=0.02)
    stats = Simulator(config).run().stats
    assert stats.prefetched_blocks > 0 and stats.prefetch_used > 0
    assert stats.prefetch_used + stats.prefetch_wasted == stats.prefetched_blocks


# The mover forgets to finish a prefetch job: the engine never hears its blocks were read.
LEAKY_PREFETCH = """
import kvd.core.mover as mover
mover.Mover.prefetch_done = lambda self, loads, ok: 0
"""


def test_a_prefetch_left_unfinished_is_caught():
    argv = ["--seed", "5", "--requests", "60", "--policy", "lru", "--host-capacity", "16", "--disk-capacity", "128",
            "--prefetch-share", "0.5", "--verify-every", "1", "--quiet"]
    failed, command = failure_lines(run_sim(LEAKY_PREFETCH, argv))
    # Caught by the first check it breaks (the prefetch reads' pins are never released).
    assert "--prefetch-share 0.5" in command and "InvariantError" in failed, failed
    assert run_sim("", argv).returncode == 0


# The mover reports a failed write as durable.
LYING_MOVER = """
import kvd.core.mover as mover
written = mover.DurableWaits.written
def claims_success(self, writes, ok):
    return [(token, None) for token, _ in written(self, writes, ok)]
mover.DurableWaits.written = claims_success
"""


def test_a_durable_ack_for_a_block_not_on_disk_is_caught():
    failed, command = failure_lines(run_sim(LYING_MOVER, DURABLE_ARGV))
    assert "acknowledged durable left" in failed and "--durable-share 0.5" in command
    assert run_sim("", DURABLE_ARGV).returncode == 0


def test_the_plot_is_a_png_and_the_json_has_every_run(tmp_path, capsys):
    plot, results = tmp_path / "hit.png", tmp_path / "hit.json"
    argv = ["--seed", "3", "--requests", "25", "--host-capacity", "4,8", "--disk-capacity", "32",
            "--plot", str(plot), "--json", str(results)]
    assert main(argv) == 0
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 400 and height > 200
    assert data[-8:-4] == b"IEND"
    document = json.loads(results.read_text())
    assert document["seed"] == 3 and len(document["runs"]) == 2 * len(POLICIES)
    out, err = capsys.readouterr()
    assert "| policy | host blocks |" in out and "plot: " in out
    # Progress goes to stderr, a line per quarter of each run when not a terminal.
    assert f"run {2 * len(POLICIES)}/{2 * len(POLICIES)}" in err and "request 25/25" in err


def test_the_reproduce_command_names_every_setting_that_differs():
    config = small(9, policy=POLICIES[-1], write_mode="through")
    words = shlex.split(reproduce_command(config))
    flags = dict(zip(words[3::2], words[4::2]))
    assert flags["--seed"] == "9" and flags["--policy"] == POLICIES[-1] and flags["--write-mode"] == "through"
    assert flags["--host-capacity"] == "6" and flags["--disk-capacity"] == "40" and flags["--verify-every"] == "1"


@pytest.mark.parametrize(("mode", "order"), [("slack", ["journal", "read", "write"]),
                                           ("fifo", ["journal", "write", "read"])])
def test_the_modelled_disk_runs_the_daemons_schedule_and_charges_latency_plus_bandwidth(mode, order):
    spec = DiskSpec(read_bytes_per_s=1_000_000, write_bytes_per_s=500_000, read_latency_us=10, write_latency_us=5,
                    journal_latency_us=100)
    disk = ModelledDisk(spec, IoSchedule(mode))
    running = disk.op(DiskOpKind.WRITE, 1_000, 0)
    disk.submit(running)
    assert disk.start_next(0, backlog=0) is running and running.done_us == 5 + 2_000
    queued = {"write": disk.op(DiskOpKind.WRITE, 1_000, 50), "read": disk.op(DiskOpKind.READ, 2_000, 100),
              "journal": disk.op(DiskOpKind.JOURNAL, 0, 150)}
    queued["journal"].removals = [(b"", b"", 1)]
    for operation in queued.values():
        disk.submit(operation)
    assert disk.start_next(100, backlog=0) is None  # one operation at a time
    disk.complete(running, 2_005)
    ran, now_us = [], 2_005
    while (operation := disk.start_next(now_us, backlog=0)) is not None:
        ran.append(operation.kind.value)
        now_us = operation.done_us
        disk.complete(operation, now_us)
    assert ran == order and disk.idle
    assert queued["journal"].done_us - queued["journal"].start_us == 5 + 100
    assert queued["read"].done_us - queued["read"].start_us == 10 + 2_000
    assert disk.traffic.read_wait_us == queued["read"].start_us - 100
    with pytest.raises(AssertionError):
        disk.complete(running, 2_005)
