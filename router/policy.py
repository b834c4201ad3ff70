"""The routing policy interface and its registry.

A policy chooses one endpoint (a worker, or one DP rank of it) for a leg. It is
pure logic over candidates that have a ``key`` and a ``load`` (the router's
``worker_registry.Endpoint``), so it is tested without sockets. ``POLICIES``
names each one; the names are the CLI choices of ``--policy``,
``--prefill-policy`` and ``--decode-policy`` and what ``RouterConfig`` accepts.
Adding a policy: a ``Policy`` subclass in its own module and one line here.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Callable, Protocol, Sequence, TypeVar

from pdserve.router.route import LocalRule, Route, RouteQuery


class Candidate(Protocol):
    """What a policy sees of an endpoint."""

    key: str  # stable name: the worker's URL, with ``@rank`` for a DP rank
    load: int  # requests the router has in flight on it


C = TypeVar("C", bound=Candidate)


class Policy(ABC):
    """Chooses an endpoint per leg; one instance per role (prefill, decode) for the router's life."""

    #: True when ``select`` uses the request text (only then does the router extract it)
    needs_text: bool = False
    #: True when the policy tokenizes prompts (its ``encoder`` answers once its tokenizer is loaded)
    tokenizes: bool = False
    #: True when the policy weighs each DP rank of a worker itself (kv_aware: by the blocks each rank
    #: holds); otherwise the router offers it one rank per worker (router/workers/dp_rank_choice.py)
    scores_dp_ranks: bool = False

    @classmethod
    def from_config(cls, config) -> Policy:
        """Build the policy from the router's ``RouterConfig`` (the knobs it reads, if any)."""
        return cls()

    @abstractmethod
    def select(self, endpoints: Sequence[C], text: str | None) -> C:
        """Choose one of ``endpoints`` (never empty) for a request whose prompt text is ``text``
        (None unless ``needs_text``); may record the choice (cache-aware trees)."""

    def pick(self, endpoints: Sequence[C], query: RouteQuery) -> C:
        """``select`` for the request ``query``; a policy that reads the token ids (kv_aware)
        overrides this."""
        return self.select(endpoints, query.text)

    def route(self, endpoints: Sequence[C], query: RouteQuery, decode: C,
              local: LocalRule | None = None) -> Route:
        """The one routing decision of the prefill side, given the ``decode`` endpoint already
        chosen: with a ``local`` rule, the prompt tokens ``decode`` would compute itself decide
        whether it prefills the request (then this policy records that its prompt will be
        cached there); otherwise, or when the rule says no, one of ``endpoints`` (empty: no
        prefill endpoint, ``Route.prefill`` stays None) prefills it."""
        whole = query.prompt_tokens
        route = Route(decode, prompt_tokens=whole)
        if local is not None:
            route.uncached_tokens = self.uncached_on(query, decode)
            route.local_reason = local(route.uncached_tokens, whole)
            if route.local_reason is not None:
                self.predict_on(query, decode)
                return route
        if endpoints:
            route.prefill = self.pick(endpoints, query)
        return route

    def uncached_on(self, query: RouteQuery, endpoint: C) -> int | None:
        """The prompt tokens ``endpoint`` would compute to prefill the request itself: the prompt
        less the prefix it holds, where this policy knows it (kv_aware, from the endpoint's own
        KV events), else the whole prompt (None: not tokenized)."""
        return query.prompt_tokens

    def predict_on(self, query: RouteQuery, endpoint: C) -> None:
        """The request went to ``endpoint`` to be prefilled there (kv_aware counts its blocks there)."""

    @property
    def encoder(self) -> Callable[[dict], list[int] | None] | None:
        """How this policy reads a body's prompt into token ids, once it can (kv_aware: its
        tokenizer, once its workers' page size is known); None for a policy that does not
        tokenize. The router tokenizes each request once, with the first encoder it finds."""
        return None

    def prepare(self, endpoints: Sequence[C]) -> None:
        """``endpoints`` are healthy: start what the policy loads about them (kv_aware: the
        tokenizer and their event streams), so it is ready before the first request."""

    @property
    def ready(self) -> bool:
        """False while the policy still loads what it needs to route as configured (kv_aware:
        its tokenizer); the router is not ready until then."""
        return True

    def counts(self) -> dict[str, int]:
        """Events worth a metric (kv_aware: routed by KV, fallbacks, event stream faults); the
        router's /metrics shows them as ``pdserve_router_policy_events_total``."""
        return {}

    def forget(self, key: str) -> None:
        """Drop any state kept for the endpoint ``key`` (its worker was removed)."""

    def close(self) -> None:
        """Stop what the policy runs beside the request path (kv_aware: its event subscriber);
        called once, on router shutdown."""


# name -> "module:Class"; a policy's module is imported only when it is chosen
POLICIES: dict[str, str] = {
    "random": "pdserve.router.simple_policies:RandomPolicy",
    "round_robin": "pdserve.router.simple_policies:RoundRobinPolicy",
    "power_of_two": "pdserve.router.simple_policies:PowerOfTwoPolicy",
    "cache_aware": "pdserve.router.kv.cache_aware_policy:CacheAwarePolicy",
    "kv_aware": "pdserve.router.kv.kv_aware_policy:KVAwarePolicy",
}
POLICY_NAMES = tuple(POLICIES)


def policy_class(name: str) -> type[Policy]:
    """The class registered as ``name``; ValueError naming the choices for an unknown one."""
    try:
        target = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {list(POLICY_NAMES)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def make_policy(name: str, config) -> Policy:
    """A new policy ``name`` set up from ``config`` (the ``RouterConfig``)."""
    return policy_class(name).from_config(config)
