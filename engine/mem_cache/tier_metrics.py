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
  failed), ``corrupt`` (bad objects: length, token hash, checksum; deleted), ``dropped_put`` (writes
  skipped while the store was down or behind).
- ``pdserve_hicache_host_pages{state}``: the host tier's ``used`` and ``total`` pages.
"""

from __future__ import annotations

from pdserve.engine.messages import MetricFamily, MetricSample


def _counter(name: str, doc: str, label: str, values: dict[str, float]) -> MetricFamily:
    return MetricFamily(name, "counter", doc,
                        [MetricSample(name + "_total", {label: k}, float(v)) for k, v in values.items()])


PREFETCH_OUTCOMES = ("complete", "best_effort", "timeout", "cancelled")
DIRECTIONS = ("device_to_host", "host_to_device", "host_to_storage", "storage_to_host")


def hicache_families(cache) -> list[MetricFamily]:
    """The families of a ``HiRadixCache`` (with a storage tier: ``StoreHiRadixCache``), at 0 for
    the tiers a cache does not have (so a dashboard's panels read 0, not "no data", on a server
    without the hierarchy)."""
    stats = getattr(cache, "stats", None)
    host = getattr(cache, "host", None)
    storage = getattr(cache, "storage", None)
    hits = dict.fromkeys(("host", "storage"), 0.0)
    pages = dict.fromkeys(DIRECTIONS, 0.0)
    seconds = dict.fromkeys(DIRECTIONS, 0.0)
    outcomes = dict.fromkeys(PREFETCH_OUTCOMES, 0.0)
    errors = dict.fromkeys(("unreachable", "corrupt", "dropped_put"), 0.0)
    slot, used, total = 0, 0, 0
    if stats is not None and host is not None:
        ps, slot, used, total = cache.page_size, host.slot_bytes, host.num_used, host.capacity
        hits |= {"host": stats.host_hit_pages * ps, "storage": stats.store_hit_pages * ps}
        pages |= {"device_to_host": stats.host_write_pages,
                  "host_to_device": stats.host_hit_pages + stats.store_hit_pages}
        seconds |= {"device_to_host": stats.host_write_s, "host_to_device": stats.host_read_s}
        if storage is not None:
            s = storage.stats
            pages |= {"host_to_storage": s.put_pages, "storage_to_host": s.get_pages}
            seconds |= {"host_to_storage": s.put_s, "storage_to_host": s.get_s}
            outcomes |= cache.prefetch_outcomes
            errors |= {"unreachable": s.errors, "corrupt": s.corrupt, "dropped_put": s.dropped_puts}
    return [
        _counter("pdserve_hicache_prefetch", "Storage prefetches by how they ended.", "outcome", outcomes),
        _counter("pdserve_hicache_storage_errors", "Storage tier failures (none fails a request).", "kind", errors),
        _counter("pdserve_hicache_hit_tokens", "Prompt tokens loaded from a lower tier instead of computed.",
                 "tier", hits),
        _counter("pdserve_hicache_move_pages", "Pages copied between the cache's tiers.", "direction", pages),
        _counter("pdserve_hicache_move_bytes", "Bytes copied between the cache's tiers.", "direction",
                 {k: v * slot for k, v in pages.items()}),
        _counter("pdserve_hicache_move_seconds", "Seconds spent copying between the cache's tiers.",
                 "direction", seconds),
        MetricFamily("pdserve_hicache_host_pages", "gauge", "Pages of the host tier, used and total.", [
            MetricSample("pdserve_hicache_host_pages", {"state": "used"}, float(used)),
            MetricSample("pdserve_hicache_host_pages", {"state": "total"}, float(total)),
        ]),
    ]
