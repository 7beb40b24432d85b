"""Operating errors: the one exception hierarchy that crosses layers.

Three kinds of failure, three mechanisms:
  * an expected shortfall (a miss, no free slot) is a return value;
  * an operating error (bad client input, a foreign lease) is a KvdError,
    mapped to a gRPC status in exactly one place (kvd.server.convert);
  * a programmer error is an InvariantError from kvd.invariants.check and
    is never caught.
The `code` attribute names the gRPC status without importing grpc, so the
core stays free of the transport.
"""

from __future__ import annotations


class KvdError(Exception):
    """Base of operating errors. `code` is a grpc.StatusCode name."""

    code = "INTERNAL"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidArgument(KvdError):
    code = "INVALID_ARGUMENT"


class NotFound(KvdError):
    code = "NOT_FOUND"


class AlreadyExists(KvdError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(KvdError):
    code = "FAILED_PRECONDITION"


# The words of the FAILED_PRECONDITION a daemon outside a cluster answers an include_remote
# Lookup with; a client that asks "where there is a cluster" stops asking when it reads them.
NOT_IN_A_CLUSTER = "this kvd is not in a cluster"


class PermissionDenied(KvdError):
    code = "PERMISSION_DENIED"


class Unauthenticated(KvdError):
    """No credentials, or credentials kvd does not know (auth.mode = "token")."""

    code = "UNAUTHENTICATED"


class ResourceExhausted(KvdError):
    code = "RESOURCE_EXHAUSTED"


class PinCapExceeded(ResourceExhausted):
    """A client asked to pin more blocks than leases.max_pins_per_client
    allows it: only releasing its own leases makes room."""


class Unavailable(KvdError):
    code = "UNAVAILABLE"


class DeadlineExceeded(KvdError):
    """Something the call depends on outside kvd did not happen in time (an engine's flag word)."""

    code = "DEADLINE_EXCEEDED"


class StartupFailed(KvdError):
    """The daemon cannot start (a port taken, a directory it cannot create,
    ...): `kvd serve` says so in one line and exits 2, which a restart
    would not fix (systemd's RestartPreventExitStatus=2)."""

    code = "FAILED_PRECONDITION"


class PeerCallFailed(Exception):
    """A call to another kvd node failed: its status (the message names it), or its channel
    closed under it. Not a KvdError: no client ever sees it; a fetch it cuts short leaves misses."""


class ConfigError(Exception):
    """Invalid configuration; the message names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"config field {field!r}: {message}")
        self.field = field


class NotDurable(KvdError):
    """A call that asked for durability could not make every block durable.

    `durable`: how many of the leading blocks it asked for are durable;
    `requested`: how many it asked for. The gRPC status is the most precise
    reason (RESOURCE_EXHAUSTED, UNAVAILABLE, DEADLINE_EXCEEDED, ...); the
    counts travel in trailing metadata (kvd-durable-blocks,
    kvd-requested-blocks) so a client never has to parse the message.
    """

    DURABLE_KEY = "kvd-durable-blocks"
    REQUESTED_KEY = "kvd-requested-blocks"

    def __init__(self, code: str, message: str, durable: int, requested: int) -> None:
        super().__init__(message)
        self.code = code
        self.durable = durable
        self.requested = requested

    def trailers(self) -> tuple[tuple[str, str], ...]:
        return ((self.DURABLE_KEY, str(self.durable)), (self.REQUESTED_KEY, str(self.requested)))
