"""Errors the client library raises itself (the daemon's arrive as grpc.RpcError)."""

from __future__ import annotations

import grpc

from kvd.errors import NotDurable


class NotDurableError(grpc.RpcError):
    """put(durable=True) could not make every block durable.

    A grpc.RpcError, so code that catches those catches this too, with
    code() and details() as usual, plus what a caller needs to go on:
    `durable`, how many leading keys of the put are durable on disk, and
    `requested`, how many keys it was given. keys[durable:] are not
    durable (some may be stored in host memory only, or not at all).
    """

    def __init__(self, code: grpc.StatusCode, details: str, durable: int, requested: int) -> None:
        super().__init__(details)
        self._code = code
        self._details = details
        self.durable = durable
        self.requested = requested

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def __str__(self) -> str:
        return f"{self._code.name}: {self._details}"

    def shifted(self, offset: int, requested: int) -> NotDurableError:
        """This error of a call that started at keys[offset] of a put of `requested` keys, as the put's."""
        if offset == 0 and requested == self.requested:
            return self
        durable = offset + self.durable
        details = f"keys[{durable}:{requested}] of this put are not durable (the first {durable} are): {self._details}"
        return NotDurableError(self._code, details, durable, requested)

    @classmethod
    def from_rpc(cls, error: grpc.RpcError, durable: int, requested: int) -> NotDurableError:
        """The daemon refused a call of a durable put whose keys[:durable]
        were durable before it: add what the call itself made durable (its
        trailing metadata says, when it could make some)."""
        made = 0
        trailers = error.trailing_metadata() if hasattr(error, "trailing_metadata") else None
        for key, value in trailers or ():
            if key == NotDurable.DURABLE_KEY and value.isdigit():
                made = int(value)
        details = error.details() if hasattr(error, "details") else str(error)
        code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
        return cls(code, details or "", durable + made, requested)
