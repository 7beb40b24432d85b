"""The synthetic traces model what they say they model, and only the seed decides them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvd.sim.traces import RequestKind, TraceConfig, TraceGenerator


def tokens_of(requests):
    return [(request.arrival_us, request.tenant, request.prompt.tobytes(), request.reply.tobytes())
            for request in requests]


def test_the_seed_alone_decides_the_trace():
    first = TraceGenerator(11).take(300)
    assert tokens_of(first) == tokens_of(TraceGenerator(11).take(300))
    assert tokens_of(first) != tokens_of(TraceGenerator(12).take(300))


def test_arrivals_are_in_order_and_every_kind_and_tenant_appears():
    requests = TraceGenerator(3).take(1500)
    arrivals = [request.arrival_us for request in requests]
    assert arrivals == sorted(arrivals)
    assert {request.kind for request in requests} == set(RequestKind)
    per_tenant = np.bincount([request.tenant for request in requests], minlength=3)
    # Shares fall off as 1/(i+1): tenant 0 sends the most.
    assert per_tenant.argmax() == 0 and per_tenant.min() > 0


def test_a_chat_turn_extends_the_previous_turn_and_its_reply():
    requests = TraceGenerator(5).take(2000)
    sessions: dict[int, list] = {}
    for request in requests:
        if request.kind == RequestKind.CHAT:
            sessions.setdefault(request.session, []).append(request)
    multi_turn = [turns for turns in sessions.values() if len(turns) > 1]
    assert len(multi_turn) > 20
    for turns in multi_turn:
        assert [turn.turn for turn in turns] == list(range(len(turns)))
        for earlier, later in zip(turns, turns[1:]):
            history = np.concatenate([earlier.prompt, earlier.reply])
            assert len(later.prompt) > len(history)
            assert np.array_equal(later.prompt[: len(history)], history)
            assert later.arrival_us > earlier.arrival_us and later.tenant == earlier.tenant


def test_every_prompt_starts_with_one_of_its_tenants_few_system_prompts():
    config = TraceConfig()
    requests = TraceGenerator(8, config).take(600)
    shortest = config.system_prompt_tokens[0]
    starts: dict[int, set[bytes]] = {}
    for request in requests:
        starts.setdefault(request.tenant, set()).add(request.prompt[:shortest].tobytes())
    for tenant, seen in starts.items():
        assert 1 <= len(seen) <= config.system_prompts_per_tenant, tenant
    # Tenants do not share system prompts.
    assert len(set.union(*starts.values())) == sum(map(len, starts.values()))


def test_rag_documents_follow_zipf_popularity():
    config = dataclasses.replace(TraceConfig(), chat_share=0.0, rag_share=1.0, tenants=1)
    requests = TraceGenerator(2, config).take(4000)
    counts = np.bincount([rank for request in requests for rank in request.documents],
                         minlength=config.documents_per_tenant)
    ranks = np.arange(1, config.documents_per_tenant + 1)
    zipf = ranks ** -config.zipf_exponent
    # Drawn without replacement per query, so not exactly Zipf; but the
    # head is hot, the tail cold, and the order follows the ranks.
    assert counts[0] > 5 * counts[50:].mean()
    assert counts[:10].sum() > counts[-75:].sum()
    assert np.corrcoef(counts, zipf)[0, 1] > 0.9


def test_a_query_holds_its_documents_tokens_in_retrieval_order():
    config = dataclasses.replace(TraceConfig(), chat_share=0.0, rag_share=1.0)
    generator = TraceGenerator(9, config)
    requests = generator.take(300)
    for request in requests:
        body = request.prompt.tobytes()
        offsets = [body.find(generator._document(request.tenant, rank).tobytes()) for rank in request.documents]
        assert all(offset >= 0 and offset % 4 == 0 for offset in offsets)
        assert offsets == sorted(offsets)
    # Hot documents recur, token for token, so their blocks can be hits.
    assert len({rank for request in requests for rank in request.documents}) < sum(
        len(request.documents) for request in requests
    )


def test_arrivals_are_burstier_than_poisson():
    config = dataclasses.replace(TraceConfig(), chat_share=0.0)  # new arrivals only
    requests = TraceGenerator(4, config).take(3000)
    gaps = np.diff([request.arrival_us for request in requests]).astype(float)
    # A Poisson process has a coefficient of variation of 1.
    assert gaps.std() / gaps.mean() > 1.3


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_crashing_clients_follow_their_share(share):
    config = dataclasses.replace(TraceConfig(), client_crash_share=share)
    crashes = sum(request.client_crashes for request in TraceGenerator(6, config).take(1000))
    assert crashes == 0 if share == 0 else 400 < crashes < 600
