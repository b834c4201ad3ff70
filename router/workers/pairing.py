"""Pairing: one prefill endpoint and one decode endpoint per request, a room, and the two bodies.

Pure logic. The bodies follow SGLang's PD protocol: the client's JSON with
``bootstrap_host`` (host part of the prefill URL), ``bootstrap_port`` (the
prefill's bootstrap port, or null), ``bootstrap_room`` (random, below 2^63)
added, and, for DP ranks, ``disagg_prefill_dp_rank`` (which prefill rank holds
the KV; both legs need it) plus ``routed_dp_rank`` (the rank of that leg's own
server). The DP rank of a worker is chosen by ``dp_rank_choice.py`` (the
fewest tokens in flight by default); a client that names its ranks
(``routed_dp_rank`` / ``data_parallel_rank``, ``disagg_prefill_dp_rank``) keeps
them, and the bodies carry the chosen ranks in place of the client's values.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from pdserve.router.errors import bad_request, no_workers
from pdserve.router.policy import Policy
from pdserve.router.route import LocalRule, Route, RouteQuery
from pdserve.router.workers.adapters import AdapterError, AdapterTable
from pdserve.router.workers.dp_rank_choice import DpRankChoice, named_rank
from pdserve.router.workers.worker_registry import Endpoint, WorkerRegistry

ROUTER_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "routed_dp_rank",
                 "disagg_prefill_dp_rank", "data_parallel_rank")
_encode = msgspec.json.encode


@dataclass(slots=True)
class Pair:
    prefill: Endpoint
    decode: Endpoint
    room: int | list[int]
    # the tokens the request holds on each endpoint while its leg runs (request_tokens.py)
    prefill_tokens: int = 0
    decode_tokens: int = 0


def new_room(rng: random.Random) -> int:
    return rng.getrandbits(63)


def batch_size(body: dict) -> int | None:
    """Number of prompts of a batched ``/generate`` body, None when it is a single request."""
    text = body.get("text")
    if isinstance(text, list):
        return len(text)
    ids = body.get("input_ids")
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return None


def prompt_text(body: dict) -> str:
    """The prompt as text, for cache-aware routing (approximate: chat messages are joined)."""
    for name in ("text", "prompt"):
        value = body.get(name)
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            return value[0] if isinstance(value[0], str) else str(value[0])
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        return "\n".join(parts)
    ids = body.get("input_ids")
    if isinstance(ids, list):
        return " ".join(map(str, ids[:4096]))
    return ""


class Pairing:
    """The router's one routing decision per request: ``query`` reads the request once,
    ``route`` asks the decode policy for its endpoint and the prefill policy for the rest."""

    def __init__(self, registry: WorkerRegistry, prefill_policy: Policy, decode_policy: Policy,
                 rng: random.Random | None = None, prompt_tokenizer=None,
                 adapters: AdapterTable | None = None, dp_ranks: DpRankChoice | None = None):
        """``prompt_tokenizer``: the router's own tokenizer (``PromptTokenizer``), used when no
        policy tokenizes and --local-prefill-max-tokens needs the prompt's length. ``adapters``:
        the workers' LoRA adapters; both legs then prefer the workers holding a request's.
        ``dp_ranks``: the rule that picks a worker's DP rank (default: the fewest tokens in flight)."""
        self.registry = registry
        self.adapters = adapters
        self.dp_ranks = dp_ranks or DpRankChoice()
        self.prefill_policy = prefill_policy
        self.decode_policy = decode_policy
        self.prompt_tokenizer = prompt_tokenizer
        self.needs_text = prefill_policy.needs_text or decode_policy.needs_text
        self._rng = rng or random.Random()

    def query(self, body: dict) -> RouteQuery:
        """``body`` read once: its text if a policy reads text, its token ids if a tokenizer is
        loaded (the prefill policy's, else the decode policy's, else the router's own)."""
        adapters = frozenset()
        lora_id = 0
        if self.adapters is not None:
            try:
                adapters = self.adapters.request_adapters(body)
            except AdapterError as e:
                raise bad_request(str(e), e.param) from None
            lora_id = self.adapters.namespace(adapters)
        text = prompt_text(body) if self.needs_text else None
        encode = self.prefill_policy.encoder or self.decode_policy.encoder
        if encode is None and self.prompt_tokenizer is not None:
            encode = self.prompt_tokenizer.encoder
        return RouteQuery(body, text, None if encode is None else encode(body), adapters, lora_id)

    def route(self, query: RouteQuery, exclude: frozenset[str] | set[str] = frozenset(),
              local: Callable[[Endpoint], LocalRule | None] | None = None) -> Route:
        """Where ``query`` goes; endpoints in ``exclude`` (failed earlier in this request) are
        avoided while others remain. ``local`` (given the decode endpoint it would run on): the
        rule that lets the decode worker prefill it itself. Raises a 503 RouterError naming the
        missing role."""
        prefills = self.registry.healthy_endpoints("prefill")
        if not prefills and local is None:
            raise no_workers("prefill")
        decodes = self.registry.healthy_endpoints("decode")
        if not decodes:
            raise no_workers("decode")
        decode = self.decode_policy.pick(self._holders(self._offered("decode", decodes, exclude, query.body),
                                                       query), query)
        self.dp_ranks.chosen(decode)
        offered = self._holders(self._offered("prefill", prefills, exclude, query.body), query) if prefills else []
        route = self.prefill_policy.route(offered, query, decode, None if local is None else local(decode))
        if route.prefill is None and not route.local:
            raise no_workers("prefill")
        self.dp_ranks.chosen(route.prefill)
        if not route.local:
            n = batch_size(query.body)
            route.room = new_room(self._rng) if n is None else [new_room(self._rng) for _ in range(n)]
        return route

    def choose(self, body: dict, exclude: frozenset[str] | set[str] = frozenset()) -> Pair:
        """A prefill/decode pair for ``body`` (no local prefill)."""
        route = self.route(self.query(body), exclude)
        return Pair(route.prefill, route.decode, route.room)

    @staticmethod
    def local_body(body: dict) -> bytes:
        """The JSON body of a local prefill: the client's, without any PD routing field."""
        return _encode({k: v for k, v in body.items() if k not in ROUTER_FIELDS})

    def _holders(self, endpoints: list[Endpoint], query: RouteQuery) -> list[Endpoint]:
        """``endpoints`` narrowed to those holding the request's LoRA adapters, when some do."""
        if not query.adapters or self.adapters is None:
            return endpoints
        return list(self.adapters.prefer(endpoints, query.adapters))

    def _offered(self, role: str, endpoints: list[Endpoint], exclude, body: dict) -> list[Endpoint]:
        """The endpoints of ``role`` its policy chooses from: the rank the client named, else one
        rank per worker by the DP-rank rule (every rank to a policy that scores them itself)."""
        named = named_rank(endpoints, body, role)
        if named is not None:
            return _kept(named, exclude)
        kept = _kept(endpoints, exclude)
        policy = self.prefill_policy if role == "prefill" else self.decode_policy
        return kept if policy.scores_dp_ranks else self.dp_ranks.offer(kept)

    @staticmethod
    def leg_bodies(body: dict, pair: Pair) -> tuple[bytes, bytes]:
        """The JSON bodies for the prefill and the decode leg (the same bytes when no DP ranks)."""
        p, d = pair.prefill, pair.decode
        out = {k: v for k, v in body.items() if k not in ROUTER_FIELDS}
        host, port = p.worker.bootstrap_host, p.worker.bootstrap_port
        if isinstance(pair.room, list):
            n = len(pair.room)
            out["bootstrap_host"], out["bootstrap_port"] = [host] * n, [port] * n
        else:
            out["bootstrap_host"], out["bootstrap_port"] = host, port
        out["bootstrap_room"] = pair.room
        if p.dp_rank is None and d.dp_rank is None:
            data = _encode(out)
            return data, data
        if p.dp_rank is not None:
            out["disagg_prefill_dp_rank"] = p.dp_rank
        prefill_body = dict(out)
        if p.dp_rank is not None:
            prefill_body["routed_dp_rank"] = p.dp_rank
        if d.dp_rank is not None:
            out["routed_dp_rank"] = d.dp_rank
        return _encode(prefill_body), _encode(out)


def _kept(endpoints: list[Endpoint], exclude) -> list[Endpoint]:
    """``endpoints`` less those in ``exclude``, unless that leaves none."""
    if exclude:
        kept = [e for e in endpoints if e.key not in exclude]
        if kept:
            return kept
    return endpoints
