"""Load or recompute (issue 38 item 1) in the vLLM connector's scheduler side, against a real daemon
with a disk tier on real files: with a prefill profile the hit is priced from the daemon's
Lookup(load_times) and only the blocks that load sooner than vLLM computes them are offered (and
only those prefetched, for a load in the background); without one, every matched block is. The scheduler side is the one vLLM
builds, asked as vLLM asks it; vLLM itself is not needed for that."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np

from kvd.client import Client
from kvd.connectors.vllm.config import ConnectorConfig
from kvd.connectors.vllm.logs import LOGGER_NAME
from kvd.connectors.vllm.metadata import KvdHandshake
from kvd.connectors.vllm.scheduler import SchedulerSide
from kvd.core.keys import DType, KvOrder, NamespaceSpec, chain_keys
from kvd.planner.prefill import FORMAT
from kvd.testing.daemon import run_daemon
from kvd.v1 import kvd_pb2

SPEC = NamespaceSpec(model_id="load-rule-model", num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16,
                     kv_dtype=DType.FLOAT32)
BLOCKS = 8
PROMPT = np.arange(BLOCKS * SPEC.block_tokens + 5) + 1000  # 8 full blocks and a partial one


def config(tmp_path) -> dict:
    return {"host": {"capacity_bytes": 16 << 20, "slot_bytes": 64 << 10},
            "disk": {"directories": [str(tmp_path / "nvme0")], "capacity_bytes": 64 << 20,
                     "segment_bytes": 8 << 20, "slot_bytes": 64 << 10, "write_mode": "through"}}


def profile(path, per_token_s: float) -> str:
    """Prefill at per_token_s a token (and a millisecond more per step), whatever the prefix."""
    new = [1, 64, 4096]
    path.write_text(json.dumps({"format": FORMAT, "model": "load-rule-model", "engine": "test", "new_tokens": new,
                                "prefixes": [0], "seconds": [[1e-3 + n * per_token_s] for n in new]}))
    return str(path)


@contextlib.contextmanager
def scheduler_side(target: str, extra: dict, spec: NamespaceSpec = SPEC, shards: int = 1) -> Iterator[SchedulerSide]:
    """The scheduler side vLLM builds, its `shards` workers all handing over `spec`."""
    side = SchedulerSide(ConnectorConfig.from_extra({"target": target, **extra}), spec.block_tokens)
    try:
        side.set_shards({(rank, 0): KvdHandshake(spec=spec) for rank in range(shards)})
        yield side
    finally:
        side.close()


def ask(target: str, extra: dict, kv_transfer_params: dict | None = None) -> tuple[int, bool]:
    """get_num_new_matched_tokens of a new request with nothing computed, as vLLM asks it."""
    with scheduler_side(target, extra) as side:
        return side.matched_tokens(new_request(kv_transfer_params), 0)


def new_request(kv_transfer_params: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(request_id="r0", prompt_token_ids=PROMPT.tolist(), lora_request=None, cache_salt=None,
                           mm_features=None, kv_transfer_params=kv_transfer_params)


def declined_blocks(target: str, profile_path: str) -> list[int]:
    """What the workers are told the rule left to vLLM, over two steps: the request is asked about twice
    (vLLM asks again when it cannot schedule it yet), then scheduled in the first step."""
    with scheduler_side(target, {"prefill_profile": profile_path, "save": False}) as side:
        request = new_request()
        side.matched_tokens(request, 0)
        side.matched_tokens(request, 0)
        step = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=request.request_id)])
        return [side.build(step).declined_blocks, side.build(step).declined_blocks]


def test_only_the_blocks_that_load_sooner_than_vllm_computes_them_are_offered(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    with run_daemon(tmp_path / "kvd", config=config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(SPEC)
        keys = chain_keys(SPEC, PROMPT[:BLOCKS * SPEC.block_tokens])
        data = np.random.default_rng(5).standard_normal((BLOCKS, *SPEC.block_shape), dtype=np.float32)
        assert client.put(namespace, keys, data, durable=True) == BLOCKS
        assert client.demote().blocks_demoted >= BLOCKS
        assert len(client.get_numpy(namespace, keys[:3])) == 3  # read from disk: the drives' rate is known
        looked = client.lookup(namespace, keys, load_times=True)
        assert list(looked.tiers) == [kvd_pb2.TIER_HOST] * 3 + [kvd_pb2.TIER_DISK] * 5
        disk_block_s = looked.load_s[-1] / 5
        block = SPEC.block_tokens
        # Computing a block's 16 tokens takes far less than reading it: only the host blocks are worth
        # loading, a synchronous load; vLLM computes the disk ones, and they are not prefetched.
        assert ask(daemon.unix_target, {"prefill_profile": profile(tmp_path / "fast.json", disk_block_s / 1000)}) \
            == (3 * block, False)
        assert "loading 3 of 8 hit blocks, computing the rest" in caplog.text  # and it says so
        # The workers count the 5 left to vLLM once (vllm:kvd_declined_blocks_total).
        assert declined_blocks(daemon.unix_target, profile(tmp_path / "fast.json", disk_block_s / 1000)) == [5, 0]
        # A request may choose for itself (kv_transfer_params): every block, none, or the rule.
        fast = profile(tmp_path / "fast.json", disk_block_s / 1000)
        assert ask(daemon.unix_target, {"prefill_profile": fast}, {"kvd_load": "all"}) == (BLOCKS * block, False)
        assert ask(daemon.unix_target, {"prefill_profile": fast}, {"kvd_load": "none"}) == (0, False)
        assert ask(daemon.unix_target, {"prefill_profile": fast}, {"kvd_load": "rule"}) == (3 * block, False)
        assert ask(daemon.unix_target, {}, {"kvd_load": "none"}) == (0, False)
        caplog.clear()  # a choice kvd cannot follow is said and the default taken
        assert ask(daemon.unix_target, {}, {"kvd_load": "rule"}) == (BLOCKS * block, False)
        assert ask(daemon.unix_target, {"prefill_profile": fast}, {"kvd_load": "some"}) == (3 * block, False)
        assert "asks kvd_load='rule'; kvd takes 'all'" in caplog.text and "needs prefill_profile" in caplog.text
        assert "asks kvd_load='some'; kvd takes 'rule'" in caplog.text
        # Malformed parameters (vLLM's offline API passes them unchecked) are a choice kvd cannot follow.
        assert ask(daemon.unix_target, {"prefill_profile": fast}, ["kvd_load", "none"]) == (3 * block, False)
        assert ask(daemon.unix_target, {"prefill_profile": fast}, {"kvd_load": ["none"]}) == (3 * block, False)
        assert "asks kvd_load=['kvd_load', 'none']; kvd takes 'rule'" in caplog.text
        timeline = tmp_path / "timeline"
        ask(daemon.unix_target, {"prefill_profile": profile(tmp_path / "fast.json", disk_block_s / 1000),
                                 "timeline": str(timeline)})
        (what, blocks, began, ended), = json.loads((timeline / "scheduler.jsonl").read_text())["events"]
        assert (what, blocks) == ("lookup", 3) and 0 <= began <= ended  # the timeline records the choice
        assert daemon.metric_samples("kvd_prefetch_blocks_total").get('kvd_prefetch_blocks_total{result="queued"}',
                                                                      0) == 0
        # Far longer: load all 8, in the step (layer by layer: not prefetched); without a profile, the same.
        slow = profile(tmp_path / "slow.json", 1000 * disk_block_s)
        assert ask(daemon.unix_target, {"prefill_profile": slow}) == (BLOCKS * block, False)
        assert daemon.metric_samples("kvd_prefetch_blocks_total").get(
            'kvd_prefetch_blocks_total{result="queued"}', 0) == 0
        # Loaded in the background instead (the request waits): the disk ones are prefetched at once.
        assert ask(daemon.unix_target, {"prefill_profile": slow, "load": "async"}) == (BLOCKS * block, True)
        assert daemon.metric_samples("kvd_prefetch_blocks_total")['kvd_prefetch_blocks_total{result="queued"}'] == 5
        assert ask(daemon.unix_target, {})[0] == BLOCKS * block


LATENT = NamespaceSpec(model_id="load-rule-mla", num_layers=3, num_kv_heads=1, head_dim=512, block_tokens=16,
                       kv_dtype=DType.FLOAT16, kv_order=KvOrder.LATENT)


def test_tp_ranks_sharing_an_mla_namespace_are_looked_up_once_and_priced_once(tmp_path):
    """Under TP every rank caches the same MLA latent, so the workers hand over one namespace (tp 0 of
    1): the scheduler asks kvd once a request, prices the load once (the rule would otherwise see
    twice the bytes), and every worker reads the same keys."""
    with run_daemon(tmp_path / "kvd", config=config(tmp_path)) as daemon, Client(daemon.unix_target) as client:
        namespace = client.register_namespace(LATENT)
        keys = chain_keys(LATENT, PROMPT[:BLOCKS * LATENT.block_tokens])
        data = np.ones((BLOCKS, *LATENT.block_shape), dtype=np.float16)
        assert client.put(namespace, keys, data, durable=True) == BLOCKS
        looked = client.lookup(namespace, keys, load_times=True)
        lookups = lambda: sum(value for line, value in daemon.metric_samples("kvd_rpc_total").items()  # noqa: E731
                              if 'method="Lookup"' in line and 'code="OK"' in line)
        before = lookups()
        with scheduler_side(daemon.unix_target, {"prefill_profile": profile(tmp_path / "p.json", 1.0)}, LATENT,
                            shards=4) as side:
            assert side.matched_tokens(new_request(), 0) == (BLOCKS * LATENT.block_tokens, False)
            assert lookups() - before == 1
            assert all(shard_keys == keys for shard_keys in side.requests["r0"].keys)
            shards = side.requests["r0"].keys
            assert len(shards) == 4 and all(shard is shards[0] for shard in shards)  # hashed once, too
            assert side._lookup(side.requests["r0"], BLOCKS)[2][-1] <= 1.5 * looked.load_s[-1]  # not summed x4
