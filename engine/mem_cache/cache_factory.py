"""Build the prefix cache an engine config asks for: none, the radix tree, or the tiered tree."""

from __future__ import annotations

from pdserve.engine.config import EngineConfig
from pdserve.engine.sched.page_pool import PagePool
from pdserve.engine.sched.radix_cache import PrefixCache, make_prefix_cache


def make_cache(pool: PagePool, config: EngineConfig) -> PrefixCache:
    if not config.enable_hierarchical_cache:
        return make_prefix_cache(pool, config.disable_radix_cache)
    from pdserve.engine.mem_cache.hiradix_cache import HiRadixCache
    from pdserve.engine.mem_cache.host_pool import HostKVPool

    slots = HostKVPool.slots_for(pool, config.hicache_ratio, config.hicache_size)
    if slots < 1:
        raise ValueError(f"hicache_size {config.hicache_size} GiB holds no page of the KV pool")
    return HiRadixCache(pool, HostKVPool(pool, slots), config.hicache_write_policy)
