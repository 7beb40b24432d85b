#!/usr/bin/env python3
"""Which of vLLM's own KV offloading paths run on this host (issue 38 item 4).

vLLM ships its own offloading: the OffloadingConnector (a CPU tier; with TieringOffloadingSpec,
secondary tiers such as a file system) and the SimpleCPUOffloadConnector (a cpu or a disk
backend). They are what a vLLM user tries first, so kvd's comparisons should stand beside them.
This probe starts vLLM (`LLM`, the tiny Llama with random weights, one 1,096-token prompt) with each
in turn and records whether it generated or, if not, the error vLLM's worker reported, as it
reported it. Run it in vLLM's venv (the connector tests' `.venv-vllm`):

    .venv-vllm/bin/python bench/vllm_offload_probe.py

On a GPU host the same command says which paths are open there, before any side-by-side run.
Writes bench/results/vllm_offload_probe.json.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvd.testing import tiny_llama  # noqa: E402

MIB = 1 << 20
TIMEOUT_S = 600


def paths(scratch: Path) -> dict[str, tuple[str, dict]]:
    """Each path: (vLLM's connector name, its kv_connector_extra_config)."""
    cpu = {"cpu_bytes_to_use": 256 * MIB}
    return {
        "OffloadingConnector, CPU tier": ("OffloadingConnector", cpu),
        "OffloadingConnector, tiering with an fs tier": ("OffloadingConnector", {
            **cpu, "spec_name": "TieringOffloadingSpec",
            "secondary_tiers": [{"type": "fs", "root_dir": str(scratch / "fs")}]}),
        "SimpleCPUOffloadConnector, cpu backend": ("SimpleCPUOffloadConnector", cpu),
        "SimpleCPUOffloadConnector, disk backend": ("SimpleCPUOffloadConnector", {
            **cpu, "kv_offload_backend": "disk", "disk_path": str(scratch / "disk"),
            "disk_capacity_bytes": 1024 * MIB}),
    }


RUN = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
def main():
    name, extra, model = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    transfer = KVTransferConfig(kv_connector=name, kv_role="kv_both", kv_connector_extra_config=extra)
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, block_size=128,
              max_model_len=4096, seed=0, kv_transfer_config=transfer, distributed_executor_backend="uni",
              gpu_memory_utilization=0.5)
    out = llm.generate([{"prompt_token_ids": list(range(4, 1100))}], SamplingParams(max_tokens=4))
    print("GENERATED", list(out[0].outputs[0].token_ids))
if __name__ == "__main__":
    main()
"""


def probe(name: str, extra: dict, model: Path, script: Path) -> dict:
    started = time.monotonic()
    try:
        done = subprocess.run([sys.executable, str(script), name, json.dumps(extra), str(model)],
                              capture_output=True, text=True, timeout=TIMEOUT_S)
        output, code = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired:
        output, code = "", -1
    generated = re.search(r"^GENERATED (.*)$", output, re.M)
    failure = re.search(r"Worker failed with error '(.*)', please check", output) or re.search(r"^\w*Error: (.+)$", output, re.M)
    return {"runs": bool(generated) and code == 0, "exit": code, "seconds": round(time.monotonic() - started, 1),
            "error": None if generated else (failure.group(1) if failure else f"exit {code}, no error line")}


def main() -> int:
    results = {}
    with tempfile.TemporaryDirectory(prefix="kvd-vllm-offload-") as scratch:
        scratch = Path(scratch)
        model = tiny_llama.build(scratch / "model")
        script = scratch / "run.py"
        script.write_text(RUN)
        for label, (name, extra) in paths(scratch).items():
            print(f"[{time.strftime('%H:%M:%S')}] {label} ...", flush=True)
            results[label] = probe(name, extra, model, script)
    import vllm
    print(f"vLLM {vllm.__version__}; the tiny Llama, one 1,096-token prompt")
    for label, result in results.items():
        print(f"{label:<46} {'runs' if result['runs'] else 'fails: ' + result['error']}")
    out = ROOT / "bench/results/vllm_offload_probe.json"
    out.write_text(json.dumps({"vllm": vllm.__version__, "results": results}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
