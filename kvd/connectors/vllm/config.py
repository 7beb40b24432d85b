"""The connector's options: vLLM's kv_connector_extra_config, checked once."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from kvd.connectors.vllm.placement import PlacementOptions
from kvd.planner.prefill import PrefillProfile

DEFAULT_TARGET = "unix:///run/kvd/kvd.sock"
LOAD_MODES = ("auto", "async", "layerwise")
TRANSFERS = ("client", "daemon")


MAX_FLAG_WORDS = 1 << 20


@dataclass(frozen=True, slots=True)
class ConnectorConfig:
    """kv_connector_extra_config keys (all optional).

    target: the kvd daemon (default $KVD_TARGET, else unix:///run/kvd/kvd.sock);
      it must be on the same node: blocks move through its shared memory.
    token: a tenant's token for a daemon with auth.mode = "token" (default $KVD_TOKEN).
    namespace: the model name blocks are filed under (default: vLLM's model
      path or name). Engines that should share blocks must agree on it.
    load: how a prefix that must come from disk is loaded (a host-memory hit
      always streams into the step that computes the rest of the prompt,
      layer by layer). "async": in the background while the scheduler runs
      other requests (the request waits); "layerwise": like a host hit, each
      layer waiting for its own bytes while earlier layers compute; "auto"
      (default): async while the engine has other requests (running or
      queued), layerwise when it has none (then there is nothing to overlap
      the read with but the request's own layers).
    save: store the full blocks of prompts (default true).
    transfer: who copies between the engine's KV cache and kvd. "client"
      (default): the connector, through kvd's shared-memory arena; "daemon":
      kvd itself, on its device plane ([device] kind = "cpu" or "cuda"),
      with the KV tensors registered as a pool (kvd.connectors.vllm.
      device_worker; on a CPU host the daemon must be reachable over its
      unix socket).
    timeout_s: deadline of each call to kvd; load_timeout_s: how long a layer
      may wait for its bytes before its blocks are reported failed.
    placement: with transfer = "daemon", a table {budget_bytes, layer_s,
      bandwidth_bps, per_token_s}: each step's saves are planned by kvd's
      PlanPlacement within budget_bytes of device memory, and kvd's device
      tier keeps only the layers the plan keeps on the GPU
      (kvd.connectors.vllm.placement). Default: none, every layer.
    prefill_profile: a prefill profile of the served model and engine
      (kvd-prefill-profile/1 JSON, written by `make prefill-profile`): each
      hit is then priced as things stand (kvd's disk queue and read rate,
      its remote fetch rate, the copy into the engine) and only its leading
      blocks that load sooner than vLLM computes them are loaded; vLLM
      computes the rest (kvd.planner.prefill). Default: none, every hit is
      loaded.
    flag_words: with transfer = "daemon", the 64-bit flag words the pool
      registers (32 KiB for the default 4,096): two for saves, two for each
      load in flight (its flag and its cancel word), so up to
      (flag_words - 2) / 2 requests load at once; a load past that is
      recomputed, with a warning.
    timeline: a directory: with transfer = "client", each worker appends a
      per-layer timeline of every step that loaded or saved to
      worker<rank>.jsonl there, and the scheduler side its Lookups to
      scheduler.jsonl (kvd.connectors.vllm.timeline; drawn by
      bench/plot_timeline.py). Default: none.
    """

    target: str = DEFAULT_TARGET
    token: str | None = None
    namespace: str = ""
    load: str = "auto"
    save: bool = True
    transfer: str = "client"
    timeout_s: float = 10.0
    load_timeout_s: float = 30.0
    placement: PlacementOptions | None = None
    flag_words: int = 4096
    io_ring: bool = False
    prefill_profile: str | None = None
    timeline: str | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> ConnectorConfig:
        known = {item.name for item in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ValueError(f"kvd connector: unknown kv_connector_extra_config keys {unknown}; known: {sorted(known)}")
        values = dict(extra)
        values.setdefault("target", os.environ.get("KVD_TARGET", DEFAULT_TARGET))
        values.setdefault("token", os.environ.get("KVD_TOKEN"))
        if values.get("placement") is not None:
            values["placement"] = PlacementOptions.from_extra(values["placement"])
        config = cls(**values)
        if config.load not in LOAD_MODES:
            raise ValueError(f"kvd connector: load must be one of {LOAD_MODES}, got {config.load!r}")
        if config.transfer not in TRANSFERS:
            raise ValueError(f"kvd connector: transfer must be one of {TRANSFERS}, got {config.transfer!r}")
        for name in ("timeout_s", "load_timeout_s"):
            value = getattr(config, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"kvd connector: {name} must be a positive number, got {value!r}")
        if not isinstance(config.flag_words, int) or isinstance(config.flag_words, bool) or \
                not 4 <= config.flag_words <= MAX_FLAG_WORDS:
            raise ValueError(f"kvd connector: flag_words must be an integer in [4, {MAX_FLAG_WORDS}], "
                             f"got {config.flag_words!r}")
        for name in ("save", "io_ring"):
            if not isinstance(getattr(config, name), bool):
                raise ValueError(f"kvd connector: {name} must be true or false, got {getattr(config, name)!r}")
        for name in ("target", "namespace"):
            if not isinstance(getattr(config, name), str):
                raise ValueError(f"kvd connector: {name} must be a string, got {getattr(config, name)!r}")
        _check_profile(config)
        _check_timeline(config)
        _check_daemon_options(config)
        return config


def _check_profile(config: ConnectorConfig) -> None:
    """A prefill profile is read at start-up: a bad one is refused there, saying what is wrong."""
    if config.prefill_profile is None:
        return
    if not isinstance(config.prefill_profile, str):
        raise ValueError(f"kvd connector: prefill_profile must be a path, got {config.prefill_profile!r}")
    PrefillProfile.load(config.prefill_profile)


def _check_timeline(config: ConnectorConfig) -> None:
    if config.timeline is None:
        return
    if not isinstance(config.timeline, str):
        raise ValueError(f"kvd connector: timeline must be a directory path, got {config.timeline!r}")
    if config.transfer == "daemon":
        raise ValueError("kvd connector: timeline records the connector's own copies: it needs transfer = \"client\"")


def _check_daemon_options(config: ConnectorConfig) -> None:
    """Options of kvd's device plane make sense only where kvd moves the bytes itself."""
    if config.transfer == "daemon":
        return
    if config.placement is not None:
        raise ValueError("kvd connector: placement plans kvd's device tier: it needs transfer = \"daemon\"")
    if config.io_ring:
        raise ValueError("kvd connector: io_ring reads into the pool kvd registered: it needs transfer = \"daemon\"")
