"""The storage tier never serves wrong KV: every object carries its page's token hash and a checksum
(keyed when the store has a key); a corrupted, misplaced or planted object is refused, deleted,
counted and recomputed; the file backend is private, atomic and capped; the namespace follows a
weight update."""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
import torch

from pdserve.engine.mem_cache.file_storage import FileStorage, default_path
from pdserve.engine.mem_cache.host_pool import HostKVPool
from pdserve.engine.mem_cache.kv_events import block_hashes
from pdserve.engine.mem_cache.page_pool import PagePool
from pdserve.engine.mem_cache.storage_backend import StorageError
from pdserve.engine.mem_cache.storage_key import kv_namespace, page_key
from pdserve.engine.mem_cache.storage_object import HEADER_BYTES, ObjectCodec
from pdserve.engine.mem_cache.storage_worker import StorageWorker
from pdserve.engine.mem_cache.store_cache import StoreHiRadixCache

from test_hiradix_cache import PS, assert_kv, put
from test_store_cache import settle

KEY = b"k" * 40


def make(path: str, key: bytes | None = None) -> tuple[PagePool, StoreHiRadixCache]:
    pool = PagePool(9, PS, num_layers=2, num_kv_heads=2, head_dim=3, dtype=torch.float32)
    host = HostKVPool(pool, 16)
    worker = StorageWorker(lambda: FileStorage({"path": path}), host.slot_bytes, ObjectCodec(key))
    return pool, StoreHiRadixCache(pool, host, "write_through", worker,
                                   kv_namespace("/models/m", pool.layout(), 0), "wait_complete")


def fetch(path: str, tokens: list[int], key: bytes | None = None):
    """A fresh cache's prefetch of ``tokens``: (pages matched, its storage stats, pool, cache)."""
    pool, c = make(path, key)
    c.start_prefetch("r", tokens)
    settle(c, "r")
    pages, _ = c.match_prefix(tokens)
    return pages, c.storage.stats, pool, c


def object_path(tmp_path, cache: StoreHiRadixCache, tokens: list[int], page: int):
    return tmp_path / page_key(cache.namespace, block_hashes(tokens, PS)[page]).replace("/", "_")


def test_corrupted_object_is_refused_deleted_and_rewritten(tmp_path):
    pool_a, a = make(str(tmp_path))
    tokens = list(range(100, 113))  # 3 pages + 1
    put(a, pool_a, tokens)
    settle(a)
    second = object_path(tmp_path, a, tokens, 1)
    raw = bytearray(second.read_bytes())
    raw[HEADER_BYTES + 5] ^= 0x40  # one bit of the payload: the length is right, the checksum is not
    second.write_bytes(bytes(raw))

    pages, stats, pool_b, b = fetch(str(tmp_path), tokens)
    assert len(pages) == 1 and stats.corrupt == 1  # the chain ends at the bad object
    assert_kv(pool_b, pages, tokens)
    assert not second.exists()  # deleted, so that the recomputed page replaces it
    put(b, pool_b, tokens)  # the request recomputes pages 2 and 3, which are written again
    settle(b)
    pages, stats, pool_c, c = fetch(str(tmp_path), tokens)
    assert len(pages) == 3 and stats.corrupt == 0
    assert_kv(pool_c, pages, tokens)
    for x in (a, b, c):
        x.check_integrity()
        x.close()


def test_planted_objects_are_refused(tmp_path):
    """A valid object of another page put under this page's key (token hash differs); and, with a
    store key, an object a stranger sealed for the right tokens without the key."""
    pool_a, a = make(str(tmp_path), KEY)
    tokens = list(range(200, 209))  # 2 pages + 1
    put(a, pool_a, tokens)
    settle(a)
    first, second = object_path(tmp_path, a, tokens, 0), object_path(tmp_path, a, tokens, 1)
    first.write_bytes(second.read_bytes())
    pages, stats, _, b = fetch(str(tmp_path), tokens, KEY)
    assert pages == [] and stats.corrupt == 1 and not first.exists()

    h = block_hashes(tokens, PS)[0]
    forged = ObjectCodec(None).seal(page_key(a.namespace, h), h, b"\0" * a.host.slot_bytes)
    first.write_bytes(forged)
    pages, stats, _, c = fetch(str(tmp_path), tokens, KEY)
    assert pages == [] and stats.corrupt == 1 and not first.exists()
    for x in (a, b, c):
        x.close()


def test_file_backend_folder_is_private(tmp_path):
    assert stat.S_IMODE(os.stat(FileStorage({"path": str(tmp_path / "new")}).path).st_mode) == 0o700
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    FileStorage({"path": str(shared)})
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o700  # fixed: it is this user's
    os.symlink(shared, tmp_path / "link")
    with pytest.raises(StorageError, match="not a directory"):
        FileStorage({"path": str(tmp_path / "link")})
    if os.geteuid() != 0 and os.path.exists("/"):
        with pytest.raises(StorageError, match="owned by uid 0"):
            FileStorage({"path": "/"})  # a folder of another user (root's)
    assert default_path() != "/tmp/pdserve-hicache" and str(os.geteuid()) in default_path()


def test_file_backend_writes_atomically_and_replaces(tmp_path):
    s = FileStorage({"path": str(tmp_path)})
    s.put("ns/a", b"x" * 10)
    s.put("ns/a", b"y" * 10)  # a put replaces (a bad object never survives a put)
    assert s.get("ns/a") == b"y" * 10
    assert os.listdir(tmp_path) == ["ns_a"]  # no temporary file left
    assert stat.S_IMODE(os.stat(tmp_path / "ns_a").st_mode) == 0o600  # mkstemp's mode
    s.delete("ns/a")
    assert s.get("ns/a") is None and s.used_bytes == 0


def test_file_backend_lru_byte_cap(tmp_path):
    s = FileStorage({"path": str(tmp_path), "max_bytes": 30})
    for k in "abc":
        s.put(f"ns/{k}", k.encode() * 10)
        time.sleep(0.01)  # distinct mtimes for the restart below
    assert s.get("ns/a") == b"a" * 10  # a is now the most recent
    time.sleep(0.01)
    s.put("ns/d", b"d" * 10)  # evicts b, the least recently used
    assert s.exists(["ns/a", "ns/b", "ns/c", "ns/d"]) == [True, False, True, True] and s.used_bytes == 30
    s.put("ns/big", b"z" * 31)  # never fits: not stored, nothing evicted
    assert s.exists(["ns/big"]) == [False] and s.used_bytes == 30
    again = FileStorage({"path": str(tmp_path), "max_bytes": 20})  # a restart with a smaller cap
    assert again.used_bytes == 30
    again.put("ns/e", b"e" * 10)
    assert sorted(os.listdir(tmp_path)) == ["ns_d", "ns_e"]  # c, then a (touched before d was written) went
    with pytest.raises(StorageError, match="max_bytes"):
        FileStorage({"path": str(tmp_path), "max_bytes": -1})


@pytest.mark.timeout(300)
def test_namespace_follows_a_weight_update(tmp_path):
    """A server reads and writes under the new weights' name after update_weights_from_disk."""
    from pdserve.engine import Engine

    from support.model_util import make_tiny_checkpoint

    a, b, store = tmp_path / "a", tmp_path / "b", tmp_path / "store"
    make_tiny_checkpoint("llama", str(a))
    make_tiny_checkpoint("llama", str(b))
    prompt = list(range(10, 60))
    greedy = {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True}

    def namespaces() -> set[str]:
        return {name.split("_")[1] for name in os.listdir(store)}

    with Engine(model_path=str(a), dtype="float32", max_total_tokens=512, num_threads=1, rank_on_thread=True,
                enable_hierarchical_cache=True, hicache_storage_backend="file",
                hicache_storage_backend_extra_config=json.dumps({"path": str(store)})) as engine:
        def written() -> set[str]:
            end = time.monotonic() + 60
            while not engine.call(lambda: engine.loop.cache.storage.idle()) and time.monotonic() < end:
                time.sleep(0.05)
            return namespaces()

        engine.generate(input_ids=prompt, sampling_params=greedy)
        before = written()
        assert len(before) == 1
        ok, message = engine.update_weights_from_disk(str(b))
        assert ok, message
        engine.generate(input_ids=prompt, sampling_params=greedy)
        after = written()
        layout = engine.call(lambda: engine.loop.pool.layout())
        assert engine.call(lambda: engine.loop.cache.namespace) == kv_namespace(str(b), layout, 0)
        assert len(after) == 2 and before < after
