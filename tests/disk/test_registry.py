"""The NAMESPACES registry and decoding a spec back from its encoding."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.keys import DType, InnerLayout, KvOrder, NamespaceSpec
from kvd.errors import InvalidArgument
from kvd.tiers.disk.frames import RecordType, encode_frame
from kvd.tiers.disk.layout import NAMESPACES
from kvd.tiers.disk.registry import NamespaceEntry, NamespaceRegistry, decode_spec
from tests.disk.conftest import SPEC


def _specs(kv_orders, kv_heads) -> st.SearchStrategy[NamespaceSpec]:
    return st.builds(
        NamespaceSpec,
        model_id=st.text(min_size=1, max_size=40),
        num_layers=st.integers(1, 1024),
        num_kv_heads=kv_heads,
        head_dim=st.integers(1, 4096),
        block_tokens=st.integers(1, 65536),
        kv_dtype=st.sampled_from(DType),
        model_revision=st.text(max_size=20),
        inner_layout=st.sampled_from(InnerLayout),
        kv_order=st.sampled_from(kv_orders),
        tp_rank=st.just(0),
        tp_size=st.integers(1, 8),
        pp_stage=st.just(0),
        pp_size=st.integers(1, 8),
        lora_id=st.text(max_size=20),
        tenant_salt=st.binary(max_size=64),
    )


# An MLA namespace has one latent per token: one head.
specs = _specs([KvOrder.K_THEN_V, KvOrder.V_THEN_K], st.integers(1, 1024)) | _specs([KvOrder.LATENT], st.just(1))


@settings(max_examples=200, deadline=None)
@given(specs)
def test_decode_spec_round_trips(spec):
    decoded = decode_spec(spec.encode())
    assert decoded == spec
    assert decoded.namespace_id() == spec.namespace_id()


def test_decode_spec_knows_every_field_of_the_spec():
    # If keys.py grows a field, NamespaceSpec.encode() grows a tag decode_spec
    # has never seen, and this fails with its name.
    from kvd.tiers.disk.registry import _FIELDS

    assert {name for name, _ in _FIELDS} == set(NamespaceSpec.__dataclass_fields__)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: data[:-1], "cut inside"),
        (lambda data: data + b"\x00", "after its last field"),
        (lambda data: data[:5] + b"X" + data[6:], "where 'model_id' belongs"),
        (lambda data: b"", "ends before"),
    ],
)
def test_decode_spec_refuses_damaged_encodings(damage, message):
    with pytest.raises(InvalidArgument, match=message):
        decode_spec(damage(SPEC.encode()))


def test_registry_survives_a_torn_tail_and_skips_a_misfiled_spec(tmp_path):
    registry = NamespaceRegistry(tmp_path)
    registry.open()
    entry = NamespaceEntry(SPEC.namespace_id(), SPEC.encode(), SPEC)
    registry.add(entry)
    path = tmp_path / NAMESPACES
    path.write_bytes(path.read_bytes() + b"\x10\x00\x00")  # a torn append
    reopened = NamespaceRegistry(tmp_path)
    report = reopened.open()
    assert report.truncated_bytes == 3 and report.records == 1
    assert reopened.entries == {entry.namespace_id: entry}

    other = NamespaceSpec("other", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1)
    path.write_bytes(path.read_bytes() + encode_frame(RecordType.NAMESPACE, SPEC.namespace_id() + other.encode()))
    # Never written so by kvd: counted as malformed and left out, never taken
    # for the namespace it is filed under (nor a reason to refuse the drive).
    misfiled = NamespaceRegistry(tmp_path)
    report = misfiled.open()
    assert report.malformed_records == 1 and misfiled.entries == {entry.namespace_id: entry}


def test_a_damaged_record_costs_that_record_only(tmp_path):
    registry = NamespaceRegistry(tmp_path)
    registry.open()
    specs = [NamespaceSpec(f"model-{n}", num_layers=1, num_kv_heads=1, head_dim=1, block_tokens=1) for n in range(4)]
    for spec in specs:
        registry.add(NamespaceEntry(spec.namespace_id(), spec.encode(), spec))
    path = tmp_path / NAMESPACES
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x01  # inside the second record
    path.write_bytes(bytes(data))
    reopened = NamespaceRegistry(tmp_path)
    report = reopened.open()
    assert report.damaged_regions == 1
    assert set(reopened.entries) == {spec.namespace_id() for spec in specs} - {specs[1].namespace_id()}


def test_an_encoding_this_kvd_cannot_read_is_kept_as_bytes(tmp_path):
    future = SPEC.encode() + b"\x09new_field\x01\x00\x00\x00\x01"
    registry = NamespaceRegistry(tmp_path)
    registry.open()
    registry.add(NamespaceEntry(b"\x01" * 32, future, None))
    reopened = NamespaceRegistry(tmp_path)
    reopened.open()
    assert reopened.entries[b"\x01" * 32] == NamespaceEntry(b"\x01" * 32, future, None)
