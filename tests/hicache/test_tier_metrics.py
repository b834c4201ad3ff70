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


def test_a_cache_without_tiers_exports_every_family_at_zero():
    """The dashboard plots these families on every server: a plain radix cache gives them at 0."""
    from pdserve.engine.mem_cache.radix_cache import RadixCache

    pool, _ = make()
    families = {f.name: f for f in hicache_families(RadixCache(pool))}
    assert set(families) == {"pdserve_hicache_prefetch", "pdserve_hicache_storage_errors",
                             "pdserve_hicache_hit_tokens", "pdserve_hicache_move_pages",
                             "pdserve_hicache_move_bytes", "pdserve_hicache_move_seconds", "pdserve_hicache_host_pages"}
    assert all(s.value == 0.0 for f in families.values() for s in f.samples)
    assert {s.labels["tier"] for s in families["pdserve_hicache_hit_tokens"].samples} == {"host", "storage"}
