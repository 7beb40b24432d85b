"""The vLLM connector's CUDA-graph capability, as vLLM 0.32 reads and applies it.

vLLM's default CUDA-graph mode is FULL_AND_PIECEWISE: uniform decode batches
replay one graph of the whole forward pass, which runs none of the Python
hooks the attention layers call. kvd loads and saves in those hooks, so the
connector must ask for PIECEWISE (`requires_piecewise_for_cudagraph`), or a
prefix hit with one prompt token left would attend to pages kvd never filled.

vLLM is only in the engine venv (.venv-vllm), so one probe runs there and
the tests read its answers:
- the class vLLM's own factory resolves from the kv_transfer_config answers
  True, whatever the connector's options;
- VllmConfig resolves FULL_AND_PIECEWISE without a connector and PIECEWISE
  with kvd's, on a platform with CUDA graphs. No GPU here: the CPU platform
  is told it supports them and keeps VLLM_COMPILE, as CUDA's does;
- on the CPU platform as it is, vLLM never asks: it supports no static
  graphs, so the mode is NONE before the connector is looked at, and
  without enforce_eager it compiles with torch.compile (DYNAMO_TRACE_ONCE,
  inductor) instead (tests/engines/test_vllm_connector.py runs it so).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.engines.conftest import ROOT

PROBE = r"""
import contextlib
import json
from unittest import mock

from vllm.config import CompilationConfig, KVTransferConfig, VllmConfig
from vllm.config.compilation import CompilationMode
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.platforms import current_platform

OPTIONS = [{}, {"transfer": "daemon"}, {"load": "layerwise"}, {"load": "async", "save": False}]


def transfer(extra):
    return KVTransferConfig(kv_connector="KvdConnector", kv_connector_module_path="kvd.connectors.vllm",
                            kv_role="kv_both", kv_connector_extra_config=extra)


connector = KVConnectorFactory.get_connector_class(transfer({}))
asked = []
declared = connector.requires_piecewise_for_cudagraph.__func__  # its own, or the base class's


def counted(cls, extra):
    asked.append(dict(extra))
    return declared(cls, extra)


connector.requires_piecewise_for_cudagraph = classmethod(counted)


def resolve(kv_transfer, graphs):
    # graphs: the platform says it supports static graphs and keeps VLLM_COMPILE, as CUDA's does.
    platform = type(current_platform)
    with contextlib.ExitStack() as patches:
        if graphs:
            patches.enter_context(mock.patch.object(platform, "support_static_graph_mode",
                                                    classmethod(lambda cls: True)))
            patches.enter_context(mock.patch.object(platform, "check_and_update_config",
                                                    classmethod(lambda cls, config: None)))
        asked.clear()
        config = VllmConfig(kv_transfer_config=kv_transfer,
                            compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE))
    compilation = config.compilation_config
    return {"mode": compilation.mode.name, "cudagraph_mode": compilation.cudagraph_mode.name, "asked": len(asked)}


print("PROBE", json.dumps({
    "class": f"{connector.__module__}.{connector.__qualname__}",
    "declared": [declared(connector, extra) for extra in OPTIONS],
    "graphs": {"alone": resolve(None, True), "kvd": resolve(transfer({}), True),
               "kvd_daemon": resolve(transfer({"transfer": "daemon"}), True)},
    "cpu": {"alone": resolve(None, False), "kvd": resolve(transfer({}), False)},
}))
"""


@pytest.fixture(scope="module")
def probe(engine_python: Path) -> dict:
    done = subprocess.run([str(engine_python), "-c", PROBE], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert done.returncode == 0 and len(lines) == 1, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(lines[0].removeprefix("PROBE "))


def test_the_connector_vllm_loads_asks_for_piecewise_graphs(probe):
    assert probe["class"] == "kvd.connectors.vllm.connector.KvdConnector"
    assert probe["declared"] == [True, True, True, True]  # True itself, for every option set


def test_vllm_downgrades_full_graphs_to_piecewise_for_the_connector(probe):
    graphs = probe["graphs"]
    assert graphs["alone"] == {"mode": "VLLM_COMPILE", "cudagraph_mode": "FULL_AND_PIECEWISE", "asked": 0}
    assert graphs["kvd"] == {"mode": "VLLM_COMPILE", "cudagraph_mode": "PIECEWISE", "asked": 1}
    assert graphs["kvd_daemon"] == graphs["kvd"]


def test_the_cpu_platform_has_no_graph_mode_to_downgrade(probe):
    expected = {"mode": "DYNAMO_TRACE_ONCE", "cudagraph_mode": "NONE", "asked": 0}
    assert probe["cpu"] == {"alone": expected, "kvd": expected}
