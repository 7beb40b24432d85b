"""kvd's vLLM KV connector.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvdConnector",
        "kv_connector_module_path": "kvd.connectors.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"target": "unix:///run/kvd/kvd.sock"}}'

Full prompt blocks are stored in kvd as vLLM computes them (one kvd block
per vLLM block) and loaded back on a later prefix hit, by any vLLM process
on the node with the same model and KV layout. Options: ConnectorConfig
(kvd.connectors.vllm.config). vLLM is imported when KvdConnector is first
used, so the rest of the package (the data path) loads without it.
"""

__all__ = ["KvdConnector"]


def __getattr__(name: str):
    if name == "KvdConnector":
        from kvd.connectors.vllm.connector import KvdConnector

        return KvdConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
