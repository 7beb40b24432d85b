"""Serve prompts with a real vLLM (offline LLM API), print what came out as JSON.

Run in the engine venv (.venv-vllm) by tests/engines/test_vllm_connector.py:

    python tests/engines/vllm_run.py --model DIR --prompts P.json [--kvd TARGET] [--transfer daemon]
        [--hooks H1,H2,..] [--prefill-profile P] [--compile] [--dtype D] [--block-size N]
        [--kv-cache-dtype fp8] --out R.json

P.json is a list of token-id lists, served one after another (greedy, with
the chosen tokens' logprobs). With --kvd the engine runs kvd's connector;
--hooks loads it through tests/engines/vllm_hooks.py, which does something
to the blocks between the scheduler's Lookup and the worker's load (one
hook per prompt; vLLM's own prefix cache is reset before each, as with --reset). --compile
runs without enforce_eager (vLLM compiles the model with torch.compile). The
output has, per prompt, the tokens, logprobs and vLLM's own count of prompt
tokens it did not compute (num_cached_tokens), the connector's counters, and
the compilation settings vLLM resolved.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

BLOCK_SIZE = 128


def engine(args):
    from vllm import LLM
    from vllm.config import KVEventsConfig, KVTransferConfig

    transfer = None
    if args.kvd:
        extra = {"target": args.kvd, "load": args.load, "transfer": args.transfer, "io_ring": args.io_ring}
        if args.placement:
            extra["placement"] = json.loads(args.placement)
        if args.prefill_profile:
            extra["prefill_profile"] = args.prefill_profile
        module, name = "kvd.connectors.vllm", "KvdConnector"
        if args.hooks:
            module, name = "vllm_hooks", "HookedKvdConnector"
        transfer = KVTransferConfig(kv_connector=name, kv_connector_module_path=module, kv_role="kv_both",
                                    kv_load_failure_policy="recompute", kv_connector_extra_config=extra)
    # KV events on (published nowhere): the connector's events are captured below.
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null") if args.kvd else None
    return LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype, enforce_eager=not args.compile,
               block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype, max_model_len=4096, seed=0,
               kv_transfer_config=transfer,
               kv_events_config=events, distributed_executor_backend="uni", gpu_memory_utilization=0.5)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--kvd", default="")
    parser.add_argument("--load", default="async")
    parser.add_argument("--transfer", default="client", help="the connector's transfer: client or daemon")
    parser.add_argument("--placement", default="", help="the connector's placement table, as JSON")
    parser.add_argument("--prefill-profile", default="", help="the connector's prefill profile (the load rule)")
    parser.add_argument("--io-ring", action="store_true", help="the connector's io_ring (with --transfer daemon)")
    parser.add_argument("--hooks", default="", help="comma-separated, one per prompt (see vllm_hooks.py)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--compile", action="store_true", help="without enforce_eager")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (fp8: one byte an element)")
    parser.add_argument("--reset", action="store_true", help="reset vLLM's own prefix cache before each prompt")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    from vllm import SamplingParams

    llm = engine(args)
    published = capture_events(llm) if args.kvd else []
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=0, detokenize=False)
    prompts = json.loads(Path(args.prompts).read_text())
    hooks = args.hooks.split(",") if args.hooks else [""] * len(prompts)
    results = []
    for prompt, hook in zip(prompts, hooks, strict=True):
        if args.hooks:
            import vllm_hooks

            vllm_hooks.NEXT = hook
        if args.hooks or args.reset:
            llm.reset_prefix_cache()  # so the prompt is served by kvd, not vLLM's own cache
        output = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        completion = output.outputs[0]
        logprobs = [float(step[token].logprob) for step, token in zip(completion.logprobs, completion.token_ids)]
        results.append({"tokens": list(completion.token_ids), "logprobs": logprobs,
                        "cached_tokens": output.num_cached_tokens, "fired": _fired(args.hooks)})
    compilation = llm.llm_engine.vllm_config.compilation_config
    report = {"results": results, "connector": connector_report(),
              "compilation": {"mode": compilation.mode.name, "cudagraph_mode": compilation.cudagraph_mode.name,
                              "backend": compilation.backend}}
    if args.kvd and report["connector"].get("enabled", True):
        report["events"] = events_report(llm, published, report["connector"]["totals"]["saved_blocks"])
    Path(args.out).write_text(json.dumps(report))


def _scheduler(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def capture_events(llm) -> list:
    """Every KV event the scheduler publishes (vLLM's own and the connector's)."""
    published = []
    _scheduler(llm).kv_event_publisher.publish = lambda batch: published.extend(batch.events)
    return published


def events_report(llm, published: list, saved_blocks: int) -> dict:
    """kvd's STORED blocks as vLLM published them (medium CPU/STORAGE), once the feed caught up."""
    from vllm.distributed.kv_events import BlockStored

    connector = _scheduler(llm).connector
    deadline = time.monotonic() + 10
    stored: list[str] = []
    while True:
        published.extend(connector.take_events())  # what arrived after the last engine step
        stored = [key.hex() for event in published if isinstance(event, BlockStored)
                  and event.medium in ("CPU", "STORAGE") for key in event.block_hashes]
        if len(stored) >= saved_blocks or time.monotonic() > deadline:
            return {"kvd_stored": stored}
        time.sleep(0.05)


def _fired(hooks: str) -> list[str]:
    if not hooks:
        return []
    import vllm_hooks

    fired, vllm_hooks.FIRED[:] = list(vllm_hooks.FIRED), []
    return fired


def connector_report() -> dict:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {}
    connector = get_kv_transfer_group()
    worker = getattr(connector, "worker", None)
    if worker is None:
        return {"enabled": False}
    worker.counters.take(worker.totals)
    spec = connector._spec
    return {"enabled": True, "totals": worker.totals, "model_id": spec.model_id,
            "model_revision": spec.model_revision, "namespace_id": worker.namespace.namespace_id.hex()}


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    main()
