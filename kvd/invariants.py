"""Assertions that stay on in production (`assert` is stripped by -O)."""

from __future__ import annotations


class InvariantError(AssertionError):
    """A programmer error: kvd's own state is inconsistent. Never caught."""


def check(condition: bool, message: str = "invariant violated", *arguments: object) -> None:
    """Raise InvariantError(message) unless `condition`.

    With `arguments`, the message is a str.format template filled in only
    when the check fails: `check(ok, "{!r} lost its slot {}", block, slot)`.
    verify() methods run after every step of the simulator and every test,
    over every block; an f-string there would build millions of messages
    that are never shown.
    """
    if not condition:
        raise InvariantError(message.format(*arguments) if arguments else message)
