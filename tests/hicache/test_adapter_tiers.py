"""LoRA adapters in the host and storage tiers: a page computed under one adapter comes back from
host memory or the store for that adapter only, never for another adapter or the base model; the
store keys it under the adapter's namespace, which a retrained adapter changes."""

from __future__ import annotations

import os

import pytest

from pdserve.engine.mem_cache.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockStored, block_hashes
from pdserve.engine.mem_cache.radix_cache import cache_key
from pdserve.engine.mem_cache.storage_key import adapter_namespace, page_key

from test_hiradix_cache import PS, assert_kv, make as make_hi, put
from test_store_cache import make as make_store, settle

A, B = 11, 22  # two adapters' lora ids
TOKENS = list(range(500, 513))  # 3 full pages + 1 token


@pytest.fixture
def adapter_dirs(tmp_path):
    """Two PEFT-looking adapter folders (their files' identity is what the namespace hashes)."""
    out = {}
    for name in ("a", "b"):
        d = tmp_path / name
        d.mkdir()
        (d / "adapter_config.json").write_text('{"r": 4}')
        (d / "adapter_model.safetensors").write_bytes(name.encode() * 64)
        out[name] = str(d)
    return out


def test_host_pages_come_back_only_under_their_adapter():
    pool, cache = make_hi(num_pages=9, host_slots=16)
    cache.enable_events()
    put(cache, pool, cache_key(TOKENS, A))
    assert cache.evict(3) == 3 and cache.num_pages == 0  # out of the pool, kept on host
    for other in (cache_key(TOKENS, B), TOKENS):  # another adapter, the base model
        assert cache.match_prefix(other)[0] == []
    assert cache.stats.host_hit_pages == 0
    pages, _ = cache.match_prefix(cache_key(TOKENS, A))
    assert len(pages) == 3 and cache.stats.host_hit_pages == 3
    assert_kv(pool, pages, TOKENS)
    cache.check_integrity()
    host_events = [e for e in cache.drain_events() if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
    assert host_events and {e.lora_id for e in host_events} == {A}
    assert host_events[0].block_hashes == block_hashes(TOKENS, PS, A)


def test_the_same_prompt_under_two_adapters_keeps_two_host_copies():
    pool, cache = make_hi(num_pages=9, host_slots=16)
    put(cache, pool, cache_key(TOKENS, A))
    put(cache, pool, cache_key(TOKENS, B))
    put(cache, pool, TOKENS)
    assert cache.num_host_pages == 9  # three namespaces, three pages each
    cache.check_integrity()


def test_store_shares_an_adapters_pages_and_never_crosses_adapters(tmp_path, adapter_dirs):
    store = tmp_path / "store"
    pool_w, writer = make_store(str(store))
    writer.name_adapter(A, adapter_dirs["a"])
    writer.name_adapter(B, adapter_dirs["b"])
    writer.enable_events()
    put(writer, pool_w, cache_key(TOKENS, A))
    settle(writer)
    ns_a = adapter_namespace(A, adapter_dirs["a"])
    want = sorted(page_key(writer.namespace, h, ns_a).replace("/", "_") for h in block_hashes(TOKENS, PS, A)[:3])
    assert sorted(os.listdir(store)) == want
    stored = [e for e in writer.drain_events() if isinstance(e, BlockStored) and e.medium == MEDIUM_STORAGE]
    assert [e.lora_id for e in stored] == [A]

    pool_r, reader = make_store(str(store))  # another server sharing the store and both adapters
    reader.name_adapter(A, adapter_dirs["a"])
    reader.name_adapter(B, adapter_dirs["b"])
    for rid, key in (("b", cache_key(TOKENS, B)), ("base", TOKENS)):
        reader.start_prefetch(rid, key)
        settle(reader, rid)
        assert reader.match_prefix(key)[0] == []
    assert reader.storage.stats.get_pages == 0
    reader.start_prefetch("a", cache_key(TOKENS, A))
    settle(reader, "a")
    pages, _ = reader.match_prefix(cache_key(TOKENS, A))
    assert len(pages) == 3 and reader.stats.store_hit_pages == 3
    assert_kv(pool_r, pages, TOKENS)
    reader.check_integrity()
    writer.close(), reader.close()


def test_an_unnamed_or_retrained_adapter_reads_and_writes_nothing_of_the_old(tmp_path, adapter_dirs):
    store = tmp_path / "store"
    pool_w, writer = make_store(str(store))
    put(writer, pool_w, cache_key(TOKENS, A))  # never named: its pages stay out of the store
    settle(writer)
    assert not store.exists() or os.listdir(store) == []
    writer.name_adapter(A, adapter_dirs["a"])
    put(writer, pool_w, cache_key(list(range(600, 613)), A))
    settle(writer)
    assert len(os.listdir(store)) == 3

    weights = os.path.join(adapter_dirs["a"], "adapter_model.safetensors")
    with open(weights, "ab") as f:  # retrained in place: other sizes, so another namespace
        f.write(b"x" * 7)
    pool_r, reader = make_store(str(store))
    reader.name_adapter(A, adapter_dirs["a"])
    reader.start_prefetch("r", cache_key(list(range(600, 613)), A))
    settle(reader, "r")
    assert reader.match_prefix(cache_key(list(range(600, 613)), A))[0] == []
    assert reader.storage.stats.get_pages == 0
    _, unnamed = make_store(str(store))
    unnamed.start_prefetch("r", cache_key(list(range(600, 613)), A))
    assert unnamed.prefetch_ready("r") and unnamed.storage.stats.get_pages == 0  # nothing asked
    writer.close(), reader.close(), unnamed.close()
