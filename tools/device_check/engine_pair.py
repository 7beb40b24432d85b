"""Step b of the device check: two engine processes and one daemon, every copy made by kvd's device plane.

Each engine holds torch tensors laid out as vLLM's paged KV cache on a GPU (per layer
[2, num_blocks, block_size, kv_heads, head_dim], bf16) and drives kvd's vLLM connector worker
(DeviceWorkerSide) as vLLM's model runner does: start, then per layer wait_layer / save_layer, then
finish_step. So the pool is registered with the daemon (CUDA IPC on a GPU), and the saves and loads
are the daemon's per-layer copies. Engine 1 writes a request's blocks layer by layer and saves them;
engine 2, a second process with its own pool, loads them into other pages and checks every byte of
every layer right after its wait_layer (before "attention"), and that no other page was touched.
Both engines make the expected bytes from one seed, so nothing but kvd carries them across.

    python -m tools.device_check.engine_pair --kind cuda --dir /tmp/x --json out.json
(--kind cpu runs the same on kvd's CPU device, which is what a machine without a GPU can check.)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 8, 8, 128, 16
POOL_BLOCKS, REQUEST_BLOCKS = 512, 96
SEED = 20261127


def spec():
    from kvd.core.keys import DType, NamespaceSpec

    return NamespaceSpec(model_id="device-check-engine", num_layers=LAYERS, num_kv_heads=KV_HEADS,
                         head_dim=HEAD_DIM, block_tokens=BLOCK_TOKENS, kv_dtype=DType.BFLOAT16)


def expected_layer(layer: int, device: str):
    """The request's K and V of one layer, [2, blocks, tokens, heads, head_dim], from the shared seed."""
    import torch

    generator = torch.Generator(device=device).manual_seed(SEED + layer)
    shape = (2, REQUEST_BLOCKS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
    return torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(torch.bfloat16)


class Engine:
    """One engine process: its pool (vLLM's layout) and the connector worker driving kvd."""

    def __init__(self, target: str, kind: str) -> None:
        import torch

        from kvd.connectors.vllm.config import ConnectorConfig
        from kvd.connectors.vllm.device_worker import DeviceWorkerSide
        from kvd.connectors.vllm.layout import paged_layout
        from kvd.connectors.vllm.transfer import local_namespace
        from kvd.core.keys import chain_keys

        self.device = "cuda" if kind == "cuda" else "cpu"
        shape = (2, POOL_BLOCKS, BLOCK_TOKENS, KV_HEADS, HEAD_DIM)
        self.tensors = {f"model.layers.{i}.self_attn.attn": torch.zeros(shape, dtype=torch.bfloat16, device=self.device)
                        for i in range(LAYERS)}
        layout = paged_layout(self.tensors, POOL_BLOCKS)
        config = ConnectorConfig(target=target, transfer="daemon", load_timeout_s=60.0)
        self.worker = DeviceWorkerSide(config, layout, local_namespace(spec()), 0, list(self.tensors.values()))
        self.keys = chain_keys(spec(), range(REQUEST_BLOCKS * BLOCK_TOKENS))

    def save(self, pages: list[int]) -> dict:
        from kvd.connectors.vllm.metadata import KvdConnectorMetadata, SaveOrder

        started = time.perf_counter()
        self.worker.start(KvdConnectorMetadata(saves=[SaveOrder("engine-1", [self.keys], [pages])]))
        for layer, (name, tensor) in enumerate(self.tensors.items()):
            self.worker.wait_layer(name)
            tensor[:, pages] = expected_layer(layer, self.device)  # this layer's "attention" writes its KV
            self.worker.save_layer(name)
        self.worker.finish_step()
        totals = self._totals()
        return {"saved_blocks": totals["saved_blocks"], "save_errors": totals["save_errors"],
                "step_s": time.perf_counter() - started}

    def load(self, pages: list[int]) -> dict:
        import torch

        from kvd.connectors.vllm.metadata import KvdConnectorMetadata, LoadOrder

        started = time.perf_counter()
        exact_layers = 0
        self.worker.start(KvdConnectorMetadata(loads=[LoadOrder("engine-2", [self.keys], 0, [pages], False)]))
        for layer, (name, tensor) in enumerate(self.tensors.items()):
            self.worker.wait_layer(name)
            # Checked before this layer's "attention" would run: the layer must be there already.
            exact_layers += bool(torch.equal(tensor[:, pages], expected_layer(layer, self.device)))
            self.worker.save_layer(name)
        self.worker.finish_step()
        step_s = time.perf_counter() - started
        others = torch.ones(POOL_BLOCKS, dtype=torch.bool)
        others[pages] = False
        untouched = all(not tensor[:, others.to(tensor.device)].any() for tensor in self.tensors.values())
        totals = self._totals()
        return {"exact_layers": exact_layers, "layers": LAYERS, "other_pages_untouched": bool(untouched),
                "loaded_blocks": totals["loaded_blocks"], "load_errors": sorted(self.worker.load_errors()),
                "step_s": step_s}

    def _totals(self) -> dict:
        self.worker.counters.take(self.worker.totals)
        return self.worker.totals


def engine_main(args: argparse.Namespace) -> int:
    """One engine process: save (then hold the pool until stdin closes) or load and check."""
    engine = Engine(args.target, args.kind)
    if args.role == "save":
        result = engine.save(list(range(REQUEST_BLOCKS)))
        print(json.dumps(result), flush=True)
        sys.stdin.read()  # the pool stays registered while the other engine loads
    else:
        result = engine.load(list(range(POOL_BLOCKS - 1, POOL_BLOCKS - 1 - REQUEST_BLOCKS, -1)))
        print(json.dumps(result), flush=True)
    engine.worker.close()
    return 0


def _engine(role: str, target: str, kind: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "tools.device_check.engine_pair", "--engine", role, "--target", target,
               "--kind", kind]
    return subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _answer(process: subprocess.Popen, role: str) -> dict:
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"engine {role} ended without an answer (exit {process.wait()})")
    return json.loads(line)


def run_pair(kind: str, directory: Path) -> dict:
    """The daemon, engine 1's save, engine 2's load while engine 1 still holds its pool; the verdict."""
    from kvd.testing.daemon import start_daemon

    block_bytes = spec().block_bytes
    daemon = start_daemon(directory, {"host": {"capacity_bytes": 256 * block_bytes, "slot_bytes": block_bytes},
                                      "device": {"kind": kind}})
    try:
        saver = _engine("save", daemon.unix_target, kind)
        saved = _answer(saver, "1 (save)")
        loader = _engine("load", daemon.unix_target, kind)
        loaded = _answer(loader, "2 (load)")
        loader.wait(timeout=60)
        saver.communicate(timeout=60)
        blocks = daemon.metric_samples("kvd_device_blocks_total")
    finally:
        daemon.stop()
    result = {"kind": kind, "layers": LAYERS, "blocks": REQUEST_BLOCKS, "block_bytes": block_bytes,
              "save": saved, "load": loaded, "daemon_device_blocks": blocks}
    result["ok"] = (saved["saved_blocks"] == REQUEST_BLOCKS and loaded["exact_layers"] == LAYERS
                    and loaded["loaded_blocks"] == REQUEST_BLOCKS and not loaded["load_errors"]
                    and loaded["other_pages_untouched"]
                    and blocks.get('kvd_device_blocks_total{op="load"}') == REQUEST_BLOCKS)
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kind", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--engine", dest="role", choices=("save", "load"), help="(internal) run one engine")
    parser.add_argument("--target", help="(with --engine) the daemon")
    parser.add_argument("--dir", type=Path, help="the daemon's directory")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.role:
        return engine_main(args)
    result = run_pair(args.kind, args.dir)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
