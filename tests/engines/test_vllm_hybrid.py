"""A hybrid-attention model (interleaved sliding-window and full attention) through kvd, in a real vLLM.

The model is a tiny Gemma-3 (kvd.testing.tiny_gemma3): three local layers
with a 256-token window and one global layer, seeded random weights. The
prompts share a 1,100-token prefix, longer than the window, so the local
layers attend to part of it only. One vLLM serves prompt A, storing the
prefix through kvd, then (its own prefix cache reset) prompt B, which must
load the prefix from kvd and answer exactly as vLLM alone.

The connector declares vLLM's SupportsHMA, so vLLM keeps its hybrid KV
cache manager on: a block table per KV cache group (here four: one global,
three windowed), the windowed groups' blocks dropped once the window has
left them. kvd stores each position as one block of every layer and loads
a windowed layer only where its group still has a block; the worker's log
line names the groups, so the test fails if vLLM stops treating the model
as hybrid.

A model with state-space layers (LFM2's short convolutions) keeps per-request
state, not blocks, and vLLM's CPU MLA backend cannot compute a prompt after
a cached prefix (vLLM turns its own prefix caching off for MLA on the CPU):
with kvd configured vLLM must still start and serve both, the connector
saying on the worker why it stays out.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from kvd.testing import tiny_gemma3, tiny_hybrids, tiny_llama
from tests.engines.test_vllm_connector import BLOCK, LOGPROB_TOLERANCE, Kvd, VllmRun, same_answer

pytestmark = pytest.mark.slow

PREFIX_TOKENS = 1100  # 8 full blocks shared by A and B, past the 256-token window
GROUPED = "kvd connector: 4 layers in 4 KV cache groups (3 windowed)"


def prompts() -> dict[str, list[int]]:
    rng = np.random.default_rng(23)
    prefix = rng.integers(4, tiny_llama.VOCAB, PREFIX_TOKENS).tolist()
    return {"A": prefix + rng.integers(4, tiny_llama.VOCAB, 60).tolist(),
            "B": prefix + rng.integers(4, tiny_llama.VOCAB, 70).tolist()}


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return tiny_gemma3.build(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture
def daemon(tmp_path):
    kvd = Kvd(tmp_path / "kvd")
    yield kvd
    kvd.stop()


def test_a_sliding_window_model_loads_its_prefix_from_kvd_and_answers_exactly(engine_python, gemma3, daemon, tmp_path):
    assert tiny_gemma3.WINDOW < PREFIX_TOKENS and "sliding_attention" in tiny_gemma3.layer_types()
    reference = VllmRun(engine_python, gemma3, tmp_path / "alone", [prompts()["B"]])  # runs beside the other
    served = VllmRun(engine_python, gemma3, tmp_path / "kvd", [prompts()["A"], prompts()["B"]], target=daemon.target,
                     reset=True).report()
    log = (tmp_path / "kvd" / "vllm.log").read_text(errors="replace")
    assert GROUPED in log and "Turning off hybrid kv cache manager" not in log

    result, totals = served["results"][1], served["connector"]["totals"]
    assert same_answer(result, reference.report()["results"][0]) <= LOGPROB_TOLERANCE
    shared = PREFIX_TOKENS // BLOCK
    assert result["cached_tokens"] == shared * BLOCK  # vLLM did not compute the prefix: kvd loaded it
    assert totals["loaded_blocks"] == shared and totals["load_errors"] == 0
    # A's full blocks, then B's one new block.
    assert totals["saved_blocks"] == len(prompts()["A"]) // BLOCK + len(prompts()["B"]) // BLOCK - shared


STAYS_OUT = {
    "lfm2": r"KV cache group \d holds \w+ layers .*per request",
    "mla": r"vLLM's CPU MLA backend cannot compute a prompt after a cached prefix",
}


@pytest.mark.parametrize("family", sorted(STAYS_OUT))
def test_a_model_kvd_cannot_serve_here_still_serves_with_kvd_configured(engine_python, daemon, tmp_path, family):
    model = tiny_hybrids.build(family, tmp_path / family)
    served = VllmRun(engine_python, model, tmp_path / "kvd", [prompts()["A"]], target=daemon.target).report()
    assert len(served["results"][0]["tokens"]) == 8 and served["connector"] == {"enabled": False}
    log = (tmp_path / "kvd" / "vllm.log").read_text(errors="replace")
    assert re.search(r"kvd connector disabled on this worker: " + STAYS_OUT[family], log)
