"""Chains of keys spelled as text, for tests: one token per character."""

from __future__ import annotations

from kvd.core.keys import NamespaceSpec, chain_keys


def text_chain(spec: NamespaceSpec, chain: str) -> list[bytes]:
    """The keys of `chain` in `spec`'s namespace, each character a token ("abc": three blocks of one token)."""
    return chain_keys(spec, [ord(char) for char in chain])
