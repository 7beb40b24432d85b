"""`python -m kvd.sim --seed N`: run the simulator and report hit rates per tier.

Runs every eviction policy the registry knows (or --policy) at each host
capacity (--host-capacity) over one seeded trace, checking every
invariant every 16 steps and after the last (--verify-every 1: after every
step), and prints a table; --plot
and --json write the figure and the numbers. On a failure it prints the
seed, the step and the command that reproduces it, and exits with 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import traceback
from pathlib import Path

from kvd.config import WRITE_MODES, parse_size
from kvd.errors import ConfigError
from kvd.sim.report import Progress, describe, policy_names, sweep, table, write_json, write_plot
from kvd.sim.config import SimConfig
from kvd.sim.simulator import SimFailure

_DEFAULTS = SimConfig()
_DEFAULT_HOST = "8,16,32,64,128"
# A full check is O(blocks): after every step it is most of a run's time.
VERIFY_EVERY = 16


def _capacity(text: str, block_bytes: int, name: str) -> int:
    """A capacity in blocks ("64") or bytes with a unit ("2GiB")."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    try:
        return parse_size(name, text) // block_bytes
    except ConfigError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvd.sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, required=True, help="the run's seed: same seed, same trace, same result")
    p.add_argument("--requests", type=int, default=_DEFAULTS.requests, help="requests in the trace")
    p.add_argument("--policy", default="all",
                   help=f"eviction policies, comma-separated, or 'all' ({', '.join(policy_names())})")
    p.add_argument("--host-capacity", default=_DEFAULT_HOST,
                   help="host tier capacities to sweep, comma-separated, in blocks or with a unit (2GiB)")
    p.add_argument("--disk-capacity", default=str(_DEFAULTS.disk_blocks),
                   help="disk tier capacity in blocks or with a unit; 0: no disk tier")
    p.add_argument("--middle-capacity", default=str(_DEFAULTS.middle_blocks),
                   help="a volatile memory tier between host memory and the disk, in blocks or with a unit; "
                        "0: none (the default)")
    p.add_argument("--block-tokens", type=int, default=_DEFAULTS.block_tokens, help="tokens per block")
    p.add_argument("--tenants", type=int, default=_DEFAULTS.trace.tenants, help="tenants (namespaces)")
    p.add_argument("--write-mode", choices=WRITE_MODES, default=_DEFAULTS.write_mode)
    p.add_argument("--io-schedule", choices=("slack", "fifo"), default=_DEFAULTS.io_schedule,
                   help="order of the disk's jobs (disk.io_schedule)")
    p.add_argument("--admission-min-hits", type=int, default=_DEFAULTS.admission_min_hits,
                   help="write a block to disk once seen this many times (disk.admission_min_hits)")
    p.add_argument("--fault-rate", type=float, default=_DEFAULTS.fault_rate,
                   help="share of disk block reads and writes that fail")
    p.add_argument("--durable-share", type=float, default=_DEFAULTS.durable_share,
                   help="share of requests whose Put waits to be acknowledged durable (ACK_DURABLE)")
    p.add_argument("--delete-share", type=float, default=_DEFAULTS.delete_share,
                   help="share of requests whose client then Deletes its reply's blocks")
    p.add_argument("--prefetch-share", type=float, default=_DEFAULTS.prefetch_share,
                   help="share of requests prefetched (disk reads into host memory) before their Get")
    p.add_argument("--tenant-host-quota", type=int, default=_DEFAULTS.tenant_host_quota_blocks,
                   help="each tenant's host quota in blocks (0: none)")
    p.add_argument("--verify-every", type=int, default=VERIFY_EVERY,
                   help=f"check every invariant after every Nth step and after the last (default {VERIFY_EVERY}: a "
                        "run of the defaults in seconds; 1: after every step, as make sim-long and the tests do)")
    p.add_argument("--plot", type=Path, help="write the hit-rate plot here (PNG)")
    p.add_argument("--json", type=Path, help="write the results here (JSON)")
    p.add_argument("--quiet", action="store_true", help="no progress line on stderr")
    return p


def base_config(args: argparse.Namespace) -> SimConfig:
    trace = dataclasses.replace(_DEFAULTS.trace, tenants=args.tenants)
    config = dataclasses.replace(
        _DEFAULTS, seed=args.seed, requests=args.requests, block_tokens=args.block_tokens,
        write_mode=args.write_mode, io_schedule=args.io_schedule, admission_min_hits=args.admission_min_hits,
        fault_rate=args.fault_rate, durable_share=args.durable_share, delete_share=args.delete_share,
        prefetch_share=args.prefetch_share,
        tenant_host_quota_blocks=args.tenant_host_quota, verify_every=args.verify_every, trace=trace,
    )
    disk_blocks = _capacity(args.disk_capacity, config.block_bytes, "--disk-capacity")
    middle_blocks = _capacity(args.middle_capacity, config.block_bytes, "--middle-capacity")
    return dataclasses.replace(config, disk_blocks=disk_blocks, middle_blocks=middle_blocks)


def reproduce_command(config: SimConfig) -> str:
    """The command that runs exactly the failed configuration (the same checks, so the same step fails)."""
    words = [
        "python", "-m", "kvd.sim", "--seed", str(config.seed), "--requests", str(config.requests),
        "--policy", config.policy, "--host-capacity", str(config.host_blocks),
        "--disk-capacity", str(config.disk_blocks), "--middle-capacity", str(config.middle_blocks),
        "--block-tokens", str(config.block_tokens),
        "--tenants", str(config.trace.tenants), "--write-mode", config.write_mode,
        "--io-schedule", config.io_schedule, "--admission-min-hits", str(config.admission_min_hits),
        "--fault-rate", repr(config.fault_rate), "--durable-share", repr(config.durable_share),
        "--delete-share", repr(config.delete_share), "--tenant-host-quota", str(config.tenant_host_quota_blocks),
        "--prefetch-share", repr(config.prefetch_share),
        "--verify-every", str(config.verify_every),
    ]
    return shlex.join(words)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    known = policy_names()
    policies = known if args.policy == "all" else [name.strip() for name in args.policy.split(",")]
    unknown = [name for name in policies if name not in known]
    if unknown:
        parser().error(f"unknown policy {', '.join(unknown)} (known: {', '.join(known)})")
    try:
        base = base_config(args)
        host_blocks = [_capacity(text, base.block_bytes, "--host-capacity") for text in args.host_capacity.split(",")]
    except argparse.ArgumentTypeError as error:
        parser().error(str(error))
    if min(host_blocks) < 1:
        parser().error("--host-capacity: every capacity must be at least one block")
    progress = None if args.quiet else Progress(len(policies) * len(host_blocks))
    try:
        results = sweep(base, policies, host_blocks, progress)
    except SimFailure as failure:
        if progress is not None:
            progress.close()
        traceback.print_exception(failure.cause, file=sys.stderr)
        print(f"kvd.sim: FAILED at seed {failure.config.seed}, step {failure.step} ({failure.event}): "
              f"{type(failure.cause).__name__}: {failure.cause}", file=sys.stderr)
        print(f"kvd.sim: {describe(failure.config)}, policy {failure.config.policy}, "
              f"host {failure.config.host_blocks} blocks", file=sys.stderr)
        print(f"reproduce: {reproduce_command(failure.config)}", file=sys.stderr)
        return 1
    print(table(base, results))
    if args.plot is not None:
        write_plot(args.plot, base, results)
        print(f"plot: {args.plot}")
    if args.json is not None:
        write_json(args.json, base, results)
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    status = main()
    if status:
        # A failed run leaves its engine broken on purpose; the finalizers
        # of its block handles would re-raise at exit and bury the seed
        # line under their tracebacks.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)
