"""Namespace identity and chained block keys (kvd.core.keys).

Two things matter about keys: equal inputs give equal keys in every process
forever (so the encoding is pinned by a known-answer test and re-derived
here from the module docstring), and different inputs never give equal keys
through an encoding ambiguity (fields are tagged and length-prefixed).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import pytest

from kvd.core import keys as keys_module
from kvd.core.keys import (
    KEY_BYTES,
    MAX_BLOCK_TOKENS,
    MAX_HEAD_DIM,
    MAX_KV_HEADS,
    MAX_LAYERS,
    MAX_PARALLEL,
    MAX_SALT_BYTES,
    MAX_STRING_BYTES,
    DType,
    ExtraKey,
    InnerLayout,
    KvOrder,
    NamespaceSpec,
    block_key,
    chain_keys,
)
from kvd.errors import InvalidArgument

BASE = {"model_id": "test-model", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4, "block_tokens": 4}


def spec(**overrides) -> NamespaceSpec:
    return NamespaceSpec(**{**BASE, **overrides})


TOKENS = list(range(100, 116))  # four full blocks of four tokens


# ----------------------------------------------------------------------
# Determinism and size


def test_keys_are_32_bytes_and_deterministic():
    first = chain_keys(spec(), TOKENS)
    second = chain_keys(spec(), list(TOKENS))
    assert first == second
    assert len(first) == 4
    assert all(isinstance(key, bytes) and len(key) == KEY_BYTES for key in first)
    assert len(set(first)) == 4
    assert len(spec().namespace_id()) == KEY_BYTES
    assert len(spec().root_key()) == KEY_BYTES
    assert spec().namespace_id() == spec().namespace_id()
    assert spec().namespace_id() != spec().root_key()


def test_token_container_does_not_matter():
    expected = chain_keys(spec(), TOKENS)
    assert chain_keys(spec(), tuple(TOKENS)) == expected
    assert chain_keys(spec(), iter(TOKENS)) == expected
    for dtype in ("<u4", ">u4", "<i8", ">i8", "u2", "i4", "u8"):
        assert chain_keys(spec(), np.array(TOKENS, dtype=dtype)) == expected, dtype
    # A non-contiguous view hashes its values, not its memory.
    strided = np.array([t for token in TOKENS for t in (token, 0)], dtype=np.int64)[::2]
    assert not strided.flags.c_contiguous
    assert chain_keys(spec(), strided) == expected


def test_same_tokens_different_block_split_differ():
    assert chain_keys(spec(block_tokens=4), TOKENS)[1] != chain_keys(spec(block_tokens=8), TOKENS)[0]


# ----------------------------------------------------------------------
# Every identity field matters

FIELD_CHANGES = {
    "model_id": "other-model",
    "num_layers": 3,
    "num_kv_heads": 1,
    "head_dim": 8,
    "block_tokens": 2,
    "kv_dtype": DType.FLOAT16,
    "model_revision": "rev2",
    "inner_layout": InnerLayout.HEAD_TOKEN_DIM,
    "kv_order": KvOrder.V_THEN_K,
    "tp_rank": 1,
    "tp_size": 2,
    "pp_stage": 1,
    "pp_size": 2,
    "lora_id": "adapter",
    "tenant_salt": b"tenant",
    "tenant": "team-a",
}


def test_every_field_is_covered():
    # hash_scheme has one supported value, so it cannot be changed; every
    # other field must be listed, or a new field could be silently unhashed.
    names = {f.name for f in dataclasses.fields(NamespaceSpec)}
    assert names - set(FIELD_CHANGES) == {"hash_scheme"}


@pytest.mark.parametrize("name", sorted(FIELD_CHANGES))
def test_every_field_changes_namespace_id_root_and_keys(name):
    base = spec(tp_size=2, pp_size=2)  # so that tp_rank / pp_stage can be 1
    changed_value = FIELD_CHANGES[name]
    if name in ("tp_size", "pp_size"):
        base, changed = spec(), spec(**{name: changed_value})
    else:
        changed = dataclasses.replace(base, **{name: changed_value})
    assert getattr(changed, name) != getattr(base, name)
    assert changed.namespace_id() != base.namespace_id()
    assert changed.root_key() != base.root_key()
    # Enough tokens for at least one full block under either block size.
    tokens = list(range(changed.block_tokens * base.block_tokens))
    assert chain_keys(changed, tokens)[0] != chain_keys(base, tokens)[0]


@pytest.mark.parametrize(
    "left, right",
    [
        ({"lora_id": "a", "tenant_salt": b"b"}, {"lora_id": "ab", "tenant_salt": b""}),
        ({"lora_id": "a", "tenant_salt": b"b"}, {"lora_id": "", "tenant_salt": b"ab"}),
        ({"lora_id": "ab", "tenant_salt": b""}, {"lora_id": "", "tenant_salt": b"ab"}),
        ({"model_id": "ab", "model_revision": "c"}, {"model_id": "a", "model_revision": "bc"}),
        ({"model_id": "abc", "model_revision": ""}, {"model_id": "ab", "model_revision": "c"}),
        ({"lora_id": "x", "model_revision": ""}, {"lora_id": "", "model_revision": "x"}),
        ({"model_revision": "x", "lora_id": ""}, {"model_revision": "", "lora_id": "x"}),
    ],
)
def test_adjacent_fields_cannot_be_confused(left, right):
    a, b = spec(**left), spec(**right)
    assert a.namespace_id() != b.namespace_id()
    assert a.root_key() != b.root_key()
    assert chain_keys(a, TOKENS) != chain_keys(b, TOKENS)


def test_numeric_fields_are_not_confused_by_position():
    # Same multiset of values in different fields.
    a = spec(num_layers=2, num_kv_heads=4, head_dim=8)
    b = spec(num_layers=4, num_kv_heads=2, head_dim=8)
    c = spec(num_layers=8, num_kv_heads=4, head_dim=2)
    assert len({a.namespace_id(), b.namespace_id(), c.namespace_id()}) == 3


# ----------------------------------------------------------------------
# Extra keys

ROOT = spec().root_key()
RAW = np.arange(4, dtype="<u4").tobytes()


@pytest.mark.parametrize(
    "left, right",
    [
        ([ExtraKey("a", b"bc")], [ExtraKey("ab", b"c")]),
        ([ExtraKey("mm", b"")], [ExtraKey("m", b"m")]),
        ([ExtraKey("a"), ExtraKey("b")], [ExtraKey("ab")]),
        ([ExtraKey("a", b"x"), ExtraKey("b", b"")], [ExtraKey("a", b""), ExtraKey("b", b"x")]),
        ([ExtraKey("a", b"1"), ExtraKey("b", b"2")], [ExtraKey("b", b"2"), ExtraKey("a", b"1")]),
        ([ExtraKey("mm", b"\x00")], [ExtraKey("mm", b"")]),
        ([ExtraKey("mm", b"")], []),
    ],
)
def test_extra_keys_cannot_be_confused(left, right):
    assert block_key(ROOT, RAW, left) != block_key(ROOT, RAW, right)


def test_extras_do_not_collide_with_tokens():
    # Moving bytes between the token field and an extra value changes the key.
    shorter = np.arange(3, dtype="<u4").tobytes()
    assert block_key(ROOT, RAW, ()) != block_key(ROOT, shorter, [ExtraKey("t", RAW[-4:])])


def test_extras_change_their_block_and_every_later_key_only():
    plain = chain_keys(spec(), TOKENS)
    for block in range(4):
        extras = [[] for _ in range(4)]
        extras[block] = [ExtraKey("mm", b"image-hash")]
        with_extra = chain_keys(spec(), TOKENS, extras)
        assert with_extra[:block] == plain[:block]
        assert all(with_extra[i] != plain[i] for i in range(block, 4))


def test_empty_extras_equal_no_extras():
    assert chain_keys(spec(), TOKENS, [[], [], [], []]) == chain_keys(spec(), TOKENS)


def test_extras_beyond_the_full_blocks_are_ignored():
    # Documents current behaviour: an entry for the trailing partial block
    # (or past it) is accepted and does not affect any key.
    tokens = TOKENS[:10]  # two full blocks, one partial
    assert chain_keys(spec(), tokens, [[], [], [ExtraKey("mm", b"x")]]) == chain_keys(spec(), tokens)


# ----------------------------------------------------------------------
# Partial blocks and chain continuation


def test_trailing_partial_block_gets_no_key():
    full = chain_keys(spec(), TOKENS)
    for extra in range(1, 4):
        assert chain_keys(spec(), TOKENS + list(range(extra))) == full
    assert chain_keys(spec(), TOKENS[:3]) == []
    assert chain_keys(spec(), []) == []
    assert chain_keys(spec(), np.array([], dtype=np.int64)) == []


def test_continuation_with_parent_equals_full_chain():
    full = chain_keys(spec(), TOKENS)
    for split in range(1, 4):
        tail = chain_keys(spec(), TOKENS[split * 4 :], parent=full[split - 1])
        assert tail == full[split:]
    assert chain_keys(spec(), TOKENS, parent=spec().root_key()) == full


def test_continuation_with_extras():
    extras = [[ExtraKey("mm", b"a")], [], [ExtraKey("mm", b"b")], []]
    full = chain_keys(spec(), TOKENS, extras)
    assert chain_keys(spec(), TOKENS[8:], extras[2:], parent=full[1]) == full[2:]


def test_chain_is_block_key_applied_in_sequence():
    keys = chain_keys(spec(), TOKENS)
    parent = spec().root_key()
    for index, key in enumerate(keys):
        raw = np.array(TOKENS[index * 4 : (index + 1) * 4], dtype="<u4").tobytes()
        parent = block_key(parent, raw)
        assert key == parent


# ----------------------------------------------------------------------
# Tokens are u32


def test_largest_u32_token_is_accepted_and_distinct():
    top = chain_keys(spec(), [2**32 - 1, 0, 0, 0])
    assert len(top) == 1
    assert top != chain_keys(spec(), [2**32 - 2, 0, 0, 0])
    assert top == chain_keys(spec(), np.array([2**32 - 1, 0, 0, 0], dtype=np.uint32))


@pytest.mark.parametrize(
    "tokens",
    [
        [-1, 0, 0, 0],
        [2**32, 0, 0, 0],
        [2**63, 0, 0, 0],
        [2**64, 0, 0, 0],
        [-(2**63), 0, 0, 0],
        np.array([-1, 0, 0, 0], dtype=np.int8),
        np.array([2**32, 0, 0, 0], dtype=np.uint64),
        [1.0, 2.0, 3.0, 4.0],
        [True, False, True, False],
        ["1", "2", "3", "4"],
        [[1, 2], [3, 4]],
        [1, None, 2, 3],
    ],
    ids=lambda value: repr(value)[:40],
)
def test_out_of_range_or_non_integer_tokens_are_rejected(tokens):
    # A cast to u32 would wrap -1 onto 2**32-1 (and 2**32 onto 0): two
    # different prompts with one key. Rejected instead.
    with pytest.raises(InvalidArgument, match="token_ids"):
        chain_keys(spec(), tokens)


def test_negative_token_does_not_alias_its_u32_wrap():
    with pytest.raises(InvalidArgument):
        chain_keys(spec(), [-1, 0, 0, 0])
    assert chain_keys(spec(), [2**32 - 1, 0, 0, 0])  # the wrap target is fine on its own


def test_range_is_checked_even_in_the_partial_block():
    with pytest.raises(InvalidArgument, match="token_ids"):
        chain_keys(spec(), [0, 0, 0, 0, -5])


# ----------------------------------------------------------------------
# Validation names the field

INVALID_FIELDS = [
    ("model_id", {"model_id": ""}),
    ("model_id", {"model_id": b"bytes"}),
    ("model_id", {"model_id": "x" * (MAX_STRING_BYTES + 1)}),
    ("model_id", {"model_id": "é" * (MAX_STRING_BYTES // 2 + 1)}),  # limit is in UTF-8 bytes
    ("model_revision", {"model_revision": "r" * (MAX_STRING_BYTES + 1)}),
    ("model_revision", {"model_revision": 3}),
    ("lora_id", {"lora_id": "l" * (MAX_STRING_BYTES + 1)}),
    ("lora_id", {"lora_id": None}),
    ("hash_scheme", {"hash_scheme": "md5"}),
    ("hash_scheme", {"hash_scheme": ""}),
    ("tenant_salt", {"tenant_salt": b"s" * (MAX_SALT_BYTES + 1)}),
    ("tenant_salt", {"tenant_salt": "text"}),
    ("num_layers", {"num_layers": 0}),
    ("num_layers", {"num_layers": MAX_LAYERS + 1}),
    ("num_layers", {"num_layers": 2.0}),
    # bool is an int subclass: True must not stand in for 1.
    ("num_layers", {"num_layers": True}),
    ("num_kv_heads", {"num_kv_heads": 0}),
    ("num_kv_heads", {"num_kv_heads": MAX_KV_HEADS + 1}),
    ("head_dim", {"head_dim": -1}),
    ("head_dim", {"head_dim": MAX_HEAD_DIM + 1}),
    ("block_tokens", {"block_tokens": 0}),
    ("block_tokens", {"block_tokens": MAX_BLOCK_TOKENS + 1}),
    ("tp_size", {"tp_size": 0}),
    ("tp_size", {"tp_size": MAX_PARALLEL + 1}),
    ("pp_size", {"pp_size": 0}),
    ("tp_rank", {"tp_rank": 1}),
    ("tp_rank", {"tp_rank": -1}),
    ("pp_stage", {"pp_stage": 2, "pp_size": 2}),
    ("pp_stage", {"pp_stage": -1}),
    # Regression: these passed validation and then failed in encode() with a
    # struct.error (or a TypeError) instead of InvalidArgument.
    ("tp_rank", {"tp_rank": 0.5, "tp_size": 2}),
    ("tp_rank", {"tp_rank": "0"}),
    ("pp_stage", {"pp_stage": 1.0, "pp_size": 2}),
    ("kv_dtype", {"kv_dtype": 99}),
    ("kv_dtype", {"kv_dtype": "bf16"}),
    ("inner_layout", {"inner_layout": 0}),
    ("kv_order", {"kv_order": 4}),
    ("num_kv_heads", {"kv_order": KvOrder.LATENT, "num_kv_heads": 2}),  # one latent per token
]


@pytest.mark.parametrize("name, overrides", INVALID_FIELDS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(INVALID_FIELDS)])
def test_invalid_spec_names_the_field(name, overrides):
    with pytest.raises(InvalidArgument) as raised:
        spec(**overrides)
    assert name in raised.value.message
    assert raised.value.code == "INVALID_ARGUMENT"


def test_limits_are_inclusive():
    spec(
        num_layers=MAX_LAYERS,
        num_kv_heads=MAX_KV_HEADS,
        head_dim=MAX_HEAD_DIM,
        block_tokens=MAX_BLOCK_TOKENS,
        model_id="m" * MAX_STRING_BYTES,
        tenant_salt=b"s" * MAX_SALT_BYTES,
        tp_size=MAX_PARALLEL,
        tp_rank=MAX_PARALLEL - 1,
    )


def test_plain_int_enum_values_are_accepted_and_equal_the_enum():
    assert spec(kv_dtype=2).namespace_id() == spec(kv_dtype=DType.FLOAT16).namespace_id()


def test_chain_keys_validation_names_the_argument():
    with pytest.raises(InvalidArgument, match="extras"):
        chain_keys(spec(), TOKENS, extras=[[], []])
    with pytest.raises(InvalidArgument, match="token_ids"):
        chain_keys(spec(), np.zeros((2, 4), dtype=np.uint32))
    with pytest.raises(InvalidArgument, match="parent"):
        chain_keys(spec(), TOKENS, parent=b"short")
    # Checked even when there is no full block to hash.
    with pytest.raises(InvalidArgument, match="parent"):
        chain_keys(spec(), [1], parent=b"short")
    with pytest.raises(InvalidArgument, match="parent"):
        block_key(b"x" * 31, RAW)
    with pytest.raises(InvalidArgument, match="tag"):
        chain_keys(spec(), TOKENS[:4], extras=[[ExtraKey("")]])
    with pytest.raises(InvalidArgument, match="tag"):
        block_key(ROOT, RAW, [ExtraKey("t" * 256)])
    with pytest.raises(InvalidArgument, match="value"):
        block_key(ROOT, RAW, [ExtraKey("mm", "not bytes")])  # type: ignore[arg-type]
    block_key(ROOT, RAW, [ExtraKey("t" * 255)])  # 255 bytes is the limit, inclusive


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec().model_id = "other"  # type: ignore[misc]


def test_block_geometry():
    base = spec(num_layers=3, num_kv_heads=5, head_dim=7, block_tokens=11, kv_dtype=DType.FLOAT32)
    assert base.block_shape == (3, 2, 11, 5, 7)
    assert dataclasses.replace(base, inner_layout=InnerLayout.HEAD_TOKEN_DIM).block_shape == (3, 2, 5, 11, 7)
    assert base.layer_bytes == 2 * 11 * 5 * 7 * 4
    assert base.block_bytes == 3 * base.layer_bytes
    assert dataclasses.replace(base, kv_dtype=DType.FLOAT8_E4M3).block_bytes == base.block_bytes // 4
    # MLA: one latent plane per layer, not K and V.
    latent = dataclasses.replace(base, num_kv_heads=1, head_dim=576, kv_order=KvOrder.LATENT)
    assert latent.block_shape == (3, 1, 11, 1, 576)
    assert latent.layer_bytes == 11 * 576 * 4 and latent.block_bytes == 3 * latent.layer_bytes
    assert latent.namespace_id() != dataclasses.replace(latent, kv_order=KvOrder.K_THEN_V).namespace_id()


# ----------------------------------------------------------------------
# Known answer: pins the encoding

KAT_SPEC = {
    "model_id": "kat-model",
    "model_revision": "rev-1",
    "num_layers": 32,
    "num_kv_heads": 8,
    "head_dim": 128,
    "block_tokens": 4,
    "kv_dtype": DType.BFLOAT16,
    "inner_layout": InnerLayout.HEAD_TOKEN_DIM,
    "kv_order": KvOrder.V_THEN_K,
    "tp_rank": 1,
    "tp_size": 2,
    "pp_stage": 0,
    "pp_size": 1,
    "lora_id": "lora-x",
    "tenant_salt": b"\x00salt\xff",
}
KAT_TOKENS = [0, 1, 2**32 - 1, 151643, 7, 8, 9, 10, 11]  # two full blocks and a partial one
KAT_EXTRAS = [[], [ExtraKey("mm", b"\xaa" * 4), ExtraKey("salt", b"")]]

# Computed once with kvd.core.keys (schema v1). If these change, every stored
# key changes: bump KEY_SCHEMA_VERSION instead of editing the numbers.
KAT_NAMESPACE_ID = "2d9a6b567d30014043841d0dfa0c3bb3123fdb2d320040f7de005568eb6f313b"
KAT_ROOT_KEY = "ee4cf059601718f6f99430b48d39b72642e19d5c79cca14d4d60f692906e1086"
KAT_KEYS = [
    "b9ff08115b64301280a332ce8f2d3bb5d3a1b81d237e4e84037fa7c178e9f7dc",
    "dc30da9e4758d7593aacb4937cde4c2c83c4cef45f03eea35b9b89eefb2b3676",
]


def _field(tag: bytes, value: bytes) -> bytes:
    return bytes([len(tag)]) + tag + len(value).to_bytes(4, "little") + value


def _u32(value: int) -> bytes:
    return int(value).to_bytes(4, "little")


def _reference_keys(fields: dict, tokens: list[int], extras: list[list[tuple[bytes, bytes]]]):
    """The encoding of the keys module docstring, written out independently."""
    version = _u32(1)
    order = [
        ("model_id", fields["model_id"].encode()),
        ("model_revision", fields["model_revision"].encode()),
        ("kv_dtype", _u32(fields["kv_dtype"])),
        ("num_layers", _u32(fields["num_layers"])),
        ("num_kv_heads", _u32(fields["num_kv_heads"])),
        ("head_dim", _u32(fields["head_dim"])),
        ("block_tokens", _u32(fields["block_tokens"])),
        ("inner_layout", _u32(fields["inner_layout"])),
        ("kv_order", _u32(fields["kv_order"])),
        ("tp_rank", _u32(fields["tp_rank"])),
        ("tp_size", _u32(fields["tp_size"])),
        ("pp_stage", _u32(fields["pp_stage"])),
        ("pp_size", _u32(fields["pp_size"])),
        ("lora_id", fields["lora_id"].encode()),
        ("tenant_salt", fields["tenant_salt"]),
        ("hash_scheme", b"sha256-v1"),
    ]
    encoded = b"".join(_field(tag.encode(), value) for tag, value in order)
    namespace_id = hashlib.sha256(b"kvd/namespace" + version + encoded).digest()
    root = hashlib.sha256(b"kvd/root" + version + namespace_id + _field(b"tenant_salt", fields["tenant_salt"])).digest()
    per_block = fields["block_tokens"]
    keys = []
    parent = root
    for index in range(len(tokens) // per_block):
        raw = b"".join(_u32(token) for token in tokens[index * per_block : (index + 1) * per_block])
        block_extras = b"".join(_field(tag, value) for tag, value in extras[index])
        parent = hashlib.sha256(
            b"kvd/block" + version + parent + _field(b"tokens", raw) + _u32(len(extras[index])) + block_extras
        ).digest()
        keys.append(parent)
    return namespace_id, root, keys


def test_known_answer_matches_independent_encoding():
    kat = NamespaceSpec(**KAT_SPEC)
    keys = chain_keys(kat, KAT_TOKENS, KAT_EXTRAS)
    extras = [[(extra.tag.encode(), extra.value) for extra in block] for block in KAT_EXTRAS]
    namespace_id, root, expected = _reference_keys(KAT_SPEC, KAT_TOKENS, extras)
    assert kat.namespace_id() == namespace_id
    assert kat.root_key() == root
    assert keys == expected


def test_known_answer_is_pinned():
    kat = NamespaceSpec(**KAT_SPEC)
    assert keys_module.KEY_SCHEMA_VERSION == 1
    assert keys_module.HASH_SCHEME == "sha256-v1"
    assert kat.namespace_id().hex() == KAT_NAMESPACE_ID
    assert kat.root_key().hex() == KAT_ROOT_KEY
    assert [key.hex() for key in chain_keys(kat, KAT_TOKENS, KAT_EXTRAS)] == KAT_KEYS
