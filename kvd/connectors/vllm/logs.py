"""The connector's one logger, a child of vLLM's own ("vllm").

In a vLLM process every kvd line then goes where vLLM's go, as they go: with
vLLM's prefix (process name, level, time, file and line), at VLLM_LOGGING_LEVEL,
to VLLM_LOGGING_STREAM, or into the operator's configuration when
VLLM_CONFIGURE_LOGGING=0 or VLLM_LOGGING_CONFIG_PATH says so. Under a logger of
its own, the connector's INFO lines were dropped and its warnings printed bare
on stderr by Python's last-resort handler. No vLLM import: the worker's modules
also run (and log) in plain Python, in tests.
"""

from __future__ import annotations

import logging

LOGGER_NAME = "vllm.kvd"

log = logging.getLogger(LOGGER_NAME)
