"""Run in vLLM's venv by test_vllm_load_rule.py: the connector's scheduler side (SchedulerSide, as
vLLM builds it) asked about one request against a real daemon, once per connector configuration.

    python tests/engines/load_rule_probe.py TARGET CONFIGS_JSON   ->  {name: [tokens, asynchronous]}
"""

from __future__ import annotations

import json
import logging
import sys
from types import SimpleNamespace

import numpy as np

from kvd.core.keys import DType, NamespaceSpec

SPEC = NamespaceSpec(model_id="load-rule-model", num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16,
                     kv_dtype=DType.FLOAT32)
BLOCKS = 8
PROMPT = np.arange(BLOCKS * SPEC.block_tokens + 5) + 1000  # 8 full blocks and a partial one


def request() -> SimpleNamespace:
    return SimpleNamespace(request_id="r0", prompt_token_ids=PROMPT.tolist(), lora_request=None,
                           cache_salt=None, mm_features=None)


def main() -> None:
    logging.basicConfig(level=logging.INFO)  # the connector's INFO lines, as vLLM's logging prints them
    from kvd.connectors.vllm.config import ConnectorConfig
    from kvd.connectors.vllm.metadata import KvdHandshake
    from kvd.connectors.vllm.scheduler import SchedulerSide

    target, configs = sys.argv[1], json.loads(sys.argv[2])
    answers = {}
    for name, extra in configs.items():
        side = SchedulerSide(ConnectorConfig.from_extra({"target": target, **extra}), SPEC.block_tokens)
        side.set_shards({(0, 0): KvdHandshake(spec=SPEC)})
        answers[name] = list(side.matched_tokens(request(), 0))
        side.close()
    print(json.dumps(answers))


if __name__ == "__main__":
    main()
