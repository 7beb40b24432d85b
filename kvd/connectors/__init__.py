"""Engine connectors: how inference engines store and load their KV through kvd.

- kvd.connectors.vllm: a vLLM KV connector (KVConnectorBase_V1), loaded by
  module path with --kv-transfer-config.
- kvd.connectors.sglang: a HiCache storage backend for SGLang, loaded with
  --hicache-storage-backend dynamic.

Neither module is imported by the daemon; each imports its engine lazily.
"""
