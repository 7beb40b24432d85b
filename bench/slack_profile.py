#!/usr/bin/env python3
"""Measure a slack table (kvd.planner.slack) from a real Hugging Face model on this machine.

For each (input length, prefix length) of the grid the model first runs the
prefix (its KV cache kept), then, `repeats` times after one warm-up, the
new tokens on top of it; a hook around every decoder layer times its
forward. The window of layer l is the median of those times.

    .venv/bin/python bench/slack_profile.py [--out bench/results/slack_table.json] [--plot docs/slack_table.png]
        [--model DIR] [--inputs 16 64 256] [--prefixes 0 512 2048 8192] [--repeats 5]

Without --model it builds kvd's tiny Llama (kvd.testing.tiny_llama: a real
Llama architecture with seeded weights; nothing is downloaded). Needs
torch and transformers (kvd's own venv has both); the daemon itself only
reads the JSON.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvd.planner.slack import SlackTable  # noqa: E402


class LayerTimer:
    """Forward pre- and post-hooks on every decoder layer: seconds per call, per layer."""

    def __init__(self, layers) -> None:
        self.samples: list[list[float]] = [[] for _ in layers]
        self._started = [0.0] * len(layers)
        self.recording = False
        self._handles = []
        for index, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._start(index)))
            self._handles.append(layer.register_forward_hook(self._stop(index)))

    def _start(self, index: int):
        def hook(module, args) -> None:
            self._started[index] = time.perf_counter()
        return hook

    def _stop(self, index: int):
        def hook(module, args, output) -> None:
            if self.recording:
                self.samples[index].append(time.perf_counter() - self._started[index])
        return hook

    def take(self) -> list[float]:
        medians = [statistics.median(samples) for samples in self.samples]
        self.samples = [[] for _ in self.samples]
        return medians

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def _windows(model, timer: LayerTimer, input_tokens: int, prefix_tokens: int, repeats: int,
             rng: np.random.Generator) -> list[float]:
    """Median per-layer seconds of `input_tokens` new tokens after a cached prefix."""
    import torch
    from transformers import DynamicCache

    vocab = model.config.vocab_size
    prefix = torch.from_numpy(rng.integers(4, vocab, (1, prefix_tokens)))
    new = torch.from_numpy(rng.integers(4, vocab, (1, input_tokens)))
    cache = DynamicCache()
    with torch.no_grad():
        if prefix_tokens:
            model(input_ids=prefix, past_key_values=cache, use_cache=True)
        for attempt in range(repeats + 1):
            timer.recording = attempt > 0  # the first run warms up
            model(input_ids=new, past_key_values=cache, use_cache=True)
            cache.crop(-input_tokens)  # back to the prefix alone
            if cache.get_seq_length() != prefix_tokens:
                raise RuntimeError(f"the cache holds {cache.get_seq_length()} tokens, not the {prefix_tokens} of the prefix")
    timer.recording = False
    return timer.take()


def measure(model_dir: Path, inputs: list[int], prefixes: list[int], repeats: int = 5, seed: int = 0) -> SlackTable:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_bytes = 2 * config.num_key_value_heads * head_dim * 4  # K and V, float32
    timer = LayerTimer(model.model.layers)
    rng = np.random.default_rng(seed)
    compute = np.zeros((len(inputs), len(prefixes), len(model.model.layers)))
    points = len(inputs) * len(prefixes)
    try:
        for i, input_tokens in enumerate(inputs):
            for p, prefix_tokens in enumerate(prefixes):
                compute[i, p] = _windows(model, timer, input_tokens, prefix_tokens, repeats, rng)
                done = i * len(prefixes) + p + 1
                print(f"[{done}/{points}] input {input_tokens:5d}  prefix {prefix_tokens:6d}  "
                      f"layer mean {compute[i, p].mean() * 1e3:8.3f} ms", flush=True)
    finally:
        timer.close()
    device = f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    return SlackTable(str(model_dir.name), len(model.model.layers), kv_bytes, tuple(inputs), tuple(prefixes),
                      compute, device)


def plot(table: SlackTable, path: Path, read_bps: float, write_bps: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for n in table.inputs:
        left.plot(table.prefixes, [table.windows(n, p).mean() * 1e3 for p in table.prefixes], marker="o",
                  label=f"{n} new tokens")
    right.plot(table.prefixes, [table.write_chunk_bytes(p, read_bps, write_bps) / 2**20 for p in table.prefixes],
               marker="o")
    left.set(xlabel="prefix tokens", ylabel="window per layer (ms)", title=f"{table.model}: compute per layer")
    left.legend()
    right.set(xlabel="prefix tokens", ylabel="write job (MiB)",
              title=f"write budget, shortest input, read {read_bps / 2**30:.1f} / write {write_bps / 2**30:.1f} GiB/s")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "slack_table.json")
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--inputs", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--prefixes", type=int, nargs="+", default=[0, 512, 2048, 8192])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--read-gib-s", type=float, default=2.0, help="the plot's read bandwidth (an assumption)")
    parser.add_argument("--write-gib-s", type=float, default=1.0, help="the plot's write bandwidth (an assumption)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        model = args.model
        if model is None:
            from kvd.testing import tiny_llama

            model = tiny_llama.build(Path(scratch) / "tiny-llama")
        table = measure(model, sorted(args.inputs), sorted(args.prefixes), args.repeats)
    table.save(args.out)
    print(f"wrote {args.out}", file=sys.stderr)
    if args.plot is not None:
        plot(table, args.plot, args.read_gib_s * 2**30, args.write_gib_s * 2**30)
        print(f"wrote {args.plot}", file=sys.stderr)


if __name__ == "__main__":
    main()
