"""The counters a cache benchmark reads from pdserve servers' ``/metrics`` (Prometheus text).

``scrape(url)`` sums each family over its ranks: prompt and cached tokens, hit tokens per tier
(``pdserve_hicache_hit_tokens_total{tier}``), tier moves, and the KV bytes a prefill server sent
to decode ranks (``pdserve_kv_transfer_sent_bytes_total``). ``delta(after, before)`` is what a
run added; a restarted server's counters start again at zero, so a caller scrapes it afresh.
"""

from __future__ import annotations

import re
import urllib.request

FAMILIES = {
    "prompt_tokens": ("pdserve_prompt_tokens_total", None),
    "cached_tokens": ("pdserve_cached_tokens_total", None),
    "host_hit_tokens": ("pdserve_hicache_hit_tokens_total", 'tier="host"'),
    "storage_hit_tokens": ("pdserve_hicache_hit_tokens_total", 'tier="storage"'),
    "kv_sent_bytes": ("pdserve_kv_transfer_sent_bytes_total", None),
    "storage_put_pages": ("pdserve_hicache_move_pages_total", 'direction="host_to_storage"'),
    "storage_get_pages": ("pdserve_hicache_move_pages_total", 'direction="storage_to_host"'),
    "storage_get_seconds": ("pdserve_hicache_move_seconds_total", 'direction="storage_to_host"'),
    "host_load_seconds": ("pdserve_hicache_move_seconds_total", 'direction="host_to_device"'),
    "prefetch_complete": ("pdserve_hicache_prefetch_total", 'outcome="complete"'),
    "prefetch_timeout": ("pdserve_hicache_prefetch_total", 'outcome="timeout"'),
    "prefetch_best_effort": ("pdserve_hicache_prefetch_total", 'outcome="best_effort"'),
}


def parse(text: str) -> dict[str, float]:
    """``FAMILIES``' sums from one /metrics text (0 where a family is absent)."""
    out = {}
    for key, (name, label) in FAMILIES.items():
        total = 0.0
        for labels, value in re.findall(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M):
            if label is None or label in labels:
                total += float(value)
        out[key] = total
    return out


def scrape(url: str, timeout: float = 10.0) -> dict[str, float]:
    with urllib.request.urlopen(url.rstrip("/") + "/metrics", timeout=timeout) as r:
        return parse(r.read().decode())


def delta(after: dict[str, float], before: dict[str, float] | None) -> dict[str, float]:
    return {k: v - (before or {}).get(k, 0.0) for k, v in after.items()}


def total(counters: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in counters:
        for k, v in c.items():
            out[k] = out.get(k, 0.0) + v
    return out
