"""Synthetic request traces that look like a serving node's traffic.

What a trace models, all of it drawn from one seed:

- Tenants. Each tenant is one namespace (its own salt), so nothing is
  shared across tenants. Tenant i gets a share of the traffic that falls
  off as 1/(i+1).
- Shared system prompts. Every request starts with one of its tenant's
  few system prompts, so all of a tenant's requests share a prefix.
- Multi-turn chat. A session's turn n+1 is turn n's prompt and reply plus
  a new user message, so each turn extends the previous turn's prefix. The
  next turn arrives after a think time; sessions end after a geometric
  number of turns or at the context limit.
- RAG. A query is the system prompt, one to a few retrieved documents and
  the question. Documents are drawn from the tenant's corpus with Zipf
  popularity, so a few documents are hot and most are cold.
- One-shot prompts. A system prompt and a never-repeated body: traffic that
  scans through the cache and is never reused.
- Bursty arrivals. New conversations and queries arrive as an on/off
  (Markov-modulated) Poisson process: busy periods at a high rate, quiet
  periods at a low one.

Token ids are random. A request carries its prompt and the reply it will
generate; the simulator computes the keys and stores both, as an engine
with prefix caching stores the KV of every full block it computed.
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvd.invariants import check

_US_PER_S = 1_000_000


class RequestKind(enum.Enum):
    CHAT = "chat"
    RAG = "rag"
    ONE_SHOT = "one-shot"


@dataclass(frozen=True, slots=True)
class TraceConfig:
    tenants: int = 3
    vocabulary: int = 32_000
    system_prompts_per_tenant: int = 2
    system_prompt_tokens: tuple[int, int] = (300, 1_500)
    # Shares of new arrivals; the rest are one-shot prompts.
    chat_share: float = 0.35
    rag_share: float = 0.45
    # Chat: user messages and replies, turns per session (geometric mean),
    # think time between turns, the context limit that ends a session.
    message_tokens: tuple[int, int] = (30, 400)
    reply_tokens: tuple[int, int] = (50, 400)
    mean_turns: float = 4.0
    max_turns: int = 16
    mean_think_s: float = 30.0
    max_context_tokens: int = 16_384
    # RAG: corpus per tenant, Zipf exponent of document popularity,
    # documents per query, document and question lengths.
    documents_per_tenant: int = 150
    zipf_exponent: float = 1.1
    documents_per_query: tuple[int, int] = (1, 3)
    document_tokens: tuple[int, int] = (200, 1_200)
    question_tokens: tuple[int, int] = (20, 120)
    answer_tokens: tuple[int, int] = (20, 300)
    one_shot_tokens: tuple[int, int] = (200, 2_000)
    # On/off arrivals of new work: rates per second, mean period lengths.
    busy_rate_per_s: float = 8.0
    quiet_rate_per_s: float = 1.0
    mean_busy_s: float = 20.0
    mean_quiet_s: float = 40.0
    # Clients that die holding their leases (they expire).
    client_crash_share: float = 0.01

    def validate(self) -> None:
        check(self.tenants >= 1 and self.system_prompts_per_tenant >= 1, "need tenants and system prompts")
        check(0.0 <= self.chat_share and 0.0 <= self.rag_share and self.chat_share + self.rag_share <= 1.0,
              "chat_share + rag_share must be within [0, 1]")
        check(self.documents_per_tenant >= self.documents_per_query[1] >= self.documents_per_query[0] >= 1,
              "documents per query must fit the corpus")
        check(self.busy_rate_per_s > 0 and self.quiet_rate_per_s > 0, "arrival rates must be positive")
        check(self.mean_turns >= 1 and self.max_turns >= 1, "a session has at least one turn")


@dataclass(frozen=True, slots=True, eq=False)
class Request:
    request_id: int
    arrival_us: int
    tenant: int
    kind: RequestKind
    # Prompt tokens, then the reply's; both u32.
    prompt: np.ndarray
    reply: np.ndarray
    # A chat session's id (turns of one session share it), else -1.
    session: int
    turn: int
    # RAG: the documents retrieved (popularity ranks, 0 the most popular).
    documents: tuple[int, ...]
    # The client dies after reserving its blocks: never commits or releases.
    client_crashes: bool


class BurstyArrivals:
    """Arrival times (µs) of an on/off Markov-modulated Poisson process."""

    def __init__(self, rng: np.random.Generator, config: TraceConfig) -> None:
        self._rng = rng
        self._config = config
        self._busy = True
        self._now_s = 0.0
        self._switch_s = rng.exponential(config.mean_busy_s)

    def next_us(self) -> int:
        config = self._config
        while True:
            rate = config.busy_rate_per_s if self._busy else config.quiet_rate_per_s
            arrival_s = self._now_s + self._rng.exponential(1.0 / rate)
            if arrival_s < self._switch_s:
                self._now_s = arrival_s
                return int(arrival_s * _US_PER_S)
            # Memoryless: past the switch, start over in the other state.
            self._now_s = self._switch_s
            self._busy = not self._busy
            self._switch_s += self._rng.exponential(config.mean_busy_s if self._busy else config.mean_quiet_s)


@dataclass(slots=True, eq=False)
class _Session:
    session: int
    tenant: int
    history: np.ndarray
    turn: int
    turns: int


class TraceGenerator:
    """Requests in arrival order; the same seed gives the same trace."""

    def __init__(self, seed: int, config: TraceConfig | None = None) -> None:
        self.config = config or TraceConfig()
        self.config.validate()
        self._seed = seed
        self._rng = np.random.default_rng([seed, 0x7ACE])
        config = self.config
        weights = 1.0 / np.arange(1, config.tenants + 1)
        self._tenant_p = weights / weights.sum()
        ranks = np.arange(1, config.documents_per_tenant + 1, dtype=np.float64)
        popularity = ranks ** -config.zipf_exponent
        self._document_p = popularity / popularity.sum()
        self._system_prompts = [
            [self._fixed_tokens(1, tenant, index, config.system_prompt_tokens)
             for index in range(config.system_prompts_per_tenant)]
            for tenant in range(config.tenants)
        ]
        self._documents: dict[tuple[int, int], np.ndarray] = {}
        self._arrivals = BurstyArrivals(self._rng, config)
        # (arrival µs, session id, session): next turns, in time order.
        self._turns: list[tuple[int, int, _Session]] = []
        self._next_id = 0
        self._next_session = 0

    def __iter__(self) -> Iterator[Request]:
        next_new_us = self._arrivals.next_us()
        while True:
            if self._turns and self._turns[0][0] <= next_new_us:
                arrival_us, _, session = heapq.heappop(self._turns)
                yield self._chat_turn(arrival_us, session)
                continue
            yield self._new_request(next_new_us)
            next_new_us = self._arrivals.next_us()

    def take(self, count: int) -> list[Request]:
        requests = []
        for request in self:
            if len(requests) == count:
                break
            requests.append(request)
        return requests

    # ------------------------------------------------------------------

    def _new_request(self, arrival_us: int) -> Request:
        config = self.config
        rng = self._rng
        tenant = int(rng.choice(config.tenants, p=self._tenant_p))
        system = self._system_prompts[tenant][int(rng.integers(config.system_prompts_per_tenant))]
        draw = rng.random()
        if draw < config.chat_share:
            turns = min(config.max_turns, int(rng.geometric(1.0 / config.mean_turns)))
            session = _Session(self._next_session, tenant, system, 0, turns)
            self._next_session += 1
            return self._chat_turn(arrival_us, session)
        if draw < config.chat_share + config.rag_share:
            low, high = config.documents_per_query
            count = int(rng.integers(low, high + 1))
            ranks = rng.choice(config.documents_per_tenant, size=count, replace=False, p=self._document_p)
            documents = [self._document(tenant, int(rank)) for rank in ranks]
            prompt = np.concatenate([system, *documents, self._random_tokens(config.question_tokens)])
            return self._request(
                arrival_us, tenant, RequestKind.RAG, prompt, config.answer_tokens, -1, 0, tuple(map(int, ranks))
            )
        prompt = np.concatenate([system, self._random_tokens(config.one_shot_tokens)])
        return self._request(arrival_us, tenant, RequestKind.ONE_SHOT, prompt, config.answer_tokens, -1, 0)

    def _chat_turn(self, arrival_us: int, session: _Session) -> Request:
        config = self.config
        prompt = np.concatenate([session.history, self._random_tokens(config.message_tokens)])
        request = self._request(
            arrival_us, session.tenant, RequestKind.CHAT, prompt, config.reply_tokens, session.session, session.turn
        )
        session.history = np.concatenate([request.prompt, request.reply])
        session.turn += 1
        context_left = config.max_context_tokens - len(session.history) - config.message_tokens[1]
        if session.turn < session.turns and context_left >= config.reply_tokens[1] and not request.client_crashes:
            think_us = int(self._rng.exponential(config.mean_think_s) * _US_PER_S)
            heapq.heappush(self._turns, (arrival_us + max(1, think_us), session.session, session))
        return request

    def _request(
        self,
        arrival_us: int,
        tenant: int,
        kind: RequestKind,
        prompt: np.ndarray,
        reply_range: tuple[int, int],
        session: int,
        turn: int,
        documents: tuple[int, ...] = (),
    ) -> Request:
        reply = self._random_tokens(reply_range)
        crashes = bool(self._rng.random() < self.config.client_crash_share)
        request = Request(self._next_id, arrival_us, tenant, kind, prompt, reply, session, turn, documents, crashes)
        self._next_id += 1
        return request

    def _random_tokens(self, length_range: tuple[int, int]) -> np.ndarray:
        length = int(self._rng.integers(length_range[0], length_range[1] + 1))
        return self._rng.integers(0, self.config.vocabulary, size=length, dtype=np.uint32)

    def _fixed_tokens(self, kind: int, tenant: int, index: int, length_range: tuple[int, int]) -> np.ndarray:
        # Its own stream per item, so a document's tokens do not depend on
        # when it is first drawn.
        rng = np.random.default_rng([self._seed, kind, tenant, index])
        length = int(rng.integers(length_range[0], length_range[1] + 1))
        return rng.integers(0, self.config.vocabulary, size=length, dtype=np.uint32)

    def _document(self, tenant: int, rank: int) -> np.ndarray:
        tokens = self._documents.get((tenant, rank))
        if tokens is None:
            tokens = self._fixed_tokens(2, tenant, rank, self.config.document_tokens)
            self._documents[(tenant, rank)] = tokens
        return tokens
