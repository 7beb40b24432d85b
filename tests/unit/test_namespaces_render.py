"""`kvd namespaces` rendered from NamespaceInfo, and `kvd delete`'s prompt and refusal without a terminal."""

from __future__ import annotations

import io

from kvd.cli.namespaces import EXIT_FAILED, EXIT_USAGE, render_namespaces, run_delete
from kvd.client.namespaces import NamespaceInfo, TierUsage
from kvd.core.keys import DType, NamespaceSpec

IDENTITY = "|vllm 0.32.0|cpu CPU_ATTN/vec|kv [blocks][2, 128, 128]|cache_dtype auto"


def info(model_id: str, tenant: str, blocks: int, host: int, disk: int, hits: int = 0, misses: int = 0,
         revision: str = IDENTITY) -> NamespaceInfo:
    spec = NamespaceSpec(model_id=model_id, model_revision=revision, num_layers=2, num_kv_heads=1, head_dim=8,
                         block_tokens=4, kv_dtype=DType.FLOAT16, tenant=tenant)
    namespace_id = bytes([len(model_id)]) * 32
    return NamespaceInfo(namespace_id, namespace_id, tenant, spec, False, 1024, blocks,
                         (TierUsage("host", host, host * 1024, host * 4096),
                          TierUsage("disk", disk, disk * 1024, disk * 1024)), hits, misses, True)


def test_one_row_per_namespace_with_blocks_and_bytes_per_tier_and_the_full_identity():
    text = render_namespaces([info("llama", "", 7, 2, 7, hits=3, misses=1), info("mistral-7b", "", 0, 0, 0,
                                                                                revision="")])
    assert text.splitlines() == [
        "namespace         model_id    blocks  host         disk         hits  misses  hit rate  "
        "identity (model_revision)",
        "----------------  ----------  ------  -----------  -----------  ----  ------  --------  "
        + "-" * len(IDENTITY),
        f"0505050505050505  llama       7       2 (8.0 KiB)  7 (7.0 KiB)  3     1       75.0%     {IDENTITY}",
        "0a0a0a0a0a0a0a0a  mistral-7b  0       0 (0 B)      0 (0 B)      0     0       -         -",
    ]


def test_a_tenant_column_appears_when_a_namespace_has_a_tenant():
    header = render_namespaces([info("llama", "team-a", 1, 1, 0), info("qwen", "", 0, 0, 0)]).splitlines()[0]
    assert header.split()[:3] == ["namespace", "tenant", "model_id"]
    assert render_namespaces([]) == "no namespaces registered"


class _Answers(io.StringIO):
    def __init__(self, text: str, tty: bool) -> None:
        super().__init__(text)
        self._tty = tty

    def isatty(self) -> bool:
        return self._tty


class _FakeClient:
    """Finds one namespace; a deletion would be a bug in these tests."""

    def find_namespace(self, name_or_id: str, tenant: str) -> NamespaceInfo:
        return info("llama", tenant, 7, 2, 7)

    def delete_namespace(self, namespace):
        raise AssertionError("deleted without a yes")


def test_without_yes_it_refuses_where_nobody_can_confirm_and_asks_a_terminal(capsys):
    assert run_delete(_FakeClient(), "llama", "", yes=False, as_json=False, stdin=_Answers("", tty=False)) == EXIT_USAGE
    assert "pass --yes (stdin is not a terminal to confirm on)" in capsys.readouterr().err
    assert run_delete(_FakeClient(), "llama", "", yes=False, as_json=False, stdin=_Answers("n\n", tty=True)) == \
        EXIT_FAILED
    err = capsys.readouterr().err
    assert err.startswith("delete every block of namespace 0505050505050505 model_id 'llama' model_revision "
                          f"'{IDENTITY}': 7 blocks; host 2 (8.0 KiB), disk 7 (7.0 KiB)? [y/N] ")
    assert err.endswith("kvd: nothing deleted\n")
