"""The engine's limits on what one request, one client and the whole daemon may hold."""

from __future__ import annotations

from dataclasses import dataclass

# The longest client id: a client's own id has at most 128 characters; the
# server puts its tenant's name (64 at most) and a separator in front, and
# an inline Get's private prefix in front of that (kvd.server.auth).
MAX_CLIENT_ID_CHARS = 256


@dataclass(frozen=True, slots=True)
class EngineLimits:
    max_batch_keys: int = 65536
    lease_ms_default: int = 30_000
    lease_ms_max: int = 600_000
    max_leases: int = 65536
    max_namespaces: int = 1024
    # Blocks one client may pin through its open leases at once.
    max_pins_per_client: int = 65536
