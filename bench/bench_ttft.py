#!/usr/bin/env python3
"""Time to first token: a prefix restored from kvd vs a full recompute.

Runs examples/hf_prefix_reuse.py against a real daemon: one process stores
the KV of a prompt, a second process (same seeded random Llama, no
download) restores the prefix from kvd, rebuilds the transformers cache and
runs only the new suffix. That second process also times a full recompute
of prompt+suffix in the same run, alternating with the restores, so the
ratio is measured side by side. Both the shared-memory and the inline gRPC
paths are measured, for several prompt lengths.

Also checked on every run: the restored logits equal the model's own
in-memory continuation bit for bit, and match the full recompute within
1e-5.

Run:  .venv/bin/python bench/bench_ttft.py [--prompt-tokens 1024 2048 4000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO_ROOT, progress, report, write_result  # noqa: E402

from kvd.testing.daemon import run_daemon  # noqa: E402

EXAMPLE = REPO_ROOT / "examples" / "hf_prefix_reuse.py"


def run_example(target: str, role: str, prompt_tokens: int, repeats: int, shared: str, seed: int, out: Path) -> dict:
    command = [
        sys.executable, str(EXAMPLE), "--target", target, "--role", role,
        "--prompt-tokens", str(prompt_tokens), "--repeats", str(repeats),
        "--shared-memory", shared, "--seed", str(seed), "--json", str(out),
    ]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{completed.stdout}\n{completed.stderr}")
    return json.loads(out.read_text())[role]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[1024, 2048, 4000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    rows = []
    with tempfile.TemporaryDirectory(prefix="kvd-bench-ttft-") as scratch_text:
        scratch = Path(scratch_text)
        config = {"host": {"capacity_bytes": 512 << 20, "slot_bytes": 64 << 10}}
        with run_daemon(scratch / "daemon", config=config) as daemon:
            for seed, prompt_tokens in enumerate(args.prompt_tokens):
                for shared in ("on", "off"):
                    # A fresh seed per prompt length: nothing is shared between rows.
                    run_seed = seed * 2 + (shared == "off")
                    progress(f"prompt {prompt_tokens} tokens, shared memory {shared}: store")
                    store = run_example(daemon.unix_target, "store", prompt_tokens, 1, shared, run_seed,
                                        scratch / "store.json")
                    progress(f"prompt {prompt_tokens} tokens, shared memory {shared}: restore x{args.repeats}")
                    restore = run_example(daemon.unix_target, "restore", prompt_tokens, args.repeats, shared,
                                          run_seed, scratch / "restore.json")
                    rows.append({
                        "prompt_tokens": prompt_tokens,
                        "path": "shared memory" if shared == "on" else "inline gRPC",
                        "restored_blocks": restore["restored_blocks"],
                        "fetched_mib": restore["fetched_bytes"] / 2**20,
                        "store_put_ms": store["put_s"] * 1e3,
                        "get_ms": restore["get_s"] * 1e3,
                        "ttft_restore_ms": restore["ttft_restore_s"] * 1e3,
                        "ttft_full_ms": restore["ttft_full_s"] * 1e3,
                        "speedup": restore["ttft_full_s"] / restore["ttft_restore_s"],
                        "bit_exact_vs_own_cache": restore["restored_equals_own_cache"],
                        "max_abs_diff_vs_full": restore["max_abs_diff_vs_full"],
                    })

    report("TTFT: restore from kvd vs full recompute (best of repeats, same process, 2-core CPU)")
    report(f"{'prompt':>7} {'path':<14} {'blocks':>6} {'MiB':>6} {'get ms':>8} {'restore ms':>11} "
           f"{'recompute ms':>13} {'speedup':>8} {'exact':>6} {'|diff| vs full':>15}")
    for row in rows:
        report(f"{row['prompt_tokens']:>7} {row['path']:<14} {row['restored_blocks']:>6} {row['fetched_mib']:>6.1f} "
               f"{row['get_ms']:>8.1f} {row['ttft_restore_ms']:>11.1f} {row['ttft_full_ms']:>13.1f} "
               f"{row['speedup']:>7.1f}x {str(row['bit_exact_vs_own_cache']):>6} {row['max_abs_diff_vs_full']:>15.2g}")
    passed = all(row["bit_exact_vs_own_cache"] and row["max_abs_diff_vs_full"] <= 1e-5 and row["speedup"] > 1
                 for row in rows)
    write_result("bench_ttft", {
        "target": {"restored_logits": "bit-exact vs own cache, <= 1e-5 vs full recompute",
                   "speedup_min": 1.0},
        "pass": passed,
        "settings": {"prompt_tokens": args.prompt_tokens, "repeats": args.repeats,
                     "model": "Llama, 4 layers, hidden 256, 4 heads, 2 KV heads, float32, seeded random weights",
                     "block_tokens": 16},
        "results": rows,
    })
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
