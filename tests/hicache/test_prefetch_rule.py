"""The default prefetch policy waits for the store when fetching is cheaper than computing, as long
as computing would take, and not at all when fetching costs more; the costs follow measurements."""

from __future__ import annotations

import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.file_storage import FileStorage
from pdserve.engine.mem_cache.host_pool import HostKVPool
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.prefetch_rule import TierCosts
from pdserve.engine.mem_cache.storage_key import kv_namespace
from pdserve.engine.mem_cache.storage_worker import StorageWorker
from pdserve.engine.mem_cache.store_cache import StoreHiRadixCache

from test_hiradix_cache import PS, put
from test_store_cache import settle


def test_rule():
    costs = TierCosts(fetch_s_per_page=0.001, compute_s_per_token=0.01)
    assert costs.wait_s(3, 16) == 3 * 0.16  # cheaper to fetch: wait as long as computing would take
    costs = TierCosts(fetch_s_per_page=0.5, compute_s_per_token=0.01)
    assert costs.wait_s(3, 16) == 0.0  # dearer to fetch: compute at once
    for _ in range(50):
        costs.observe_fetch(0.003, 3)  # the store got fast
    assert costs.fetch_s_per_page < 0.16 and costs.wait_s(3, 16) > 0
    costs.observe_compute(0.0, 0)  # no tokens: ignored
    assert costs.compute_s_per_token == 0.01


def test_default_policy_is_the_rule():
    assert EngineConfig().hicache_storage_prefetch_policy == "timeout"


class SlowFile(FileStorage):
    def get(self, key):
        time.sleep(0.05)
        return super().get(key)


def _cache(path: str, backend=FileStorage) -> tuple[PagePool, StoreHiRadixCache]:
    pool = PagePool(9, PS, num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32)
    host = HostKVPool(pool, 16)
    worker = StorageWorker(lambda: backend({"path": path}), host.slot_bytes)
    return pool, StoreHiRadixCache(pool, host, "write_through", worker, kv_namespace("/m", pool.layout(), 0))


def test_an_idle_server_waits_for_a_cheap_fetch_and_not_for_a_dear_one(tmp_path):
    pool_a, a = _cache(str(tmp_path))
    tokens = list(range(100, 113))  # 3 pages + 1
    put(a, pool_a, tokens)
    settle(a)

    _, b = _cache(str(tmp_path), SlowFile)  # 50 ms a page to fetch; computing a page: 1.6 s
    b.costs = TierCosts(fetch_s_per_page=0.05, compute_s_per_token=0.1)
    b.start_prefetch("r", tokens)
    assert not b.prefetch_ready("r")  # held: the fetch is the cheaper way to these pages
    settle(b, "r")
    assert b.prefetch_outcomes["complete"] == 1 and len(b.match_prefix(tokens)[0]) == 3

    _, c = _cache(str(tmp_path), SlowFile)
    c.costs = TierCosts(fetch_s_per_page=0.05, compute_s_per_token=0.001)  # computing a page: 16 ms
    c.start_prefetch("r", tokens)
    assert c.prefetch_ready("r") and c.prefetch_outcomes["timeout"] == 1  # not held
    for x in (a, b, c):
        x.close()
