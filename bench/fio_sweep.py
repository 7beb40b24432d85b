#!/usr/bin/env python3
"""The best sequential-read bandwidth fio finds on one file system: a small sweep of block size,
queue depth and jobs (O_DIRECT, io_uring), each run's own I/O time, the best kept.

bench_disk_restore compares kvd against one fio setting (1 MiB, depth 32); on an unknown drive (the
GPU machine's) the drive's best is a fairer bar, so tools/device_check sets kvd's restore against
this sweep's best. The file is written once by fio itself (so it is real data on the device, not a
sparse file) and removed at the end.

Run: python bench/fio_sweep.py --dir /tmp [--size-mib 1024] [--bs 128k,1m,4m] [--iodepth 8,32,128]
         [--numjobs 1,4] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import progress, report  # noqa: E402


def fio_run(fio: str, path: Path, size_mib: int, options: dict[str, str], timeout_s: float) -> dict:
    """One fio job over `path`; its bandwidth from fio's JSON (bytes moved / fio's own I/O time)."""
    command = [fio, "--name=sweep", f"--filename={path}", f"--size={size_mib}M", "--direct=1",
               "--ioengine=io_uring", "--output-format=json", "--group_reporting=1",
               *(f"--{key}={value}" for key, value in options.items())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode:
        raise RuntimeError(f"fio {options} failed ({done.returncode}): {done.stderr.strip()[-300:]}")
    job = json.loads(done.stdout[done.stdout.index("{"):])["jobs"][0]
    side = job["write" if options["rw"] == "write" else "read"]
    return {"io_bytes": side["io_bytes"], "gib_s": side["bw_bytes"] / (1 << 30)}


def sweep(fio: str, directory: Path, args: argparse.Namespace) -> dict:
    path = directory / "fio-sweep.bin"
    progress(f"fio: laying out {args.size_mib} MiB in {path}")
    fio_run(fio, path, args.size_mib, {"rw": "write", "bs": "1m", "iodepth": "32", "end_fsync": "1"}, args.timeout_s)
    runs = []
    for bs, depth, jobs in itertools.product(args.bs, args.iodepth, args.numjobs):
        # Jobs split the file between them, so every setting reads the same bytes once.
        options = {"rw": "read", "bs": bs, "iodepth": str(depth), "numjobs": str(jobs),
                   "offset_increment": f"{args.size_mib // jobs}M", "size": f"{args.size_mib // jobs}M"}
        result = fio_run(fio, path, args.size_mib // jobs, options, args.timeout_s)
        runs.append({"bs": bs, "iodepth": depth, "numjobs": jobs, "gib_s": result["gib_s"]})
        progress(f"fio read bs={bs} iodepth={depth} numjobs={jobs}: {result['gib_s']:.2f} GiB/s")
    best = max(runs, key=lambda run: run["gib_s"])
    return {"fio": fio, "directory": str(directory), "size_mib": args.size_mib, "runs": runs, "best": best}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fio", default=shutil.which("fio"))
    parser.add_argument("--dir", default=None, help="where the file goes (default: the system temp dir)")
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--bs", type=lambda text: text.split(","), default=["128k", "1m", "4m"])
    parser.add_argument("--iodepth", type=lambda text: [int(x) for x in text.split(",")], default=[8, 32, 128])
    parser.add_argument("--numjobs", type=lambda text: [int(x) for x in text.split(",")], default=[1, 4])
    parser.add_argument("--timeout-s", type=float, default=120.0, help="the longest one fio run may take")
    parser.add_argument("--json", type=Path, help="write the sweep here")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.fio:
        report("fio not found: no sweep")
        return 2
    with tempfile.TemporaryDirectory(prefix="kvd-fio-sweep-", dir=args.dir) as directory:
        result = sweep(args.fio, Path(directory), args)
    best = result["best"]
    report(f"fio best: {best['gib_s']:.2f} GiB/s (bs={best['bs']}, iodepth={best['iodepth']}, "
           f"numjobs={best['numjobs']}) of {len(result['runs'])} settings")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
