"""Directory keys: block keys masked by their namespace, handled packed.

Two tenants may use the same block keys in different namespaces, so the
directory never sees a bare block key: a *directory key* is the block key
XOR a 32-byte mask derived from the engine's namespace id (which includes
the tenant). XOR with a per-namespace constant keeps keys uniform (segment
cuts and rendezvous ids stay balanced), is computed for a whole chain in
one numpy operation, and is undone the same way. A client that forges keys
to collide with another namespace's directory entries only misleads the
directory, which is a hint: the holder checks namespace and tenant before
it serves a byte.

Everything here works on *packed* keys: 32 bytes each, back to back.
"""

from __future__ import annotations

import hashlib

import numpy as np

from kvd.core.keys import KEY_BYTES

_MASK_DOMAIN = b"kvd.cluster.directory-key.v1"


def namespace_mask(namespace_id: bytes) -> bytes:
    return hashlib.sha256(_MASK_DOMAIN + namespace_id).digest()


def _words(packed: bytes) -> np.ndarray:
    if len(packed) % KEY_BYTES:
        raise ValueError(f"packed keys must be a multiple of {KEY_BYTES} bytes, got {len(packed)}")
    return np.frombuffer(packed, dtype="<u8").reshape(-1, KEY_BYTES // 8)


def mask_keys(packed: bytes, mask: bytes) -> bytes:
    """Directory keys of packed block keys (and block keys of directory keys: XOR is its own inverse)."""
    return (_words(packed) ^ np.frombuffer(mask, dtype="<u8")).tobytes()


def split(packed: bytes) -> list[bytes]:
    return [packed[i:i + KEY_BYTES] for i in range(0, len(packed), KEY_BYTES)]


def anchor_words(packed: bytes) -> np.ndarray:
    """The u32 at bytes 8..12 of each key (what decides whether it starts a segment)."""
    return np.frombuffer(packed, dtype="<u4").reshape(-1, KEY_BYTES // 4)[:, 2]


def rendezvous_ids(packed: bytes) -> np.ndarray:
    """The first 8 bytes of each key as uint64 (its rendezvous id)."""
    return _words(packed)[:, 0].astype(np.uint64)
