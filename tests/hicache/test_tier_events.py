"""KV events name the tier (vLLM's ``medium``): replaying a tiered cache's events rebuilds, tier by
tier, which pages sit in the pool ("GPU"), in host memory ("CPU") and were put in the store
("STORAGE"), through random L1 -> L2 -> L3 moves; a page fetched from the store is stored in
"CPU", then in "GPU" when a match loads it."""

from __future__ import annotations

import random
import time

import pytest
import torch

from pdserve.engine.mem_cache.file_storage import FileStorage
from pdserve.engine.mem_cache.host_pool import HostKVPool
from pdserve.engine.mem_cache.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    block_hash,
    decode_batch,
    encode_batch,
)
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.storage_key import kv_namespace
from pdserve.engine.mem_cache.storage_worker import StorageWorker
from pdserve.engine.mem_cache.store_cache import StoreHiRadixCache

from test_hiradix_cache import PS, put
from test_store_cache import settle


class TierMirror:
    """A subscriber's view of one rank: the block hashes of each tier, from the events alone."""

    def __init__(self):
        self.tiers: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "STORAGE": set()}

    def apply(self, events) -> None:
        # through the wire, as a subscriber gets them
        for ev in decode_batch(encode_batch(KVEventBatch(ts=0.0, events=events))).events:
            if isinstance(ev, BlockStored):
                tier = self.tiers[ev.medium]
                parent = ev.parent_block_hash
                for i, h in enumerate(ev.block_hashes):
                    # one event is one chain: each hash is its tokens' under the one before
                    assert h == block_hash(parent, ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size])
                    assert h not in tier, f"stored twice in {ev.medium} without a removal"
                    tier.add(h)
                    parent = h
            elif isinstance(ev, BlockRemoved):
                tier = self.tiers[ev.medium]
                for h in ev.block_hashes:
                    assert h in tier, f"removed from {ev.medium} a block never stored there"
                    tier.discard(h)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.tiers["GPU"].clear()
                self.tiers["CPU"].clear()


def tree_tiers(cache) -> tuple[set[int], set[int]]:
    pool, host, stack = set(), set(), list(cache.root.children.values())
    while stack:
        n = stack.pop()
        if n.page is not None:
            pool.add(n.hash)
        if n.host is not None:
            host.add(n.hash)
        stack.extend(n.children.values())
    return pool, host


def make(path, policy="write_through", prefetch="wait_complete"):
    pool = PagePool(13, PS, num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32)
    host = HostKVPool(pool, 20)
    worker = StorageWorker(lambda: FileStorage({"path": path}), host.slot_bytes)
    cache = StoreHiRadixCache(pool, host, policy, worker, kv_namespace("/models/m", pool.layout(), 0), prefetch)
    cache.enable_events()
    return pool, cache


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_events_rebuild_every_tier_through_random_moves(tmp_path, policy):
    rng = random.Random(11)
    pool, cache = make(str(tmp_path), policy)
    mirror = TierMirror()
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([4, 8, 12]))] for _ in range(6)]
    locked = []
    for _ in range(150):
        op = rng.random()
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        if op < 0.45:
            if pool.pages_for(len(tokens)) <= pool.num_free + cache.evictable_pages - 2:
                put(cache, pool, tokens)
        elif op < 0.65:
            _, node = cache.match_prefix(tokens)  # host pages load back: stored in GPU
            if len(locked) < 2:
                cache.lock(node)
                locked.append(node)
        elif op < 0.8 and locked:
            cache.unlock(locked.pop(rng.randrange(len(locked))))
        elif op < 0.95:
            cache.evict(rng.randrange(1, 5))  # to host (write-back copies now) or away
        else:
            cache.flush() if not locked else cache.evict(cache.evictable_pages)
        mirror.apply(cache.drain_events())
        assert (mirror.tiers["GPU"], mirror.tiers["CPU"]) == tree_tiers(cache)
        # every page put in the store (none dropped here) was published, once
        assert cache.storage.stats.dropped_puts == 0 and mirror.tiers["STORAGE"] == cache._put
    for n in locked:
        cache.unlock(n)
    cache.flush()
    mirror.apply(cache.drain_events())
    assert mirror.tiers["GPU"] == mirror.tiers["CPU"] == set() and mirror.tiers["STORAGE"]
    assert cache.stats.host_evicted_pages > 0 and cache.stats.host_hit_pages > 0
    settle(cache)
    cache.close()


def test_a_store_hit_is_stored_in_host_then_in_the_pool(tmp_path):
    tokens = list(range(200, 213))  # 3 full pages + 1 token
    pool_a, a = make(str(tmp_path))
    put(a, pool_a, tokens)
    deadline = time.monotonic() + 30
    while a.storage.stats.put_pages < 3 and time.monotonic() < deadline:  # written, not just queued
        time.sleep(0.01)
    assert [(type(e), e.medium) for e in a.drain_events()] == [
        (BlockStored, "GPU"), (BlockStored, "CPU"), (BlockStored, "STORAGE")]
    _, b = make(str(tmp_path))
    b.start_prefetch("r", tokens)
    settle(b, "r")
    pages, _ = b.match_prefix(tokens)
    events = b.drain_events()
    assert len(pages) == 3 and [(type(e), e.medium) for e in events] == [(BlockStored, "CPU"), (BlockStored, "GPU")]
    assert events[0].block_hashes == events[1].block_hashes and len(events[0].block_hashes) == 3
    a.close(), b.close()
