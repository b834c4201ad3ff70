"""What a cached page is worth in each tier against computing it: the measure behind kv_aware's weights.

One colocated offline Engine (the default model, hierarchical cache with the
``file`` store, ``wait_complete`` prefetch) answers one-token requests for
prompts of ``--prompt-len`` random token ids, each prompt's pages sitting in:

  cold    no tier (a fresh prompt): every page computed
  pool    the KV pool (the same prompt again): nothing computed but the last token
  host    host memory only (the pool evicted): each page copied back first
  store   the store only (pool and host flushed): each page fetched, then copied

Each is timed ``--repeats`` times (median end-to-end latency). A tier's worth is
``1 - (t_tier - t_pool) / (t_cold - t_pool)``: the share of the compute a hit
there saves (the pool's is 1 by construction). On a busy machine the end-to-end
differences drown in noise, so the cache's own timers of the moves (the copy
from host memory, the store's fetch: ``TierStats.host_read_s``,
``StorageStats.get_s``) are also reported per page, against the compute per
page; the last line prints both estimates.

    .venv/bin/python scripts/bench_tier_costs.py --prompt-len 512 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from pdserve.engine import Engine


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p


def timed(engine: Engine, prompt: list[int], want_cached: int | None) -> float:
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0.0})
    cached = out["meta_info"]["cached_tokens"]
    if want_cached is not None and cached < want_cached:
        raise SystemExit(f"expected {want_cached} cached tokens, got {cached}: the tier did not serve")
    return out["meta_info"]["e2e_latency"]


def main() -> None:
    args = build_parser().parse_args()
    rng = random.Random(args.seed)
    page = 16
    full = (args.prompt_len - 1) // page * page  # the pages a hit can serve (the last token is computed)
    times: dict[str, list[float]] = {k: [] for k in ("cold", "pool", "host", "store")}
    with tempfile.TemporaryDirectory() as path:
        flags = dict(enable_hierarchical_cache=True, hicache_ratio=4.0, hicache_storage_backend="file",
                     hicache_storage_prefetch_policy="wait_complete",
                     hicache_storage_backend_extra_config=json.dumps({"path": path}),
                     max_total_tokens=4096, num_threads=args.num_threads, page_size=page,
                     rank_on_thread=True)
        with Engine(**flags) as engine:
            def evict_pool():
                c = engine.loop.cache
                c.evict(c.evictable_pages)

            def puts_done() -> bool:
                return engine.loop.cache.storage.idle()

            def timers() -> tuple[float, float, int, int]:
                c = engine.loop.cache
                return c.stats.host_read_s, c.storage.stats.get_s, c.stats.host_hit_pages, c.storage.stats.get_pages

            moves = {"host": [0.0, 0], "store": [0.0, 0]}  # seconds and pages of the loads, per tier

            timed(engine, [rng.randrange(1000, 20000) for _ in range(64)], None)  # warm-up
            for _ in range(args.repeats):
                prompt = [rng.randrange(1000, 20000) for _ in range(args.prompt_len)]
                times["cold"].append(timed(engine, prompt, None))
                times["pool"].append(timed(engine, prompt, full))
                engine.call(evict_pool)
                read0, _, hits0, _ = engine.call(timers)
                times["host"].append(timed(engine, prompt, full))
                read1, get1, hits1, got1 = engine.call(timers)
                moves["host"][0] += read1 - read0
                moves["host"][1] += hits1 - hits0
                while not engine.call(puts_done):
                    time.sleep(0.05)
                time.sleep(0.1)  # the last put may still be writing
                engine.flush_cache()
                times["store"].append(timed(engine, prompt, full))
                read2, get2, _, got2 = engine.call(timers)
                moves["store"][0] += (get2 - get1) + (read2 - read1)  # fetch, then the copy into the pool
                moves["store"][1] += got2 - got1
    med = {k: statistics.median(v) for k, v in times.items()}
    compute = med["cold"] - med["pool"]
    per_page = compute / (full // page)
    worth = {k: 1 - (med[k] - med["pool"]) / compute for k in ("host", "store")}
    for k, v in times.items():
        print(f"{k:<6} median {med[k] * 1000:8.1f} ms  runs {', '.join(f'{t * 1000:.1f}' for t in v)}")
    load = {k: s / max(n, 1) for k, (s, n) in moves.items()}
    for k in ("host", "store"):
        print(f"{k:<6} load {load[k] * 1000:.3f} ms a page ({moves[k][1]} pages) against {per_page * 1000:.1f} ms "
              f"of compute a page")
    print(f"prompt {args.prompt_len} tokens ({full // page} pages): compute {compute * 1000:.1f} ms; "
          f"worth end-to-end host {worth['host']:.3f} store(file) {worth['store']:.3f}; "
          f"by the move timers host {1 - load['host'] / per_page:.4f} store(file) {1 - load['store'] / per_page:.4f}")


if __name__ == "__main__":
    main()
