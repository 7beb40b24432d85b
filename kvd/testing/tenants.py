"""Tenants for tests of a daemon with auth.mode = "token": tokens, stubs, blocks, arena views.

    path = write_tenants_file(directory / "tenants.toml", {"a": {"token": "...", "namespaces": ["*"]}})
    config = {"auth": {"mode": "token", "tenants_file": str(path)}}
    stub = TenantStub(channel, token)          # every call carries the token
    blocks = tenant_blocks("a", keys)          # a's bytes for these keys, unlike any other tenant's
    view = ArenaView(daemon, token, info)      # the arena as that tenant's clients map it

Two tenants that register the same spec know their namespaces by the same
id and their blocks by the same keys; `tenant_blocks` gives each tenant
other bytes under those keys, so a block that reached the wrong tenant
shows.
"""

from __future__ import annotations

import functools
import hashlib
import json
import mmap
import os
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvd import arena_protocol
from kvd.core.keys import NamespaceSpec
from kvd.testing.daemon import DaemonProcess
from kvd.testing.put_stream import SPEC, blocks_for
from kvd.v1 import kvd_pb2, kvd_pb2_grpc


def bearer(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The call metadata that presents `token` (None: no metadata)."""
    return (("authorization", f"Bearer {token}"),) if token else None


def write_tenants_file(path: Path, tenants: dict[str, dict[str, Any]]) -> Path:
    """A tenants file: name -> {"token": ..., and the other keys of a [[tenants]] entry}.

    Each token is written as its SHA-256 (token_sha256), never itself."""
    lines = []
    for name, settings in tenants.items():
        lines += ["[[tenants]]", f"name = {json.dumps(name)}"]
        for key, value in settings.items():
            if key == "token":
                lines.append(f'token_sha256 = "{hashlib.sha256(value.encode()).hexdigest()}"')
            else:
                lines.append(f"{key} = {json.dumps(value)}")  # JSON strings, lists, numbers, booleans are TOML
        lines.append("")
    path.write_text("\n".join(lines))
    return path


class TenantStub:
    """A Kvd stub whose every call carries `token` (and `timeout_s`, unless the call gives its own)."""

    def __init__(self, channel: grpc.Channel, token: str, timeout_s: float = 30.0) -> None:
        self._stub = kvd_pb2_grpc.KvdStub(channel)
        self._metadata = bearer(token)
        self._timeout_s = timeout_s

    def __getattr__(self, method: str):
        return functools.partial(getattr(self._stub, method), metadata=self._metadata, timeout=self._timeout_s)


def tenant_blocks(tenant: str, keys: list[bytes], spec: NamespaceSpec = SPEC) -> np.ndarray:
    """Tenant `tenant`'s blocks for `keys`: put_stream.blocks_for of keys salted with its name."""
    salted = [hashlib.sha256(tenant.encode() + b"\x00" + key).digest() for key in keys]
    return blocks_for(salted, spec)


class ArenaView:
    """A tenant's read-only mapping of the host arena, the file its clients get (kvd.arena_protocol)."""

    def __init__(self, daemon: DaemonProcess, token: str, info: kvd_pb2.ArenaInfoResponse) -> None:
        fd, _ = arena_protocol.receive_arena(Path(daemon.arena_socket), token, info.instance_id)
        try:
            self._mmap = mmap.mmap(fd, info.arena_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.slots = np.frombuffer(self._mmap, dtype=np.uint8).reshape(info.slot_count, info.slot_bytes)

    def rows_holding(self, blocks: dict[bytes, bytes]) -> list[int]:
        """Slots that hold one of `blocks` (keyed by their first 64 bytes) at their start."""
        return [row for row in range(len(self.slots))
                if (block := blocks.get(self.slots[row, :64].tobytes())) is not None
                and self.slots[row, :len(block)].tobytes() == block]

    def close(self) -> None:
        self.slots = None
        self._mmap.close()


def by_prefix(blocks: np.ndarray) -> dict[bytes, bytes]:
    """Blocks (rows of `blocks`) keyed by their first 64 bytes, for ArenaView.rows_holding."""
    rows = blocks.reshape(len(blocks), -1).view(np.uint8)
    found = {row[:64].tobytes(): row.tobytes() for row in rows}
    assert len(found) == len(rows), "two blocks start alike"
    return found
