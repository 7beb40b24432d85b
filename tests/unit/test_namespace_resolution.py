"""What a NAME_OR_ID names (kvd.client.namespaces.resolve_namespace, the rule `kvd delete --namespace`
and Client.delete_namespace share): ids, id prefixes, model_ids, id:, and the exact errors."""

from __future__ import annotations

import hashlib

import pytest

from kvd.client.namespaces import (AmbiguousNamespace, NamespaceInfo, NamespaceReference, TierUsage,
                                   namespace_infos, resolve_namespace)
from kvd.core.keys import DType, NamespaceSpec
from kvd.errors import InvalidArgument, NotFound
from kvd.v1 import kvd_pb2


def info(model_id: str, daemon_id: bytes, client_id: bytes | None = None, tenant: str = "",
         revision: str = "") -> NamespaceInfo:
    spec = NamespaceSpec(model_id=model_id, model_revision=revision, num_layers=2, num_kv_heads=1, head_dim=8,
                         block_tokens=4, kv_dtype=DType.FLOAT16, tenant=tenant)
    return NamespaceInfo(daemon_id, client_id if client_id is not None else daemon_id, tenant, spec, False,
                         spec.block_bytes, 0, (TierUsage("host", 0, 0, 0),), 0, 0, False)


def digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


LLAMA = info("llama-3-8b", bytes.fromhex("3f2a9c01" + "11" * 28), revision="|vllm 0.32.0|cpu CPU_ATTN/vec")
# Its id starts with the same 8 hex digits as LLAMA's.
LLAMA_TP1 = info("llama-3-8b", bytes.fromhex("3f2a9c01" + "22" * 28), revision="|vllm 0.32.0|tp 1")
MISTRAL = info("mistral", bytes.fromhex("a0b1c2d3" + "33" * 28))
# A model_id that is all hex digits, and the start of LLAMA's id.
HEXNAME = info("3f2a9c01", digest("hexname"))
ALL = [LLAMA, LLAMA_TP1, MISTRAL, HEXNAME]


def test_an_exact_id_a_unique_prefix_and_a_model_id_each_name_one_namespace():
    assert resolve_namespace(ALL, LLAMA.namespace_id.hex()) is LLAMA
    assert resolve_namespace(ALL, "3f2a9c011111") is LLAMA  # 12 digits: past HEXNAME's name
    assert resolve_namespace(ALL, "A0B1C2D3") is MISTRAL  # hex digits in either case
    assert resolve_namespace(ALL, "mistral") is MISTRAL
    assert resolve_namespace(ALL, f"id:{MISTRAL.namespace_id.hex()[:8]}") is MISTRAL
    # id: leaves names out: HEXNAME's model_id (3f2a9c01) never matches.
    assert resolve_namespace(ALL, "id:3f2a9c011") is LLAMA


def test_the_id_its_clients_know_names_it_too():
    tenant_owned = info("qwen", digest("daemon id"), client_id=digest("client id"), tenant="team-a")
    assert resolve_namespace([tenant_owned], digest("client id").hex()[:10]) is tenant_owned
    assert resolve_namespace([tenant_owned], digest("daemon id").hex()) is tenant_owned


def test_several_matches_are_an_error_listing_each_candidate():
    with pytest.raises(AmbiguousNamespace) as shared_name:
        resolve_namespace(ALL, "llama-3-8b")
    assert shared_name.value.candidates == (LLAMA, LLAMA_TP1)
    assert shared_name.value.code == "INVALID_ARGUMENT"
    assert shared_name.value.message == (
        "'llama-3-8b' matches 2 namespaces; name one by a longer id prefix (or choose a tenant):\n"
        "  3f2a9c0111111111 model_id 'llama-3-8b' model_revision '|vllm 0.32.0|cpu CPU_ATTN/vec'\n"
        "  3f2a9c0122222222 model_id 'llama-3-8b' model_revision '|vllm 0.32.0|tp 1'")
    # A prefix two ids share; and it is a model_id as well.
    with pytest.raises(AmbiguousNamespace) as shared_prefix:
        resolve_namespace(ALL, "id:3f2a9c01")
    assert shared_prefix.value.candidates == (LLAMA, LLAMA_TP1)
    with pytest.raises(AmbiguousNamespace) as name_and_prefix:
        resolve_namespace(ALL, "3f2a9c01")
    assert name_and_prefix.value.candidates == (LLAMA, LLAMA_TP1, HEXNAME)
    tenants = [info("shared", digest("a"), client_id=digest("c"), tenant="a"),
               info("shared", digest("b"), client_id=digest("c"), tenant="b")]
    with pytest.raises(AmbiguousNamespace) as across_tenants:
        resolve_namespace(tenants, digest("c").hex()[:8])
    assert f"\n  {digest('a').hex()[:16]} tenant 'a' model_id 'shared'" in across_tenants.value.message
    assert f"\n  {digest('b').hex()[:16]} tenant 'b' model_id 'shared'" in across_tenants.value.message


@pytest.mark.parametrize("asked, message", [
    ("gemma", "no namespace has the model_id 'gemma', among the daemon's 4 namespaces "
              "(model_ids: '3f2a9c01', 'llama-3-8b', 'mistral')"),
    ("deadbeef", "no namespace has the model_id 'deadbeef' or an id starting with deadbeef, among the daemon's 4 "
                 "namespaces (model_ids: '3f2a9c01', 'llama-3-8b', 'mistral')"),
    ("3f2a", "no namespace has the model_id '3f2a' (nor is it an id: an id is 64 hex digits, a prefix of one at "
             "least 8; '3f2a' has 4), among the daemon's 4 namespaces (model_ids: '3f2a9c01', 'llama-3-8b', "
             "'mistral')"),
    ("id:" + "00" * 32, "no namespace has an id equal to " + "00" * 32 + ", among the daemon's 4 namespaces "
                        "(model_ids: '3f2a9c01', 'llama-3-8b', 'mistral')"),
])
def test_no_match_is_not_found_naming_what_was_asked_and_what_there_is(asked, message):
    with pytest.raises(NotFound) as error:
        resolve_namespace(ALL, asked)
    assert error.value.message == message


def test_a_tenants_empty_list_says_whose_it_was():
    with pytest.raises(NotFound) as error:
        resolve_namespace([], "mistral", tenant="team-a")
    assert error.value.message == "no namespace has the model_id 'mistral', among tenant 'team-a''s 0 namespaces"


@pytest.mark.parametrize("asked, message", [
    ("", "a namespace's name or id must not be empty (`kvd namespaces` lists them)"),
    ("  ", "a namespace's name or id must not be empty (`kvd namespaces` lists them)"),
    ("id:xyz12345", "'id:xyz12345' is not an id: 'xyz12345' is not hexadecimal"),
    ("id:3f2a", "'id:3f2a' is not an id: an id is 64 hex digits, a prefix of one at least 8; '3f2a' has 4"),
    ("id:" + "0" * 65, f"'id:{'0' * 65}' is not an id: an id is 64 hex digits, a prefix of one at least 8; "
                       f"'{'0' * 65}' has 65"),
    ("m" * 600, f"{'m' * 40!r}... is longer than any model_id (512 bytes)"),
])
def test_malformed_input_is_invalid_argument_before_anything_is_matched(asked, message):
    with pytest.raises(InvalidArgument) as error:
        NamespaceReference.parse(asked)
    assert error.value.message == message and not isinstance(error.value, AmbiguousNamespace)
    with pytest.raises(InvalidArgument):
        resolve_namespace(ALL, asked)


def test_a_list_namespaces_answer_becomes_infos_without_the_salt():
    spec = kvd_pb2.NamespaceSpec(model_id="m", model_revision="|vllm x", kv_dtype=kvd_pb2.DTYPE_BFLOAT16,
                                 num_layers=2, num_kv_heads=1, head_dim=8, block_tokens=4,
                                 inner_layout=kvd_pb2.INNER_LAYOUT_TOKEN_HEAD_DIM,
                                 kv_order=kvd_pb2.KV_ORDER_K_THEN_V, tp_size=1, pp_size=1, hash_scheme="sha256-v1")
    response = kvd_pb2.ListNamespacesResponse(namespaces=[kvd_pb2.NamespaceInfo(
        namespace_id=digest("d"), client_namespace_id=digest("c"), tenant="t", spec=spec, salted=True,
        block_bytes=64, blocks=5,
        tiers=[kvd_pb2.NamespaceTierUsage(tier=kvd_pb2.TIER_HOST, blocks=2, payload_bytes=128, bytes_used=8192),
               kvd_pb2.NamespaceTierUsage(tier=kvd_pb2.TIER_DISK, blocks=5, payload_bytes=320, bytes_used=20480)],
        hits=7, misses=3, disk_enabled=True)])
    (found,) = namespace_infos(response)
    assert (found.name, found.identity, found.tenant, found.spec.tenant, found.salted) == ("m", "|vllm x", "t", "t",
                                                                                           True)
    assert found.tiers == (TierUsage("host", 2, 128, 8192), TierUsage("disk", 5, 320, 20480))
    assert found.to_dict()["tiers"] == {"host": {"blocks": 2, "payload_bytes": 128, "used_bytes": 8192},
                                        "disk": {"blocks": 5, "payload_bytes": 320, "used_bytes": 20480}}
    assert found.to_dict()["spec"]["kv_dtype"] == "bfloat16" and found.to_dict()["spec"]["salted"] is True
