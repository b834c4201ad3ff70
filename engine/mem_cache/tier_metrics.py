"""The hierarchical cache's Prometheus families, as a rank sends them (``RankMetrics``).

- ``pdserve_hicache_hit_tokens_total{tier}``: prompt tokens a match found in the
  host tier (``host``) or that the storage tier prefetched (``storage``), loaded
  into the KV pool instead of computed. The KV pool's own hits are
  ``pdserve_cached_tokens_total`` minus these (that counter keeps meaning every
  prompt token not computed, whichever tier it came from).
- ``pdserve_hicache_move_bytes_total{direction}`` and
  ``pdserve_hicache_move_seconds_total{direction}``: the bytes and the time of
  the tiers' copies (``device_to_host``, ``host_to_device``, ``host_to_storage``,
  ``storage_to_host``); their ratio is the bandwidth, over
  ``pdserve_hicache_move_pages_total`` the latency per page.
- ``pdserve_hicache_prefetch_total{outcome}``: prefetches ended ``complete``
  (fetched before admission), ``best_effort`` / ``timeout`` (admitted before),
  ``cancelled`` (the request ended first).
- ``pdserve_hicache_storage_errors_total{kind}``: ``unreachable`` (backend calls
  failed), ``corrupt`` (objects of the wrong length), ``dropped_put`` (writes
  skipped while the store was down or behind).
- ``pdserve_hicache_host_pages{state}``: the host tier's ``used`` and ``total`` pages.
"""

from __future__ import annotations

from pdserve.engine.messages import MetricFamily, MetricSample


def _counter(name: str, doc: str, label: str, values: dict[str, float]) -> MetricFamily:
    return MetricFamily(name, "counter", doc,
                        [MetricSample(name + "_total", {label: k}, float(v)) for k, v in values.items()])


def hicache_families(cache) -> list[MetricFamily]:
    """The families of a ``HiRadixCache`` (with a storage tier: ``StoreHiRadixCache``); [] otherwise."""
    stats = getattr(cache, "stats", None)
    host = getattr(cache, "host", None)
    if stats is None or host is None:
        return []
    ps, slot = cache.page_size, host.slot_bytes
    loaded = stats.host_hit_pages + stats.store_hit_pages
    hits = {"host": stats.host_hit_pages * ps, "storage": stats.store_hit_pages * ps}
    pages = {"device_to_host": stats.host_write_pages, "host_to_device": loaded}
    seconds = {"device_to_host": stats.host_write_s, "host_to_device": stats.host_read_s}
    families = []
    storage = getattr(cache, "storage", None)
    if storage is not None:
        s = storage.stats
        pages |= {"host_to_storage": s.put_pages, "storage_to_host": s.get_pages}
        seconds |= {"host_to_storage": s.put_s, "storage_to_host": s.get_s}
        families += [
            _counter("pdserve_hicache_prefetch", "Storage prefetches by how they ended.", "outcome",
                     cache.prefetch_outcomes),
            _counter("pdserve_hicache_storage_errors", "Storage tier failures (none fails a request).", "kind",
                     {"unreachable": s.errors, "corrupt": s.corrupt, "dropped_put": s.dropped_puts}),
        ]
    families += [
        _counter("pdserve_hicache_hit_tokens", "Prompt tokens loaded from a lower tier instead of computed.",
                 "tier", hits),
        _counter("pdserve_hicache_move_pages", "Pages copied between the cache's tiers.", "direction", pages),
        _counter("pdserve_hicache_move_bytes", "Bytes copied between the cache's tiers.", "direction",
                 {k: v * slot for k, v in pages.items()}),
        _counter("pdserve_hicache_move_seconds", "Seconds spent copying between the cache's tiers.",
                 "direction", seconds),
        MetricFamily("pdserve_hicache_host_pages", "gauge", "Pages of the host tier, used and total.", [
            MetricSample("pdserve_hicache_host_pages", {"state": "used"}, float(host.num_used)),
            MetricSample("pdserve_hicache_host_pages", {"state": "total"}, float(host.capacity)),
        ]),
    ]
    return families
