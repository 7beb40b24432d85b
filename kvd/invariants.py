"""Assertions that stay on in production (`assert` is stripped by -O)."""

from __future__ import annotations


class InvariantError(AssertionError):
    """A programmer error: kvd's own state is inconsistent. Never caught."""


def check(condition: bool, message: str = "invariant violated") -> None:
    if not condition:
        raise InvariantError(message)
