"""Radix prefix cache: hits, page-aligned matching, locking and LRU eviction."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.radix_cache import NoPrefixCache, RadixCache

PS = 4


@pytest.fixture
def pool():
    return PagePool(17, PS, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32)


def put(cache, pool, tokens):
    """Simulate a finished request: allocate pages for ``tokens`` and hand them over."""
    pages, node = cache.match_prefix(tokens)
    cache.lock(node)
    new = pool.alloc(pool.pages_for(len(tokens)) - len(pages))
    cache.insert(tokens, pages + new, len(pages))
    cache.unlock(node)
    cache.check_integrity()
    pool.check_integrity()


def test_match_is_page_aligned_and_shares_pages(pool):
    cache = RadixCache(pool)
    put(cache, pool, list(range(10)))  # 2 full pages kept, partial third freed
    assert cache.num_pages == 2 and pool.num_used == 2
    pages, _ = cache.match_prefix(list(range(10)) + [99])
    assert len(pages) == 2
    pages2, _ = cache.match_prefix(list(range(7)))
    assert pages2 == pages[:1]
    assert cache.match_prefix([1, 2, 3, 4])[0] == []
    # the same prefix again: duplicate pages are freed, the tree is unchanged
    put(cache, pool, list(range(12)))
    assert cache.num_pages == 3 and pool.num_used == 3
    assert cache.held_pages() == pool.used_pages()


def test_locked_pages_survive_eviction_and_lru_order(pool):
    cache = RadixCache(pool)
    put(cache, pool, [1] * 8)
    put(cache, pool, [2] * 8)
    put(cache, pool, [3] * 8)
    assert cache.evictable_pages == 6
    pages, node = cache.match_prefix([1] * 8)  # touch and lock the oldest
    cache.lock(node)
    assert cache.evictable_pages == 4
    cache.match_prefix([3] * 8)  # touch: [2] is now least recent
    assert cache.evict(2) == 2
    assert cache.match_prefix([2] * 8)[0] == []
    assert len(cache.match_prefix([3] * 8)[0]) == 2
    assert cache.evict(100) == 2  # only [3]'s pages: [1] is locked
    assert cache.match_prefix([1] * 8)[0] == pages
    cache.check_integrity()
    cache.unlock(node)
    assert cache.flush() == 2 and pool.num_used == 0
    cache.check_integrity()
    pool.check_integrity()


def test_eviction_goes_leaf_first(pool):
    cache = RadixCache(pool)
    put(cache, pool, [5] * 12)  # a chain of 3 pages
    assert cache.evict(1) == 1
    assert len(cache.match_prefix([5] * 12)[0]) == 2  # the deepest page went first


def test_unlock_twice_is_caught(pool):
    cache = RadixCache(pool)
    put(cache, pool, [1] * 4)
    _, node = cache.match_prefix([1] * 4)
    cache.lock(node)
    cache.unlock(node)
    with pytest.raises(AssertionError):
        cache.unlock(node)


def test_no_prefix_cache_frees_everything(pool):
    cache = NoPrefixCache(pool)
    put(cache, pool, list(range(10)))
    assert pool.num_used == 0 and cache.match_prefix(list(range(10)))[0] == []


def test_adapter_namespaces_share_no_page(pool):
    """The same tokens under two adapters and the base are three prefixes; KV events name the
    adapter and carry the tokens without the namespace's salt."""
    from pdserve.engine.mem_cache.radix_cache import cache_key

    cache = RadixCache(pool)
    cache.enable_events()
    tokens = list(range(8))
    put(cache, pool, cache_key(tokens, 1))
    assert cache.match_prefix(tokens)[0] == [] and cache.match_prefix(cache_key(tokens, 2))[0] == []
    assert len(cache.match_prefix(cache_key(tokens + [9], 1))[0]) == 2
    put(cache, pool, tokens)
    put(cache, pool, cache_key(tokens, 2))
    assert cache.num_pages == 6 and len({p for p in cache.held_pages()}) == 6
    stored = cache.drain_events()
    assert [e.lora_id for e in stored] == [1, None, 2]
    assert all(e.token_ids == tokens for e in stored)
    assert len({e.block_hashes[0] for e in stored}) == 3
