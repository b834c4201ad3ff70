"""SGLang's cache-aware routing over an approximate prefix tree."""

from __future__ import annotations

from pdserve.router.config import RouterConfig
from pdserve.router.policy import Policy
from pdserve.router.kv.prefix_tree import PrefixTree

_DEFAULTS = RouterConfig()  # the knobs' defaults are RouterConfig's (the CLI's), written there once


class CacheAwarePolicy(Policy):
    """Balanced load: the endpoint that was sent the longest prefix of this prompt
    wins when the match covers more than ``cache_threshold`` of it; otherwise
    the endpoint with the smallest tree (the most room in its cache). When the
    load is imbalanced (max - min > abs threshold AND max > min * rel
    threshold) the least loaded endpoint wins regardless of cache.
    """

    needs_text = True

    def __init__(self, cache_threshold: float = _DEFAULTS.cache_threshold,
                 balance_abs_threshold: int = _DEFAULTS.balance_abs_threshold,
                 balance_rel_threshold: float = _DEFAULTS.balance_rel_threshold,
                 max_tree_size: int = _DEFAULTS.max_tree_size):
        self.cache_threshold = cache_threshold
        self.abs_threshold = balance_abs_threshold
        self.rel_threshold = balance_rel_threshold
        self.tree = PrefixTree(max_tree_size)

    @classmethod
    def from_config(cls, config: RouterConfig) -> CacheAwarePolicy:
        return cls(config.cache_threshold, config.balance_abs_threshold, config.balance_rel_threshold,
                   config.max_tree_size)

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

    def _by_cache(self, endpoints, text: str):
        by_key = {e.key: e for e in endpoints}
        if text:
            matched, tenant = self.tree.match(text, by_key.keys())
            if tenant is not None and matched / len(text) > self.cache_threshold:
                return by_key[tenant]
        sizes = self.tree.sizes
        return min(endpoints, key=lambda e: (sizes.get(e.key, 0), e.load))

    def forget(self, key):
        self.tree.remove_tenant(key)
