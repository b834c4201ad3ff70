"""The scheduler credits each request with the prompt tokens its first admission took from each
tier of the hierarchical cache (host tier here; the storage tier's loads are counted alike), the
figures the ``server.request`` span reports. The real
scheduler over a real page pool and host tier, with the deterministic stand-in model. The exported
spans of a 1P1D stand: ``tests/pd/test_trace_cache_tiers.py``."""

from __future__ import annotations

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.mem_cache.hiradix_cache import HiRadixCache
from pdserve.engine.mem_cache.host_pool import HostKVPool
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sched.request import Req
from pdserve.engine.sched.scheduler import Scheduler

from support.loop_stand import PS, reference
from test_priority_scheduler import TokenModel

PROMPT = list(range(100, 113))  # 13 tokens: 3 whole pages cacheable, the last token computed


def run(sched: Scheduler, model: TokenModel, req: Req) -> None:
    assert sched.add(req) is None
    while sched.has_work():
        batch = sched.schedule()
        sched.postprocess(batch, model(batch))
        sched.check_integrity()
    assert req.output_ids == reference(req.input_ids, req.sampling_params.max_new_tokens)


def req(rid: str, prompt: list[int]) -> Req:
    return Req(rid, prompt, SamplingParams(max_new_tokens=2, temperature=0.0))


def test_first_admission_counts_host_tier_loads():
    pool = PagePool(16, PS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)
    cache = HiRadixCache(pool, HostKVPool(pool, 32))
    sched = Scheduler(EngineConfig(page_size=PS, num_reserved_decode_tokens=0), pool, cache)
    model = TokenModel(pool)

    first = req("a1", PROMPT)
    run(sched, model, first)
    assert (first.cached_tokens, first.host_hit_tokens, first.storage_hit_tokens) == (0, 0, 0)

    pooled = req("a2", PROMPT)
    run(sched, model, pooled)
    assert (pooled.cached_tokens, pooled.host_hit_tokens) == (12, 0)  # from the KV pool

    cache.evict(cache.evictable_pages)  # out of the pool; write-through kept the host copies
    hosted = req("a3", PROMPT)
    run(sched, model, hosted)
    assert (hosted.cached_tokens, hosted.host_hit_tokens, hosted.storage_hit_tokens) == (12, 12, 0)

    other = req("b", list(range(300, 313)))
    run(sched, model, other)
    assert (other.cached_tokens, other.host_hit_tokens) == (0, 0)
    assert sched.free_pages() == pool.capacity
