"""A vLLM request's kvd block keys: its prompt tokens and what else shaped its KV.

Two requests may share a block only if the block's KV is the same, so the
key of a block digests, besides its tokens and its whole prefix (the
chain), every other input that vLLM's own prefix cache counts: the LoRA
adapter (name and path, on every block), the request's cache_salt (on the
first block, hence on every key after it) and the multimodal inputs that
overlap the block (their content hash and where they start in it).
Requests given as prompt embeddings are not cached: their tokens do not
say what the KV is.
"""

from __future__ import annotations

import struct
from typing import Any

from kvd.core.keys import ExtraKey, NamespaceSpec, chain_keys


def request_extras(request: Any, block_tokens: int, blocks: int) -> list[list[ExtraKey]] | None:
    """The extra key inputs of each of the request's first `blocks` blocks (None: none at all)."""
    lora = request.lora_request
    salt = request.cache_salt
    features = [feature for feature in (request.mm_features or []) if feature.identifier]
    if not lora and not salt and not features:
        return None
    extras: list[list[ExtraKey]] = [[] for _ in range(blocks)]
    if lora:
        adapter = ExtraKey("lora", f"{lora.lora_name}\0{lora.lora_path or ''}".encode())
        for block in extras:
            block.append(adapter)
    if salt and blocks:
        extras[0].append(ExtraKey("cache_salt", salt.encode()))
    for feature in features:
        _add_multimodal(extras, feature, block_tokens)
    return extras


def _add_multimodal(extras: list[list[ExtraKey]], feature: Any, block_tokens: int) -> None:
    """Mark every block the feature's placeholder tokens overlap."""
    start = feature.mm_position.offset
    stop = start + feature.mm_position.length
    first, last = start // block_tokens, (stop - 1) // block_tokens
    for index in range(first, min(last + 1, len(extras))):
        where = max(start - index * block_tokens, 0)
        value = feature.identifier.encode() + struct.pack("<I", where)
        extras[index].append(ExtraKey("mm", value))


def prompt_keys(spec: NamespaceSpec, request: Any) -> list[bytes]:
    """Chained keys of the full blocks of the request's prompt, in `spec`'s namespace."""
    tokens = request.prompt_token_ids
    if tokens is None:
        return []
    blocks = len(tokens) // spec.block_tokens
    return chain_keys(spec, tokens, request_extras(request, spec.block_tokens, blocks))
