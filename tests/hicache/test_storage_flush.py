"""Shutdown and waiting on the storage tier: puts still queued when a cache closes reach the store
(bounded by a timeout), a stopping server's rank flushes them before it exits, and the scheduler's
idle wait for its queue head's prefetch wakes when the fetch lands. Over the real ``file`` backend,
slowed down so that puts are still queued when the close comes."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from pdserve.entrypoints.serve import stop_ranks
from pdserve.engine.mem_cache.file_storage import FileStorage
from pdserve.engine.mem_cache.storage_worker import StorageWorker
from pdserve.engine.sched.scheduler_process import flush_on_stop

from test_store_cache import make, settle
from test_hiradix_cache import put

PAGE_BYTES = 64


DELAY_S = 0.05


def slowed(method):
    """``method`` of the file backend, each call made slower (a busy store)."""

    def slow(self, *args):
        time.sleep(DELAY_S)
        return method(self, *args)

    return slow


class SlowFile(FileStorage):
    put = slowed(FileStorage.put)


def queue_puts(path: str, n: int) -> StorageWorker:
    worker = StorageWorker(lambda: SlowFile({"path": path}), PAGE_BYTES)
    for i in range(n):
        worker.submit_put(f"k/{i}", i, bytes([i]) * PAGE_BYTES)
    return worker


def test_close_sends_the_queued_puts_within_its_timeout(tmp_path):
    worker = queue_puts(str(tmp_path / "all"), 6)
    worker.close()
    assert len(os.listdir(tmp_path / "all")) == 6 and worker.stats.put_pages == 6
    worker = queue_puts(str(tmp_path / "some"), 40)  # 2 s of puts, 0.2 s given
    worker.close(timeout=0.2)
    sent = len(os.listdir(tmp_path / "some"))
    assert 1 <= sent < 40 and worker.stats.dropped_puts >= 40 - sent - 1  # one may be in flight


def _rank(path: str, ready) -> None:
    """A stand-in for a rank's process: a storage worker with queued puts, the rank's stop handler."""
    worker = queue_puts(path, 8)
    flush_on_stop(worker)
    ready.set()
    while True:
        time.sleep(1)


def test_a_stopping_servers_rank_flushes_its_queued_puts(tmp_path):
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    proc = ctx.Process(target=_rank, args=(str(tmp_path), ready), daemon=True)
    proc.start()
    assert ready.wait(30)
    stop_ranks([proc])  # what `pdserve serve` does on its way out
    assert proc.exitcode == 0  # exited by the handler, not SIGKILLed
    assert len(os.listdir(tmp_path)) == 8


def test_the_pd_loops_close_their_storage_tier(tmp_path, monkeypatch):
    """PrefillLoop.close and DecodeLoop.close close the cache too: the decode's write-back puts
    queued when the pair closes are on disk after it."""
    from support.loop_stand import PDPair

    from test_pd_write_back import hicache

    monkeypatch.setattr(FileStorage, "put", slowed(FileStorage.put))  # every server's puts slowed
    pair = PDPair(p_engine=hicache(str(tmp_path)), d_engine=hicache(str(tmp_path)))
    try:
        pair.submit("t1", list(range(1, 11)), max_new=8)
        pair.run(pair.done("t1"))
        pair.settle()
    finally:
        pair.close()
    # prefill: 2 full pages of the prompt; decode: prompt + answer but the last token, 4 pages (the
    # first 2 the same keys)
    assert len([f for f in os.listdir(tmp_path) if not f.endswith(".tmp")]) == 4
    assert not pair.decode.cache.storage._thread.is_alive()


@pytest.mark.timeout(120)
def test_the_idle_wait_for_a_prefetch_wakes_when_it_lands(tmp_path, monkeypatch):
    pool_a, a = make(str(tmp_path))
    tokens = list(range(300, 313))  # 3 full pages
    put(a, pool_a, tokens)
    settle(a)
    a.close()
    monkeypatch.setattr(FileStorage, "get", slowed(FileStorage.get))  # 3 pages: 0.15 s
    _, b = make(str(tmp_path))
    assert b.wait_for_prefetch("r1", 5.0) is False  # no prefetch: no wait
    b.start_prefetch("r1", tokens)
    # a timeout far past the test's own: only the landed fetch can end this wait
    assert b.wait_for_prefetch("r1", 3600.0) is True
    assert b.storage.wait_fetched(0.0)  # woken by a finished fetch that waits to be drained
    assert b.prefetch_ready("r1") and b.prefetch_outcomes["complete"] == 1
    assert b.wait_for_prefetch("r1", 5.0) is False
    b.close()
