"""Build the prefix cache an engine config asks for: none, the radix tree, or the tiered tree."""

from __future__ import annotations

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.radix_cache import PrefixCache, make_prefix_cache


def make_cache(pool: PagePool, config: EngineConfig, model_path: str = "", kv_start: int = 0) -> PrefixCache:
    """``model_path`` and ``kv_start`` (the first KV head this TP rank holds) name the storage
    tier's namespace (storage_key.py); only a storage tier reads them."""
    if not config.enable_hierarchical_cache:
        return make_prefix_cache(pool, config.disable_radix_cache)
    from pdserve.engine.mem_cache.hiradix_cache import HiRadixCache
    from pdserve.engine.mem_cache.host_pool import HostKVPool

    slots = HostKVPool.slots_for(pool, config.hicache_ratio, config.hicache_size)
    if slots < 1:
        raise ValueError(f"hicache_size {config.hicache_size} GiB holds no page of the KV pool")
    host = HostKVPool(pool, slots)
    if config.hicache_storage_backend is None:
        return HiRadixCache(pool, host, config.hicache_write_policy)
    from pdserve.engine.mem_cache.storage_backend import create_storage_backend, parse_extra_config
    from pdserve.engine.mem_cache.storage_key import kv_namespace
    from pdserve.engine.mem_cache.storage_object import ObjectCodec, load_store_key
    from pdserve.engine.mem_cache.storage_worker import StorageWorker
    from pdserve.engine.mem_cache.store_cache import StoreHiRadixCache

    extra = parse_extra_config(config.hicache_storage_backend_extra_config)
    name = config.hicache_storage_backend
    codec = ObjectCodec(load_store_key(extra["key_file"]) if extra.get("key_file") else None)
    worker = StorageWorker(lambda: create_storage_backend(name, extra), host.slot_bytes, codec)
    return StoreHiRadixCache(pool, host, config.hicache_write_policy, worker,
                             kv_namespace(model_path, pool.layout(), kv_start),
                             config.hicache_storage_prefetch_policy, extra)
