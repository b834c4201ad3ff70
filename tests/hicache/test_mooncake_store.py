"""The storage tier on a real Mooncake Store (``mooncake_master`` and a ``mooncake_client`` holding
the objects, started here): a prefix computed by one engine is a store hit on a fresh one (another
server, or the same one restarted), with the same greedy output, and the master killed mid-run costs
no request."""

from __future__ import annotations

import json
import signal
import time

import pytest

from pdserve.engine import Engine
from pdserve.entrypoints.mooncake_service import MooncakeService

pytestmark = pytest.mark.timeout(300)

GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
PROMPT = ("A shared system prompt for every turn of this conversation: you are a careful assistant who "
          "answers questions about rivers, bridges and the towns built along them. First question:")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    service = MooncakeService(str(tmp_path_factory.mktemp("mooncake")), segment_size="256MB").start()
    yield service
    service.stop()


def engine(store: MooncakeService) -> Engine:
    return Engine(dtype="float32", max_total_tokens=1024, num_threads=2, enable_hierarchical_cache=True, rank_on_thread=True,
                  hicache_storage_backend="mooncake", hicache_storage_prefetch_policy="wait_complete",
                  hicache_storage_backend_extra_config=json.dumps(store.extra_config()))


def test_a_planted_object_is_refused_deleted_and_replaced(store):
    """First writer wins in Mooncake Store: a pod without the store key plants a well-formed object
    under a page's key; a server with the key refuses it, deletes it, and its own page takes the key."""
    from pdserve.engine.mem_cache.mooncake_storage import MooncakeStorage
    from pdserve.engine.mem_cache.storage_object import ObjectCodec
    from pdserve.engine.mem_cache.storage_worker import StorageWorker

    size, key, h = 4096, "pdserve-kv/0123456789abcdef/00000000000000aa", 0xAA
    attacker = MooncakeStorage(store.extra_config())
    attacker.put(key, ObjectCodec(None).seal(key, h, b"\xee" * size))  # right tokens, no store key
    worker = StorageWorker(lambda: MooncakeStorage(store.extra_config()), size, ObjectCodec(b"s" * 32))

    def fetch() -> list[bytes]:
        worker.submit_fetch("r", 0, [key], [h])
        assert worker.wait_fetched(30)
        (result,) = worker.drain()
        return result.values

    assert fetch() == [] and worker.stats.corrupt == 1
    assert attacker.exists([key]) == [False]  # deleted: the key is free for the real page
    worker.submit_put(key, h, b"\x01" * size)
    deadline = time.monotonic() + 30
    while not worker.idle() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fetch() == [b"\x01" * size] and worker.stats.corrupt == 1
    worker.close()
    attacker.close()


def test_store_hit_on_a_fresh_server_then_master_killed(store):
    with engine(store) as a:
        first = a.generate(PROMPT, GREEDY)
        assert first["meta_info"]["cached_tokens"] == 0
    # a closed after its puts were sent; b is another server (or a restarted): its tree is empty
    with engine(store) as b:
        again = b.generate(PROMPT, GREEDY)
        n = again["meta_info"]["prompt_tokens"]
        assert again["meta_info"]["cached_tokens"] == (n - 1) // 16 * 16 > 0
        assert again["output_ids"] == first["output_ids"]
        cache = b.loop.cache
        assert b.call(lambda: cache.stats.store_hit_pages) == (n - 1) // 16
        b.check_integrity()
        store.master.send_signal(signal.SIGKILL)
        store.master.wait()
        for i in range(2):  # a new prompt (a fetch, then puts) and the old one (L1 hit)
            out = b.generate(f"Something else entirely, number {i}, about the weather in spring.", GREEDY)
            assert out["meta_info"]["finish_reason"] == {"type": "length"}
        assert b.generate(PROMPT, GREEDY)["output_ids"] == first["output_ids"]
        # the storage thread meets the dead master on its own time: the count comes within seconds
        deadline = time.monotonic() + 15
        while b.call(lambda: cache.storage.stats.errors) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert b.call(lambda: cache.storage.stats.errors) >= 1
        b.check_integrity()
