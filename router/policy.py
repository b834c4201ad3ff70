"""Routing policies: choose one endpoint (worker or worker DP rank) for a leg.

A policy is pure logic over ``Endpoint`` objects (``key`` and ``load``), so it
is tested without sockets. Policies are registered by name in ``POLICIES``;
the names are the CLI choices of ``--policy``, ``--prefill-policy`` and
``--decode-policy``.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Sequence

from pdserve.router.config import RouterConfig
from pdserve.router.prefix_tree import PrefixTree
from pdserve.router.worker_registry import Endpoint


class Policy(ABC):
    #: True when ``select`` uses the request text (only then does the router extract it)
    needs_text: bool = False

    @abstractmethod
    def select(self, endpoints: Sequence[Endpoint], text: str | None) -> Endpoint:
        """Choose one of ``endpoints`` (never empty) for a request whose prompt text is ``text``
        (None unless ``needs_text``); may record the choice (cache-aware trees)."""

    def forget(self, key: str) -> None:
        """Drop any state kept for the endpoint ``key`` (its worker was removed)."""


class RandomPolicy(Policy):
    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()

    def select(self, endpoints, text):
        return endpoints[self._rng.randrange(len(endpoints))]


class RoundRobinPolicy(Policy):
    def __init__(self):
        self._next = 0

    def select(self, endpoints, text):
        i = self._next % len(endpoints)
        self._next = i + 1
        return endpoints[i]


class PowerOfTwoPolicy(Policy):
    """Two random candidates; the one with fewer requests in flight (per worker and DP rank)."""

    def __init__(self, rng: random.Random | None = None):
        self._rng = rng or random.Random()

    def select(self, endpoints, text):
        n = len(endpoints)
        if n == 1:
            return endpoints[0]
        i, j = self._rng.sample(range(n), 2)
        a, b = endpoints[i], endpoints[j]
        return b if b.load < a.load else a


class CacheAwarePolicy(Policy):
    """SGLang's cache-aware routing over an approximate prefix tree.

    Balanced load: the endpoint that was sent the longest prefix of this prompt
    wins when the match covers more than ``cache_threshold`` of it; otherwise
    the endpoint with the smallest tree (the most room in its cache). When the
    load is imbalanced (max - min > abs threshold AND max > min * rel
    threshold) the least loaded endpoint wins regardless of cache.
    """

    needs_text = True

    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, max_tree_size: int = 2**26):
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.tree = PrefixTree(max_tree_size)

    def select(self, endpoints, text):
        if len(endpoints) == 1:
            chosen = endpoints[0]
        else:
            loads = [e.load for e in endpoints]
            lo, hi = min(loads), max(loads)
            if hi - lo > self.abs_threshold and hi > lo * self.rel_threshold:
                chosen = endpoints[loads.index(lo)]
            else:
                chosen = self._by_cache(endpoints, text or "")
        if text:
            self.tree.insert(text, chosen.key)
        return chosen

    def _by_cache(self, endpoints, text: str) -> Endpoint:
        by_key = {e.key: e for e in endpoints}
        if text:
            matched, tenant = self.tree.match(text, by_key.keys())
            if tenant is not None and matched / len(text) > self.cache_threshold:
                return by_key[tenant]
        sizes = self.tree.sizes
        return min(endpoints, key=lambda e: (sizes.get(e.key, 0), e.load))

    def forget(self, key):
        self.tree.remove_tenant(key)


POLICIES: dict[str, type[Policy]] = {
    "random": RandomPolicy,
    "round_robin": RoundRobinPolicy,
    "power_of_two": PowerOfTwoPolicy,
    "cache_aware": CacheAwarePolicy,
}


def make_policy(name: str, config: RouterConfig) -> Policy:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choices: {sorted(POLICIES)}")
    if name == "cache_aware":
        return CacheAwarePolicy(config.cache_threshold, config.balance_abs_threshold,
                                config.balance_rel_threshold, config.max_tree_size)
    return POLICIES[name]()
