"""The storage tier over the ``file`` backend: pages written by one cache are prefetched by another
(same namespace), and faults (wrong length, unreachable store, other namespace) cost only recompute."""

from __future__ import annotations

import os
import time

import torch

from pdserve.engine.mem_cache.file_storage import FileStorage
from pdserve.engine.mem_cache.host_pool import HostKVPool
from pdserve.engine.mem_cache.storage_key import kv_namespace, page_key
from pdserve.engine.mem_cache.storage_worker import StorageWorker
from pdserve.engine.mem_cache.store_cache import StoreHiRadixCache
from pdserve.engine.mem_cache.kv_events import block_hashes
from pdserve.engine.mem_cache.page_pool import PagePool

from test_hiradix_cache import PS, assert_kv, put


def make(path: str, policy: str = "wait_complete", namespace: str | None = None, connect=None):
    pool = PagePool(9, PS, num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32)
    host = HostKVPool(pool, 16)
    worker = StorageWorker(connect or (lambda: FileStorage({"path": path})), host.slot_bytes)
    ns = namespace or kv_namespace("/models/m", pool.layout(), 0)
    return pool, StoreHiRadixCache(pool, host, "write_through", worker, ns, policy)


def settle(cache: StoreHiRadixCache, rid: str | None = None, timeout: float = 10.0) -> None:
    """Wait for the worker's puts, or for ``rid``'s prefetch to let it in."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if rid is None and cache.storage.idle():  # written, not just dequeued
            return
        if rid is not None and cache.prefetch_ready(rid):
            return
        time.sleep(0.01)
    raise AssertionError("storage worker did not finish")


def test_pages_written_by_one_cache_are_prefetched_by_another(tmp_path):
    pool_a, a = make(str(tmp_path))
    tokens = list(range(200, 213))  # 3 full pages + 1 token
    put(a, pool_a, tokens)
    settle(a)
    assert a.storage.stats.put_pages == 3 and len(os.listdir(tmp_path)) == 3
    pool_b, b = make(str(tmp_path))
    b.start_prefetch("r1", tokens)
    assert not b.prefetch_ready("r1") or b.storage.stats.prefetch_done  # wait_complete: held until fetched
    settle(b, "r1")
    pages, _ = b.match_prefix(tokens)
    assert len(pages) == 3 and b.stats.store_hit_pages == 3 and b.stats.host_hit_pages == 0
    assert_kv(pool_b, pages, tokens)
    assert b.prefetch_outcomes["complete"] == 1
    b.check_integrity()
    a.close(), b.close()


def test_other_namespace_and_wrong_length_are_misses(tmp_path):
    pool_a, a = make(str(tmp_path))
    tokens = list(range(300, 309))  # 2 pages + 1
    put(a, pool_a, tokens)
    settle(a)
    _, other = make(str(tmp_path), namespace="0123456789abcdef")
    other.start_prefetch("r", tokens)
    settle(other, "r")
    assert other.match_prefix(tokens)[0] == [] and other.storage.stats.get_pages == 0
    # truncate the first page's object: the chain ends there
    first = page_key(a.namespace, block_hashes(tokens, PS)[0]).replace("/", "_")
    with open(tmp_path / first, "r+b") as f:
        f.truncate(10)
    _, b = make(str(tmp_path))
    b.start_prefetch("r", tokens)
    settle(b, "r")
    assert b.match_prefix(tokens)[0] == [] and b.storage.stats.corrupt == 1
    b.check_integrity()
    a.close(), other.close(), b.close()


def test_unreachable_store_is_counted_and_costs_no_wait(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # a directory below a regular file can never be created: every connect fails
    pool, c = make(str(blocker / "store"), policy="wait_complete")
    put(c, pool, list(range(8)) + [1])
    settle(c)
    assert c.storage.stats.errors == 1 and not c.storage.available
    c.start_prefetch("r", list(range(16)) + [1])  # breaker open: no prefetch started
    assert c.prefetch_ready("r")
    put(c, pool, list(range(16, 24)) + [1])  # puts are dropped while the breaker is open
    assert c.storage.stats.dropped_puts >= 2
    c.check_integrity()
    c.close()


def test_cancelled_prefetch_takes_no_host_slots(tmp_path):
    pool_a, a = make(str(tmp_path))
    tokens = list(range(400, 409))
    put(a, pool_a, tokens)
    settle(a)
    _, b = make(str(tmp_path))
    b.start_prefetch("r", tokens)
    b.cancel_prefetch("r")
    time.sleep(0.3)
    b.poll_storage()
    assert b.num_host_pages == 0 and b.prefetch_outcomes["cancelled"] == 1
    b.check_integrity()
    a.close(), b.close()
