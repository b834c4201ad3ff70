"""The tiers' counters reach /metrics' text through a rank's RankMetrics."""

from __future__ import annotations

from pdserve.engine.frontend.metrics import ServerMetrics
from pdserve.engine.mem_cache.tier_metrics import hicache_families
from pdserve.engine.messages import RankMetrics

from test_hiradix_cache import make, put


def test_host_hits_and_moves_are_exported():
    pool, cache = make()
    tokens = list(range(12))  # 3 pages
    put(cache, pool, tokens)
    cache.evict(3)
    cache.match_prefix(tokens)
    text = ServerMetrics(1, "m").render([None], [0], {(0, 0): RankMetrics(0, 0, hicache_families(cache))})
    lines = set(text.splitlines())
    labels = 'model_name="m",dp_rank="0",tp_rank="0"'
    assert f'pdserve_hicache_hit_tokens_total{{{labels},tier="host"}} 12.0' in lines
    slot = cache.host.slot_bytes
    assert f'pdserve_hicache_move_bytes_total{{{labels},direction="device_to_host"}} {3.0 * slot}' in lines
    assert f'pdserve_hicache_move_bytes_total{{{labels},direction="host_to_device"}} {3.0 * slot}' in lines
    assert f'pdserve_hicache_host_pages{{{labels},state="used"}} 3.0' in lines
