"""The host tier's load (L2 -> L1 copy) against the step that needs it, on the offline Engine.

Whether loading host pages per layer, overlapped with the step's compute, is worth doing on CPU:
at most it hides the copy. For histories of 256, 512 and 1024 tokens: prefill the history, push
it out to host memory with an unrelated long prompt, then send history + 64 new tokens (its pages
load back from host memory) and, for comparison, a fresh prompt of the same length. Reported
(median of 3): pages loaded, the copy's time (the cache's ``host_read_s``), the request's time,
their ratio, and the fresh prompt's time.

    .venv/bin/python scripts/bench_hicache_load.py
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time

from pdserve.engine import Engine

GEN = {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True}


def main() -> int:
    rng = random.Random(1)

    def ids(n: int) -> list[int]:
        return [rng.randrange(1000, 20000) for _ in range(n)]

    rows = []
    load = os.getloadavg()[0]
    with Engine(max_total_tokens=1200, num_threads=1, page_size=16, enable_hierarchical_cache=True,
                hicache_ratio=8.0, num_reserved_decode_tokens=8, rank_on_thread=True) as e:
        cache = e.loop.cache
        e.generate(input_ids=ids(32), sampling_params=GEN)  # warm-up
        for hist in (256, 512, 1024):
            for _ in range(3):
                history, new = ids(hist), ids(64)
                e.generate(input_ids=history, sampling_params=GEN)
                e.generate(input_ids=ids(1100), sampling_params=GEN)  # the history leaves the pool for host memory
                r0, p0 = e.call(lambda: (cache.stats.host_read_s, cache.stats.host_hit_pages))
                t0 = time.perf_counter()
                e.generate(input_ids=history + new, sampling_params=GEN)
                step = time.perf_counter() - t0
                r1, p1 = e.call(lambda: (cache.stats.host_read_s, cache.stats.host_hit_pages))
                t0 = time.perf_counter()
                e.generate(input_ids=ids(hist + 64), sampling_params=GEN)
                fresh = time.perf_counter() - t0
                rows.append({"history": hist, "pages": p1 - p0, "copy_ms": (r1 - r0) * 1e3, "request_ms": step * 1e3,
                             "fresh_ms": fresh * 1e3})
    out = []
    for hist in (256, 512, 1024):
        rs = [r for r in rows if r["history"] == hist]
        med = {k: statistics.median(r[k] for r in rs) for k in ("pages", "copy_ms", "request_ms", "fresh_ms")}
        med["copy_over_request"] = med["copy_ms"] / med["request_ms"]
        out.append({"history": hist, **{k: round(v, 3) for k, v in med.items()}})
        print(f"history {hist}: {med['pages']:.0f} pages loaded in {med['copy_ms']:.1f} ms; the request (64 new "
              f"tokens) {med['request_ms']:.0f} ms; copy/request {med['copy_over_request']:.3f}; the same length "
              f"computed from scratch {med['fresh_ms']:.0f} ms")
    print(json.dumps({"bench": "hicache_load", "load_avg_start": round(load, 2),
                      "load_avg_end": round(os.getloadavg()[0], 2), "rows": out}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
