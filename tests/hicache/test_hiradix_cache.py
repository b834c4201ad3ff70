"""The tiered radix cache: L1 (KV pool) and L2 (host) kept consistent with the tree, KV bytes intact."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.mem_cache.hiradix_cache import HiRadixCache
from pdserve.engine.mem_cache.host_pool import HostKVPool
from pdserve.engine.mem_cache.kv_events import BlockRemoved, BlockStored
from pdserve.engine.mem_cache.page_pool import PagePool

PS = 4


def make(num_pages=9, host_slots=16, policy="write_through"):
    pool = PagePool(num_pages, PS, num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32)
    return pool, HiRadixCache(pool, HostKVPool(pool, host_slots), policy)


def fill(pool: PagePool, pages: list[int], tokens: list[int]) -> None:
    """Write KV that is a function of the token and its position, as a model would."""
    for i, p in enumerate(pages):
        for layer in range(pool.num_layers):
            for off in range(PS):
                pos = i * PS + off
                tok = tokens[pos] if pos < len(tokens) else -1
                pool.k[layer][:, p, off] = tok * 1000 + pos * 10 + layer
                pool.v[layer][:, p, off] = -(tok * 1000 + pos * 10 + layer)


def assert_kv(pool: PagePool, pages: list[int], tokens: list[int]) -> None:
    for i, p in enumerate(pages):
        for layer in range(pool.num_layers):
            for off in range(PS):
                pos = i * PS + off
                want = tokens[pos] * 1000 + pos * 10 + layer
                assert torch.all(pool.k[layer][:, p, off] == want), (i, layer, off)
                assert torch.all(pool.v[layer][:, p, off] == -want), (i, layer, off)


def put(cache: HiRadixCache, pool: PagePool, tokens: list[int]) -> list[int]:
    """A finished request: match, allocate and compute the rest, hand the KV to the cache."""
    pages, node = cache.match_prefix(tokens)
    assert_kv(pool, pages, tokens)
    cache.lock(node)
    short = pool.pages_for(len(tokens)) - len(pages) - pool.num_free
    if short > 0:
        cache.evict(short)
    new = pool.alloc(pool.pages_for(len(tokens)) - len(pages))
    fill(pool, new, tokens[len(pages) * PS:])
    # fill wrote positions relative to the new pages: rewrite them at their absolute positions
    fill(pool, pages + new, tokens)
    cache.insert(tokens, pages + new, len(pages))
    cache.unlock(node)
    cache.check_integrity()
    pool.check_integrity()
    return pages


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_evicted_pages_come_back_from_host_with_their_bytes(policy):
    pool, cache = make(policy=policy)
    a = list(range(100, 112))  # 3 pages
    put(cache, pool, a)
    if policy == "write_through_selective":
        put(cache, pool, a)  # a second hit marks the pages hot: backed up now
    assert cache.evict(3) == 3 and pool.num_used == 0
    assert cache.num_host_pages == 3
    pages, node = cache.match_prefix(a + [1])
    assert len(pages) == 3 and cache.stats.host_hit_pages == 3
    assert_kv(pool, pages, a)
    cache.check_integrity()


def test_write_through_selective_drops_pages_hit_once():
    pool, cache = make(policy="write_through_selective")
    put(cache, pool, list(range(8)))
    assert cache.num_host_pages == 0
    cache.evict(2)
    assert cache.match_prefix(list(range(8)))[0] == [] and cache.stats.host_hit_pages == 0
    cache.check_integrity()


def test_write_back_copies_only_on_eviction():
    pool, cache = make(policy="write_back")
    put(cache, pool, list(range(8)))
    assert cache.num_host_pages == 0
    cache.evict(1)  # the leaf goes to host; its parent stays in L1
    assert cache.num_host_pages == 1 and cache.num_pages == 1
    cache.check_integrity()


def test_host_full_drops_least_recent_and_load_needs_pool_room():
    pool, cache = make(num_pages=5, host_slots=4)  # L1: 4 pages, L2: 4 slots
    a, b = [1] * 8, [2] * 8
    put(cache, pool, a)
    put(cache, pool, b)
    assert cache.num_host_pages == 4
    cache.evict(4)
    assert cache.num_pages == 0 and cache.num_host_pages == 4
    cache.match_prefix(b)  # b loads back and is most recent
    c = [3] * 8
    put(cache, pool, c)  # needs 2 host slots: a's (least recent, host-only) go
    assert cache.match_prefix(a)[0] == []
    # every pool page locked: a host hit cannot load, only the L1 part matches
    cache.evict(100)
    _, nb = cache.match_prefix(b)
    cache.lock(nb)
    pages, nc = cache.match_prefix(c)
    cache.lock(nc)
    pool.alloc(pool.num_free)
    cache.evict(100)
    d_pages, _ = cache.match_prefix(b)
    assert len(d_pages) == 2
    cache.check_integrity()


def test_events_name_the_tier():
    pool, cache = make()
    cache.enable_events()
    a = list(range(8))
    put(cache, pool, a)
    cache.evict(2)
    cache.match_prefix(a)
    kinds = [(type(e), e.medium) for e in cache.drain_events()]
    # adopted into the pool and copied to host; out of the pool (the host copy stays); loaded back
    assert kinds == [(BlockStored, "GPU"), (BlockStored, "CPU"), (BlockRemoved, "GPU"), (BlockStored, "GPU")]


def test_flush_empties_both_tiers():
    pool, cache = make()
    put(cache, pool, list(range(12)))
    cache.evict(1)
    cache.flush()
    assert cache.num_pages == 0 and cache.num_host_pages == 0 and pool.num_used == 0
    cache.check_integrity()


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_random_workload_keeps_tiers_consistent(policy):
    """Random inserts, matches, locks, evictions and loads over a small pool and host tier: after
    each operation the tree, the pool and the host tier agree, and every match reads the right KV."""
    rng = random.Random(7)
    pool, cache = make(num_pages=13, host_slots=20, policy=policy)
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(6)]
    locked = []
    for step in range(400):
        op = rng.random()
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        if op < 0.45:
            if pool.pages_for(len(tokens)) <= pool.num_free + cache.evictable_pages - 2:
                put(cache, pool, tokens)
        elif op < 0.65:
            pages, node = cache.match_prefix(tokens)
            assert_kv(pool, pages, tokens)
            if len(locked) < 2:
                cache.lock(node)
                locked.append(node)
        elif op < 0.8 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.95:
            cache.evict(rng.randrange(1, 5))
        else:
            cache.flush() if not locked else cache.evict(cache.evictable_pages)
        cache.check_integrity()
        pool.check_integrity()
        assert cache.held_pages() <= pool.used_pages()
    for n in locked:
        cache.unlock(n)
    cache.flush()
    assert pool.num_used == 0 and cache.num_host_pages == 0
    cache.check_integrity()
    if policy != "write_through_selective":
        assert cache.stats.host_hit_pages > 0
