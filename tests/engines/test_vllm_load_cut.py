"""A hit that falls behind its budget while it loads is cut, in a real vLLM: the answer stays exact.

With a prefill profile the connector's scheduler prices each hit at the
Lookup and gives the load a budget, the time computing its blocks would
take. Here the drive under kvd's disk tier slows down between the Lookup
(which priced prompt B's prefix as host hits) and the load, and the hit
blocks' host copies are dropped (vllm_hooks.py, "slow"): the blocks must
come from a drive reading 256 KiB a second, seconds for the first layer.
The load is cut at its budget and vLLM computes the prefix; B's answer must
equal vLLM alone's. With transfer = "daemon" kvd writes the pages itself,
so the cut also cancels kvd's copies before the pages go back to vLLM.
"""

from __future__ import annotations

import json

import pytest

from kvd.planner.prefill import FORMAT
from kvd.testing import tiny_llama
from kvd.testing.daemon import start_daemon
from kvd.testing.slow_drive import slowed_drive
from tests.engines.test_vllm_connector import (KVD_CONFIG, LOGPROB_TOLERANCE, PREFIX_TOKENS, BLOCK, VllmRun,
                                               prompts, same_answer)

pytestmark = pytest.mark.slow

SLOW_BPS = 256 << 10  # a layer of the 8 prefix blocks (1 MiB) takes 4 s


def profile(path) -> str:
    """vLLM prefills 1,024 tokens in about half a second, whatever the prefix (a made-up profile)."""
    new = [1, 128, 4096]
    path.write_text(json.dumps({"format": FORMAT, "model": "tiny-llama", "engine": "test", "new_tokens": new,
                                "prefixes": [0], "seconds": [[1e-3 + n * 5e-4] for n in new]}))
    return str(path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_llama.build(tmp_path_factory.mktemp("tiny-llama"))


@pytest.mark.parametrize("transfer", ["client", "daemon"])
def test_a_load_that_falls_behind_its_budget_is_cut_and_the_answer_is_exact(engine_python, model, tmp_path,
                                                                          transfer):
    reference = VllmRun(engine_python, model, tmp_path / "alone", [prompts()["B"]])  # runs beside the other
    with slowed_drive(tmp_path / "nvme0", size_bytes=512 << 20) as drive:
        config = dict(KVD_CONFIG, disk=dict(KVD_CONFIG["disk"], directories=[str(drive.directory)],
                                            capacity_bytes="256MiB"))
        daemon = start_daemon(tmp_path / "kvd", config)
        try:
            drive.admit(daemon.pid)
            slow = f"{drive.group}|{drive.numbers}|{SLOW_BPS}"
            served = VllmRun(engine_python, model, tmp_path / "kvd", [prompts()["A"], prompts()["B"]],
                             target=daemon.unix_target, transfer=transfer, hooks=",slow",
                             env={"KVD_TEST_SLOW_DRIVE": slow}, prefill_profile=profile(tmp_path / "profile.json"))
            report = served.report()
            drive.throttle()  # the cut load's reads into kvd's own slots now finish at once
        finally:
            assert daemon.stop() == 0, daemon.log()[-3000:]
    _, cut = report["results"]
    assert cut["fired"] == ["slow"]
    assert same_answer(cut, reference.report()["results"][0]) <= LOGPROB_TOLERANCE
    totals = report["connector"]["totals"]
    shared = PREFIX_TOKENS // BLOCK
    assert totals["cut_loads"] == 1 and totals["loaded_blocks"] == 0 and totals["load_errors"] == shared


def test_hit_blocks_the_rule_leaves_to_vllm_are_counted_and_the_answer_is_exact(engine_python, model, tmp_path):
    """A profile in which copying a host hit into vLLM costs far more than computing it: the rule
    loads none of B's 8 hit blocks, vLLM computes them, and the workers count them as declined
    (vllm:kvd_declined_blocks_total)."""
    reference = VllmRun(engine_python, model, tmp_path / "alone", [prompts()["B"]])  # runs beside the other
    costly = tmp_path / "costly.json"
    new = [1, 128, 4096]
    costly.write_text(json.dumps({"format": FORMAT, "model": "tiny-llama", "engine": "test", "new_tokens": new,
                                  "prefixes": [0], "seconds": [[1e-4 + n * 1e-6] for n in new],
                                  "host_load_s_per_token": 1e-2}))
    daemon = start_daemon(tmp_path / "kvd", dict(KVD_CONFIG, disk=dict(KVD_CONFIG["disk"],
                                                                         directories=[str(tmp_path / "nvme0")])))
    try:
        report = VllmRun(engine_python, model, tmp_path / "kvd", [prompts()["A"], prompts()["B"]],
                         target=daemon.unix_target, reset=True, prefill_profile=str(costly)).report()
    finally:
        assert daemon.stop() == 0, daemon.log()[-3000:]
    _, declined = report["results"]
    assert same_answer(declined, reference.report()["results"][0]) <= LOGPROB_TOLERANCE
    assert declined["cached_tokens"] == 0
    totals = report["connector"]["totals"]
    assert totals["declined_blocks"] == PREFIX_TOKENS // BLOCK and totals["loaded_blocks"] == 0
